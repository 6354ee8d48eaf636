"""The FLARE simulator run behind ``python -m fedpartial simulate``: one site per site file, the job
packaged with its code, one progress line per round, and the results collected."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from fedpartial_tools.data.sites import site_names
from fedpartial_tools.jobs.packaging import package_job
from fedpartial_tools.jobs.settings import _config_paths
from fedpartial_tools.run.progress import RoundProgress
from fedpartial_tools.run.results import collect_results


# runs the file given as first argument as __main__, without putting its folder on sys.path
_RUN_FILE = "import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name='__main__')"
FLARE_SIMULATOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flare_simulator.py")


def simulate(job_dir: str, data_root: str, workspace: str, overrides: Sequence[str] = (), threads: int = 0,
             timeout: Optional[float] = None, log=print, progress_every: float = 3.0,
             torch_threads: Optional[int] = None) -> dict:
    """Run a job in the FLARE simulator, one site per site file, and collect the results in
    ``workspace``: ``global_model.pt``, ``best_global_model.pt``, ``metrics.json``,
    ``cross_site_val.json``, ``tb/`` (TensorBoard events of the server and every site).

    Args:
        job_dir: a folder of ``jobs/``.
        data_root: folder of site files (``site-1.npz`` ...).
        workspace: output folder (created).
        overrides: ``key=value`` settings.
        threads: parallel client threads (0 = all sites at once).
        timeout: seconds before the simulator is stopped.
        log: progress printer (one line per aggregated round).
        progress_every: seconds between looks at the server's metrics.json.
        torch_threads: torch threads of each site's process (default ``$FEDPARTIAL_THREADS``, else 1
            with several sites): trainings run side by side divide the machine's cores.

    Returns:
        a summary: ``exit_code``, ``seconds``, ``workspace``, ``errors``, ``num_rounds``,
        ``rounds_completed`` and ``ok`` (exit 0 and every round aggregated).
    """
    data_root = os.path.abspath(data_root)
    if not os.path.isdir(data_root):
        raise FileNotFoundError(f"data root '{data_root}' does not exist")
    sites = site_names(data_root)
    workspace = os.path.abspath(workspace)
    os.makedirs(workspace, exist_ok=True)
    # The code travels in the job even here: NVFlare 2.9's simulator enforces the component
    # allow-list too, and a job that passes here then runs unchanged in POC.
    job = package_job(job_dir, os.path.join(workspace, "job"),
                      [f"server.min_clients={len(sites)}", *overrides], data_root=data_root, with_code=True)
    sim_ws = os.path.join(workspace, "simulator")
    shutil.rmtree(sim_ws, ignore_errors=True)
    # FLARE's simulator with its client threads made safe (a worker could run as another site), run
    # from its file: it imports only nvflare, so a process that sees nothing of this checkout runs it
    cmd = [sys.executable, "-c", _RUN_FILE, FLARE_SIMULATOR, job, "-w", sim_ws,
           "-c", ",".join(sites), "-t", str(threads or len(sites))]
    env = dict(os.environ)
    if torch_threads:
        env["FEDPARTIAL_THREADS"] = str(int(torch_threads))
    env.setdefault("FEDPARTIAL_THREADS", "1" if len(sites) > 1 else "")
    if not env["FEDPARTIAL_THREADS"]:
        env.pop("FEDPARTIAL_THREADS")
    # The simulator deletes its temporary job copy while client processes may still be writing
    # __pycache__ into the carried code ("Directory not empty"): no bytecode files.
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    own_tmp = None
    if "TMPDIR" not in env:
        # multiprocessing puts its manager's socket under TMPDIR; AF_UNIX paths stop at 107 bytes,
        # so a deep workspace gets a short private folder instead (removed after the run).
        env["TMPDIR"] = os.path.join(os.path.abspath(workspace), "tmp")
        if len(env["TMPDIR"]) > 48:
            env["TMPDIR"] = own_tmp = tempfile.mkdtemp(prefix="fp-sim-")
    os.makedirs(env["TMPDIR"], exist_ok=True)
    server_config = json.load(open(_config_paths(job)["server"]))
    num_rounds, key_metric = int(server_config.get("num_rounds", 0)), str(server_config.get("key_metric", ""))
    log(f"simulating {os.path.basename(job_dir.rstrip('/'))} with {len(sites)} sites: {', '.join(sites)}; "
        f"{num_rounds} rounds")
    started = time.time()
    progress = RoundProgress(num_rounds, key_metric, log, started)
    with open(os.path.join(workspace, "simulator.log"), "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=progress_every)
                    break
                except subprocess.TimeoutExpired:
                    if timeout is not None and time.time() - started > timeout:
                        raise
                    progress.update(_server_metrics(sim_ws))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise RuntimeError(f"simulator exceeded {timeout} s; log: {workspace}/simulator.log\n"
                               + stall_report(workspace, sites))
        finally:
            if own_tmp:
                shutil.rmtree(own_tmp, ignore_errors=True)
    progress.update(_server_metrics(sim_ws))
    summary = collect_results(sim_ws, workspace, rc, time.time() - started, log)
    summary.update(num_rounds=num_rounds, rounds_completed=progress.rounds_done)
    summary["ok"] = rc == 0 and progress.rounds_done >= num_rounds
    return summary


def stall_report(workspace: str, sites: Sequence[str], tail: int = 25) -> str:
    """What a stopped run had reached, for an error message read where the workspace is gone (a CI
    log): each process's last log line (server and sites) and the simulator log's tail.

    Args:
        workspace: the run's output folder (``simulator.log``, ``simulator/``).
        sites: the site names.
        tail: lines of ``simulator.log`` to quote.
    """
    def last_lines(path: str, count: int) -> list:
        try:
            with open(path, errors="replace") as handle:
                return [line.rstrip("\n") for line in handle.readlines()[-count:]]
        except OSError:
            return ["(no log)"]

    sim_ws = os.path.join(workspace, "simulator")
    lines = [f"{name}: {(last_lines(os.path.join(sim_ws, name, 'log.txt'), 1) or ['(empty log)'])[0]}"
             for name in ["server", *sites]]
    lines += [f"simulator.log, last {tail} lines:", *last_lines(os.path.join(workspace, "simulator.log"), tail)]
    return "\n".join(lines)


def _server_metrics(sim_ws: str) -> Optional[str]:
    hits = glob.glob(os.path.join(sim_ws, "server", "*", "metrics.json"))
    return hits[0] if hits else None
