"""Running a job in the FLARE simulator: the run itself (:mod:`.simulator`), the progress line of
each aggregated round (:mod:`.progress`, also read by the POC / provisioned runs of
:mod:`fedpartial_tools.deploy`), and the results collected from a simulator workspace
(:mod:`.results`). May import the runtime, :mod:`fedpartial_tools.data` and
:mod:`fedpartial_tools.jobs`."""
