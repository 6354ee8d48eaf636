"""The repository's ``jobs/`` folder: finding a job by folder, name or ``RECIPE:PROFILE`` (exported
from the recipes once per process), and the ``jobs`` command that checks or rewrites ``jobs/``
against the recipes' exports."""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import tempfile
from typing import Dict, List, Optional, Tuple

JOBS_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "jobs"))


_EXPORTS: Dict[Tuple[str, str], str] = {}  # (recipe, profile) -> its export, read-only, made once


def _remove_exports() -> None:
    for folder in _EXPORTS.values():
        shutil.rmtree(os.path.dirname(folder), ignore_errors=True)


def find_job(job: str, profile: Optional[str] = None) -> str:
    """A job folder: ``job`` as a path, a name of the repository's ``jobs/`` (``fedlsm``), or a
    recipe with a profile (``fedmlp:ctich``, or ``job="fedmlp", profile="ctich"``), exported from
    :mod:`fedpartial_tools.jobs.recipes` once per process into a temporary folder (removed at exit; read
    it, never change it).

    Args:
        job: folder, job name or ``RECIPE:PROFILE``.
        profile: a profile of the recipe ``job`` names (``None``: the folder as it is).
    """
    if ":" in job and not os.path.isdir(job):
        job, profile = job.split(":", 1)
    if profile in (None, "", "cpu"):
        if os.path.isdir(job):
            return job
        named = os.path.join(JOBS_DIR, job)
        if os.path.sep not in job and os.path.isdir(named):
            return named
        raise FileNotFoundError(f"job '{job}' is neither a folder nor a job of {JOBS_DIR}")
    from fedpartial_tools.jobs.recipes import RECIPES, export_job

    name = os.path.basename(job.rstrip("/"))
    if name not in RECIPES:
        raise ValueError(f"profile '{profile}' needs a recipe's job (one of {sorted(RECIPES)}), got '{job}'")
    if (name, profile) not in _EXPORTS:  # a bench asks for the same profile once per job and seed
        if not _EXPORTS:
            atexit.register(_remove_exports)
        folder = os.path.join(tempfile.mkdtemp(prefix="fedpartial-job-"), f"{name}_{profile}")
        _EXPORTS[(name, profile)] = export_job(name, folder, profile)
    return _EXPORTS[(name, profile)]


def _json_files(folder: str) -> Dict[str, object]:
    out = {}
    for root, _, files in os.walk(folder):
        for file in files:
            path = os.path.join(root, file)
            out[os.path.relpath(path, folder)] = json.load(open(path)) if file.endswith(".json") else None
    return out


def drift(jobs_dir: str = JOBS_DIR) -> List[str]:
    """One line per folder of ``jobs_dir`` that differs from its recipe's export (or is missing,
    or has no recipe)."""
    from fedpartial_tools.jobs.recipes import RECIPES, export_job

    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in RECIPES:
            have = os.path.join(jobs_dir, name)
            if not os.path.isdir(have):
                problems.append(f"jobs/{name}: missing (python -m fedpartial_tools jobs --write)")
                continue
            want, got = _json_files(export_job(name, os.path.join(tmp, name))), _json_files(have)
            for file in sorted(set(want) | set(got)):
                if want.get(file, "absent") != got.get(file, "absent"):
                    problems.append(f"jobs/{name}/{file} differs from the {RECIPES[name].__name__} export "
                                    f"(python -m fedpartial_tools jobs --write)")
        for folder in sorted(os.listdir(jobs_dir)):
            if folder not in RECIPES and os.path.isdir(os.path.join(jobs_dir, folder)):
                problems.append(f"jobs/{folder}: no recipe exports it (a profile of a recipe instead?)")
    return problems


def write_all(jobs_dir: str = JOBS_DIR) -> List[str]:
    """Export every recipe's cpu profile into ``jobs_dir``; returns the names."""
    from fedpartial_tools.jobs.recipes import RECIPES, export_job

    for name in RECIPES:
        export_job(name, os.path.join(jobs_dir, name))
    return list(RECIPES)


def add_jobs_parser(sub) -> None:
    p = sub.add_parser("jobs", help="check or regenerate jobs/ from the recipes (fedpartial_tools.jobs.recipes)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="report folders that differ from their recipe's export "
                                                        "(default)")
    g.add_argument("--write", action="store_true", help="export every recipe's cpu profile into jobs/")
    g.add_argument("--list", action="store_true", help="the recipes and their profiles")
    p.set_defaults(func=_cmd_jobs)


def _cmd_jobs(args: argparse.Namespace) -> None:
    from fedpartial_tools.jobs.recipes import RECIPES

    if args.list:
        for name, cls in RECIPES.items():
            print(f"{name:20s} {cls.__name__:24s} profiles: {', '.join(cls.PROFILES)}")
        return
    if args.write:
        for name in write_all():
            print(f"wrote jobs/{name}")
        return
    problems = drift()
    for line in problems:
        print(line)
    if problems:
        raise SystemExit(1)
    print(f"{len(RECIPES)} job folders match their recipes' exports")
