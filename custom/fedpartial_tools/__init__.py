"""Tooling around the app, never shipped in a job's ``app/custom`` (which holds only the
``fedpartial`` runtime package that sites and the server execute).

* ``cli`` (``python -m fedpartial`` / ``python -m fedpartial_tools``) and ``evaluate``: the user's commands;
* ``jobs/``: job settings and ``--set``, the FLARE recipes and their profiles, baseline matching, packaging;
* ``run/``: the simulator run, its progress lines and its results;
* ``data/``: a site's own data (importers), partitioning, synthetic and example data, harmonising sources;
* ``model/``: what a hospital does with a result model (predict, export);
* ``deploy/``: provisioning, builders, certificates, admin sessions, processes, site bundles;
* ``bench/``: the benchmark (suites, runner, tables, plots), throughput, streaming and privacy experiments.

The few top-level modules besides these are stable public names that re-export (``recipes``,
``provision_builders``) or run (``privacy``, ``streaming``, ``fedia_report``, ``dicom_example``) their code.
"""
