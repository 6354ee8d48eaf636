"""Deployment beyond the simulator: provisioning a project and the runtime that sites install
(:mod:`.provision`, the site-policy builder :mod:`.builders`, site bundles :mod:`.bundle`,
the model user's tools wheel :mod:`.tools_wheel`),
certificates (:mod:`.certs`), the admin API (:mod:`.admin`), the processes of POC / provisioned
kits (:mod:`.processes`), and the ``python -m fedpartial_tools.deploy`` command (:mod:`.cli`).
May import the runtime, :mod:`fedpartial_tools.data`, :mod:`fedpartial_tools.jobs` and
:mod:`fedpartial_tools.run`."""
