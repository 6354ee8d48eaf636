"""Job folders and recipes: a job's settings and ``--set`` overrides with the constructor defaults
(:mod:`.settings`, which imports no recipe), the named profiles (:mod:`.profiles`), the FLARE
recipes built on them (:mod:`.recipes`), matching a baseline to its method (:mod:`.matching`),
packaging a runnable job with the runtime carried in ``app/custom`` (:mod:`.packaging`), and the
repository's ``jobs/`` folder: finding a job by name or ``RECIPE:PROFILE`` and the ``jobs`` check
(:mod:`.folders`). May import the runtime and :mod:`fedpartial_tools.data`."""
