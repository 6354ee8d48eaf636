"""Tooling around the app, never shipped in a job's ``app/custom`` (which holds only the
``fedpartial`` runtime package that sites and the server execute): the command line, job
packaging and the simulator run, import of a site's own images, data partitioning and synthetic
data, evaluation of model files, POC / provisioning helpers, the benchmark and its reports,
throughput, privacy experiments and example data."""
