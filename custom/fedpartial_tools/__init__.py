"""Tooling around the app (benchmarks, examples): never shipped in a job's app/custom, which holds only
what sites and the server execute (the ``fedpartial`` package)."""
