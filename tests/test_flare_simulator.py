"""The two thread-safety fixes that fedpartial_tools.run.flare_simulator applies to FLARE's simulator
(each test reproduces its race by hand, with threads, on FLARE's own SimulatorClientRunner)."""
import pickle
import socket
import threading
import time
from types import SimpleNamespace

import pytest
from nvflare.private.fed.app.simulator import simulator_runner
from nvflare.private.fed.app.simulator.simulator_runner import SimulatorClientRunner

from fedpartial_tools.run import flare_simulator


@pytest.fixture
def patched(monkeypatch):
    # monkeypatch restores FLARE's methods afterwards: other tests see the class unchanged
    monkeypatch.setattr(SimulatorClientRunner, "__init__", SimulatorClientRunner.__init__)
    monkeypatch.setattr(SimulatorClientRunner, "get_next_run_client", SimulatorClientRunner.get_next_run_client)
    monkeypatch.setattr(SimulatorClientRunner, "do_one_task", SimulatorClientRunner.do_one_task)
    monkeypatch.setattr(simulator_runner, "get_open_ports", simulator_runner.get_open_ports)
    monkeypatch.setattr(SimulatorClientRunner, "_create_connection", SimulatorClientRunner._create_connection)
    flare_simulator.patch()


def _runner(tmp_path, clients=(), build_ctx=None):
    args = SimpleNamespace(workspace=str(tmp_path), set=[])
    return SimulatorClientRunner("", args, list(clients), {}, SimpleNamespace(), build_ctx or {"job": "simulate_job"})


def test_each_client_thread_sends_its_own_site_name(tmp_path, patched):
    """Two threads write their site's name into build_ctx, then both send it (as FLARE's do_one_task
    does, pickled to the worker): each worker must receive its own site, and the other values."""
    runner = _runner(tmp_path)
    both_written = threading.Barrier(2)
    sent = {}

    def do_one_task(site):
        runner.build_ctx["client_name"] = site
        both_written.wait(timeout=5)
        sent[site] = pickle.loads(pickle.dumps({"build_ctx": runner.build_ctx}))["build_ctx"]

    threads = [threading.Thread(target=do_one_task, args=(s,)) for s in ("site-2", "site-3")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sent == {"site-2": {"job": "simulate_job", "client_name": "site-2"},
                    "site-3": {"job": "simulate_job", "client_name": "site-3"}}
    assert type(sent["site-2"]) is dict


def test_a_site_picked_by_one_thread_is_not_picked_by_another(tmp_path, patched):
    """Two threads, three sites. Thread A runs site-1 and has just picked site-3 as its next; thread B
    runs site-2 and picks its next while site-1 is still marked running: it must wait for site-1
    (which A releases after its task) rather than take site-3 as well."""
    sites = [SimpleNamespace(client_name=f"site-{k}", simulate_running=False) for k in (1, 2, 3)]
    runner = _runner(tmp_path, sites)
    sites[0].simulate_running = sites[1].simulate_running = True  # A on site-1, B on site-2
    runner.run_client_index = 1
    assert runner.get_next_run_client(None) is sites[2]  # A's pick
    picked = []
    b = threading.Thread(target=lambda: picked.append(runner.get_next_run_client(None)), daemon=True)
    b.start()
    time.sleep(0.2)
    sites[0].simulate_running = False  # A's task on site-1 has ended
    b.join(timeout=5)
    assert [s.client_name for s in picked] == ["site-1"]
    assert all(s.simulate_running for s in (sites[0], sites[2]))


def test_a_thread_that_stops_releases_the_site_it_picked_next(tmp_path, patched, monkeypatch):
    """Two threads, three sites, the run ends: thread A's last task on site-1 picks site-3 as its next
    and then stops. Thread B, still on site-2, must then find a free site (site-3) rather than wait for
    ever for a site that no thread will run."""
    sites = [SimpleNamespace(client_name=f"site-{k}", simulate_running=False) for k in (1, 2, 3)]
    runner = _runner(tmp_path, sites)
    sites[0].simulate_running = sites[1].simulate_running = True  # A on site-1, B on site-2
    runner.run_client_index = 1

    def last_task(self, client, *args, **kwargs):  # FLARE's do_one_task when the server ends the run
        return True, self.get_next_run_client(None), client.client_name

    monkeypatch.setattr(flare_simulator, "_original_task", last_task)
    stop_run, picked, _ = runner.do_one_task(sites[0], 2, None, threading.Lock())
    assert stop_run and picked is sites[2]
    assert not sites[2].simulate_running
    b_next = []
    b = threading.Thread(target=lambda: b_next.append(runner.get_next_run_client(None)), daemon=True)
    b.start()
    b.join(timeout=5)
    assert [s.client_name for s in b_next] == ["site-3"]


def test_a_workers_port_is_taken_by_no_other_socket_until_the_worker_is_reached(tmp_path, patched):
    """The port a worker is to listen on stays held: no other socket can bind it, the worker's own
    listener can, and once the runner has reached the worker the port is let go."""
    from multiprocessing.connection import Listener

    assert isinstance(simulator_runner.get_open_ports, flare_simulator.ReservedPorts)
    port = simulator_runner.get_open_ports(1)[0]
    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with pytest.raises(OSError):
        other.bind(("", port))
    other.close()
    worker = Listener(("localhost", port))  # what FLARE's simulator_worker does
    accepted = threading.Thread(target=lambda: worker.accept().close(), daemon=True)
    accepted.start()
    _runner(tmp_path)._create_connection(port, timeout=5).close()
    accepted.join(timeout=5)
    worker.close()
    # released (a bind test would meet the closed connection's TIME_WAIT instead)
    assert port not in simulator_runner.get_open_ports._held


def test_a_stopped_run_reports_where_each_process_was(tmp_path):
    """A run stopped at its time limit says, in the error itself, each process's last log line and the
    simulator log's tail: a CI log keeps the message, not the workspace."""
    from fedpartial_tools.run.simulator import stall_report
    for name, text in {"server": "Round 0 started.\nRound 1 started.\n", "site-1": "train round 1\n"}.items():
        (tmp_path / "simulator" / name).mkdir(parents=True)
        (tmp_path / "simulator" / name / "log.txt").write_text(text)
    (tmp_path / "simulator.log").write_text("".join(f"line {i}\n" for i in range(40)))
    report = stall_report(str(tmp_path), ["site-1", "site-2"], tail=3).splitlines()
    assert report == ["server: Round 1 started.", "site-1: train round 1", "site-2: (no log)",
                      "simulator.log, last 3 lines:", "line 37", "line 38", "line 39"]
