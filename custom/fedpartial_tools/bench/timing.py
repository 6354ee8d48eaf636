"""``python -m fedpartial_tools timing``: a training's fixed cost. For one job on one data root it
reports, each from one run:

* start-up: launch (the simulator command, or the POC job's submission) until the first round is
  aggregated, the job at one local step a round (so this is FLARE and the sites' set-up, not
  training);
* FLARE's floor: the median time between two aggregations at one local step a round (rounds 2
  on: task requests, model exchange, the sites' validation, aggregation);
* training per round: the median over rounds of the slowest site's ``train_seconds`` (its
  validation and local training) with the job's own recipe.

Configurations (``--config NAME=key=value;key=value``) run one after the other in the same
invocation, so their figures compare like with like on a noisy machine. The time settings of a
job are its variables ``task_request_interval``, ``task_check_period`` and ``memory_gc_rounds``
(:data:`fedpartial_tools.jobs.recipes.TIMING`); ``flare-defaults`` sets FLARE's own (2 s, 0.5 s, 1).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

#: FLARE 2.9's own timing: what a job without these variables runs with
FLARE_DEFAULTS = ["task_request_interval=2.0", "task_check_period=0.5", "memory_gc_rounds=1"]


def round_times(metrics_file: str, launched: float) -> Dict[str, float]:
    """Start-up, per-round time and local time from a server ``metrics.json``.

    Args:
        metrics_file: the server's per-round record (``aggregated_at``, each site's ``train_seconds``).
        launched: the wall-clock time the run was launched (``time.time()``).

    Returns:
        ``startup_s`` (launch to the first aggregation), ``round_s`` (median time between two
        aggregations from the second round on), ``train_s`` (median over rounds of the slowest site's
        ``train_seconds``), ``rounds``.
    """
    rounds = json.load(open(metrics_file))["rounds"]
    if not rounds:
        raise ValueError(f"'{metrics_file}' records no aggregated round")
    stamps = [float(r["aggregated_at"]) for r in rounds]
    local = [max((float(s.get("train_seconds", 0.0)) for s in r["sites"].values()), default=0.0) for r in rounds]
    gaps = np.diff(stamps)
    return {"startup_s": stamps[0] - launched, "round_s": float(np.median(gaps)) if len(gaps) else float("nan"),
            "train_s": float(np.median(local[1:] if len(local) > 1 else local)), "rounds": len(rounds)}


def _simulate(job: str, data_root: str, ws: str, sets: Sequence[str], threads: int) -> Dict[str, float]:
    from fedpartial_tools.run.simulator import simulate

    launched = time.time()
    summary = simulate(job, data_root, ws, list(sets), threads=threads, log=lambda *_: None)
    if not summary.get("ok"):
        raise RuntimeError(f"simulator run of {job} failed: see {ws}/simulator.log")
    out = round_times(os.path.join(ws, "metrics.json"), launched)
    out["total_s"] = time.time() - launched
    return out


def _poc(job: str, data_root: str, state: str, sets: Sequence[str]) -> Dict[str, float]:
    """The job submitted to a POC system already running in ``state`` (poc/start.sh)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    cmd = ["bash", os.path.join(repo, "poc", "run_job.sh"), state, job, "--data-root", data_root]
    for s in sets:
        cmd += ["--set", s]
    launched = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"POC run of {job} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    result = [ln.split("; result in ", 1)[1].strip() for ln in proc.stdout.splitlines() if "; result in " in ln][-1]
    found = [os.path.join(d, "metrics.json") for d, _, files in os.walk(result) if "metrics.json" in files]
    if not found:
        raise RuntimeError(f"no metrics.json in the POC result {result}")
    out = round_times(found[0], launched)
    out["total_s"] = time.time() - launched
    return out


