"""FLARE 2.9's simulator with its thread-safety fixed: ``python .../flare_simulator.py`` takes the
arguments of ``python -m nvflare.private.fed.app.simulator.simulator``. ``simulate`` runs it from its
file, since it imports only nvflare (a run may hide this checkout from its processes).

FLARE's simulator runs each site in a worker process started by one of its client threads:

* The threads share one ``build_ctx`` dict, and each writes its site's name into it just before
  sending it to its worker. Under load a worker can receive another thread's name and run as that
  site, so one site trains twice and another never (seen on a loaded 2-core machine: "Initialize
  ClientRunner for client: site-3" twice and no site-2; a round then closes without a site, or never).
  Here each thread sees its own copy.
* With fewer threads than sites, a thread picks its next site under the runner's lock but marks it
  running only later, outside it, so another thread can pick the same site. Here the pick marks it,
  and a thread that stops (the run has ended) releases a pick it will not run: else the other
  threads' next pick would wait for it for ever.

* Each thread asks the system for a free port, closes it, and its new worker listens on it. In that
  gap another socket can take the port (seen with three simulators started together: "Address
  already in use"); the worker then dies, or another run's thread reaches it, and a round waits for
  a site for ever. Here the port stays bound until the worker is reached (:class:`ReservedPorts`).

These are patched on FLARE's class in this process, which the simulator forks to run its client
threads (the site workers are new processes and take no part); nothing that ships to a site imports
this module.
"""
import runpy
import socket
import threading

from nvflare.private.fed.app.simulator import simulator_runner
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
_original_task = SimulatorClientRunner.do_one_task


def _init(self, server_custom_folder, args, clients, client_config, deploy_args, build_ctx):
    _original_init(self, server_custom_folder, args, clients, client_config, deploy_args,
                   PerThreadBuildContext(build_ctx))


def _next_run_client(self, gpu):
    client = _original_next(self, gpu)
    client.simulate_running = True  # still under the caller's lock: no other thread can pick it now
    return client


class ReservedPorts:
    """FLARE's ``get_open_ports`` for the workers' ports, each kept bound until its worker is reached.

    FLARE finds a free port, closes it, and the new worker listens on it; in that gap any process's
    socket (another simulator's worker, an outgoing connection) can take it. A port here stays bound
    with ``SO_REUSEADDR`` and without listening: the system hands it to no one else, and the worker's
    listener (``multiprocessing``'s, which sets ``SO_REUSEADDR`` too) may still listen on it.
    """

    def __init__(self):
        self._held = {}
        self._lock = threading.Lock()

    def __call__(self, number: int) -> list:
        ports = []
        for _ in range(number):
            holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind(("", 0))
            port = holder.getsockname()[1]
            with self._lock:
                self._held[port] = holder
            ports.append(port)
        return ports

    def release(self, port: int) -> None:
        """Close the socket holding ``port`` (its worker is listening, or never will)."""
        with self._lock:
            holder = self._held.pop(port, None)
        if holder is not None:
            holder.close()


_original_connect = SimulatorClientRunner._create_connection


def _create_connection(self, open_port, timeout=60.0):
    try:
        return _original_connect(self, open_port, timeout=timeout)
    finally:
        if isinstance(simulator_runner.get_open_ports, ReservedPorts):
            simulator_runner.get_open_ports.release(open_port)


def _one_task(self, client, *args, **kwargs):
    stop_run, next_client, end_run_client = _original_task(self, client, *args, **kwargs)
    if stop_run and next_client is not None and next_client is not client:
        next_client.simulate_running = False  # picked, but this thread stops before running it
    return stop_run, next_client, end_run_client


def patch() -> None:
    """Apply the fixes to FLARE's ``SimulatorClientRunner`` (idempotent)."""
    SimulatorClientRunner.__init__ = _init
    SimulatorClientRunner.get_next_run_client = _next_run_client
    SimulatorClientRunner.do_one_task = _one_task
    SimulatorClientRunner._create_connection = _create_connection
    if not isinstance(simulator_runner.get_open_ports, ReservedPorts):
        simulator_runner.get_open_ports = ReservedPorts()


if __name__ == "__main__":
    patch()
    runpy.run_module("nvflare.private.fed.app.simulator.simulator", run_name="__main__", alter_sys=True)
