"""FLARE 2.9's simulator with two thread-safety fixes: ``python .../flare_simulator.py`` takes the
arguments of ``python -m nvflare.private.fed.app.simulator.simulator``. ``simulate`` runs it from its
file, since it imports only nvflare (a run may hide this checkout from its processes).

FLARE's simulator runs each site in a worker process started by one of its client threads:

* The threads share one ``build_ctx`` dict, and each writes its site's name into it just before
  sending it to its worker. Under load a worker can receive another thread's name and run as that
  site, so one site trains twice and another never (seen on a loaded 2-core machine: "Initialize
  ClientRunner for client: site-3" twice and no site-2; a round then closes without a site, or never).
  Here each thread sees its own copy.
* With fewer threads than sites, a thread picks its next site under the runner's lock but marks it
  running only later, outside it, so another thread can pick the same site. Here the pick marks it.

Both are patched on FLARE's class in this process, which the simulator forks to run its client
threads (the site workers are new processes and take no part); nothing that ships to a site imports
this module.
"""
import runpy
import threading

from nvflare.private.fed.app.simulator.simulator_runner import SimulatorClientRunner


class PerThreadBuildContext:
    """The simulator's ``build_ctx``: each thread reads and writes its own copy of the shared
    values, and a pickled one (what a worker receives) is a plain dict of its thread's view.

    Args:
        shared: the values every thread starts from.
    """

    def __init__(self, shared: dict):
        self._shared = dict(shared)
        self._local = threading.local()

    def _own(self) -> dict:
        own = getattr(self._local, "values", None)
        if own is None:
            own = self._local.values = dict(self._shared)
        return own

    def __getitem__(self, key):
        return self._own()[key]

    def __setitem__(self, key, value):
        self._own()[key] = value

    def __reduce__(self):
        return dict, (dict(self._own()),)


_original_init = SimulatorClientRunner.__init__
_original_next = SimulatorClientRunner.get_next_run_client


def _init(self, server_custom_folder, args, clients, client_config, deploy_args, build_ctx):
    _original_init(self, server_custom_folder, args, clients, client_config, deploy_args,
                   PerThreadBuildContext(build_ctx))


def _next_run_client(self, gpu):
    client = _original_next(self, gpu)
    client.simulate_running = True  # still under the caller's lock: no other thread can pick it now
    return client


def patch() -> None:
    """Apply both fixes to FLARE's ``SimulatorClientRunner`` (idempotent)."""
    SimulatorClientRunner.__init__ = _init
    SimulatorClientRunner.get_next_run_client = _next_run_client


if __name__ == "__main__":
    patch()
    runpy.run_module("nvflare.private.fed.app.simulator.simulator", run_name="__main__", alter_sys=True)