def measure(job: str, data_root: str, out_dir: str, configs: Dict[str, List[str]], rounds: int = 12,
            threads: int = 0, poc_state: str = "", repeats: int = 1, log=print) -> List[dict]:
    """Every configuration's start-up, floor and training per round, one after the other.

    Args:
        job: a job folder.
        data_root: its site files.
        out_dir: the runs' workspaces (replaced).
        configs: name -> ``--set`` items of that configuration.
        rounds: rounds of each run.
        threads: simulator client processes (0 = one per site).
        poc_state: a running POC system's state folder: the runs go there instead of the simulator.
        repeats: runs of each configuration (the rows keep each).
        log: progress printer.
    """
    rows = []
    for rep in range(repeats):
        for name, sets in configs.items():
            row = {"config": name, "repeat": rep, "where": "poc" if poc_state else "simulator"}
            for kind, extra in (("floor", ["rule_args.local_iterations=1"]), ("recipe", [])):
                ws = os.path.join(out_dir, f"{name}_{kind}_{rep}")
                shutil.rmtree(ws, ignore_errors=True)
                run_sets = [f"num_rounds={rounds}", *sets, *extra]
                got = (_poc(job, data_root, poc_state, run_sets) if poc_state
                       else _simulate(job, data_root, ws, run_sets, threads))
                if kind == "floor":
                    row.update(startup_s=got["startup_s"], floor_round_s=got["round_s"], floor_total_s=got["total_s"])
                else:
                    row.update(recipe_round_s=got["round_s"], train_s=got["train_s"], recipe_total_s=got["total_s"])
            log(format_row(row))
            rows.append(row)
    return rows


def format_row(row: dict) -> str:
    return (f"{row['where']} {row['config']}: start-up {row['startup_s']:.1f} s, FLARE's floor "
            f"{row['floor_round_s']:.2f} s a round, recipe round {row['recipe_round_s']:.2f} s of which training "
            f"{row['train_s']:.2f} s")


def table(rows: Sequence[dict]) -> str:
    """Markdown: per configuration the median over repeats, and the ratio to the first configuration."""
    names = list(dict.fromkeys(r["config"] for r in rows))
    keys = ("startup_s", "floor_round_s", "recipe_round_s", "train_s")
    med = {n: {k: float(np.median([r[k] for r in rows if r["config"] == n])) for k in keys} for n in names}
    first = med[names[0]]
    lines = ["| configuration | start-up (s) | FLARE's floor (s / round) | recipe round (s) | of which training (s) "
             f"| floor vs {names[0]} | start-up vs {names[0]} |", "|---|---|---|---|---|---|---|"]
    for n in names:
        m = med[n]
        lines.append(f"| {n} | {m['startup_s']:.1f} | {m['floor_round_s']:.2f} | {m['recipe_round_s']:.2f} | "
                     f"{m['train_s']:.2f} | {m['floor_round_s'] / first['floor_round_s']:.2f} | "
                     f"{m['startup_s'] / first['startup_s']:.2f} |")
    return "\n".join(lines)


def parse_config(text: str) -> tuple:
    """``NAME=key=value;key=value`` (``NAME=`` alone: the job as it is; ``flare-defaults``: FLARE's timing)."""
    name, _, sets = text.partition("=")
    if not name:
        raise ValueError(f"--config '{text}': give NAME=key=value;...")
    items = [s for s in sets.split(";") if s]
    return name, (FLARE_DEFAULTS + items if name == "flare-defaults" else items)


def _cmd(args):
    configs = dict(parse_config(c) for c in (args.config or ["flare-defaults=", "shipped="]))
    from fedpartial_tools.data.sites import dataset_overrides

    job = args.job if os.path.isdir(args.job) else os.path.join("jobs", args.job)
    base = dataset_overrides(args.data_root) + list(args.set)  # the model block fitted to the site files
    configs = {n: base + s for n, s in configs.items()}
    rows = measure(job, os.path.abspath(args.data_root), args.out, configs, rounds=args.rounds, threads=args.threads,
                   poc_state=os.path.abspath(args.poc) if args.poc else "", repeats=args.repeats)
    md = table(rows)
    print(md)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "timing.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "timing.md"), "w") as f:
        f.write(md + "\n")


def add_timing_parser(sub) -> None:
    s = sub.add_parser("timing", help="a training's fixed cost: start-up, FLARE's floor per round, training per round")
    s.add_argument("--job", default="fedavg", help="a job folder or a name of jobs/")
    s.add_argument("--data-root", required=True, help="the site files (python -m fedpartial split ...)")
    s.add_argument("--out", required=True, help="workspaces, timing.json and timing.md")
    s.add_argument("--rounds", type=int, default=12)
    s.add_argument("--config", action="append", default=None, metavar="NAME=key=value;...",
                   help="a configuration to time (repeatable; default: flare-defaults= and shipped=)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting of every run")
    s.add_argument("--threads", type=int, default=0, help="simulator client processes (0 = one per site)")
    s.add_argument("--repeats", type=int, default=1, help="runs of each configuration, interleaved")
    s.add_argument("--poc", default="", metavar="STATE",
                   help="time the job in the POC system running in STATE (poc/start.sh STATE) instead of the simulator")
    s.set_defaults(func=_cmd)
