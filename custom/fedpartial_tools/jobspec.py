"""One source of truth for job folders that differ from another only in a few settings.

``job_variants.json`` (beside this module) names each derived folder of ``jobs/``: its ``base``
folder, the ``set`` items that make it (the ``--set`` syntax of ``simulate`` and
``package-job``) and its ``description``. The derived folders stay plain FLARE job folders, the
ones users submit; they are written from the description (``python -m fedpartial_tools jobs
--write``), and :func:`drift` reports every folder that no longer equals base + set (the test
suite runs it).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from typing import Dict, List, Optional

from fedpartial_tools.jobtools import JOBS_DIR

SPEC_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "job_variants.json")


def load_spec(path: str = SPEC_FILE) -> Dict[str, dict]:
    """The derived jobs of ``path``: ``{name: {"base", "set", "description"}}``."""
    spec = {k: v for k, v in json.load(open(path)).items() if not k.startswith("_")}
    for name, entry in spec.items():
        missing = [k for k in ("base", "set", "description") if k not in entry]
        if missing:
            raise ValueError(f"{path}: job '{name}' lacks {missing}")
        if entry["base"] == name:
            raise ValueError(f"{path}: job '{name}' is its own base")
    return spec


def derive(name: str, out_dir: str, spec: Optional[Dict[str, dict]] = None, jobs_dir: str = JOBS_DIR) -> str:
    """Write the derived job ``name`` into ``out_dir``: its base (derived first when the base is
    itself derived) with the ``set`` items applied, ``meta.json`` name and description set.

    Args:
        name: a key of the spec.
        out_dir: where the job folder goes (replaced).
        spec: the loaded spec (default: :data:`SPEC_FILE`).
        jobs_dir: where the base folders are.
    """
    from fedpartial_tools.jobtools import package_job

    spec = load_spec() if spec is None else spec
    entry = spec[name]
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = os.path.join(jobs_dir, entry["base"])
        if entry["base"] in spec:  # a variant of a variant
            base_dir = derive(entry["base"], os.path.join(tmp, entry["base"]), spec, jobs_dir)
        package_job(base_dir, out_dir, entry["set"], with_code=False, name=name, runtime_version="")
    meta_path = os.path.join(out_dir, "meta.json")
    meta = json.load(open(meta_path))
    meta["description"] = entry["description"]
    with open(meta_path, "w") as f:
        f.write(json.dumps(meta, indent=2) + "\n")
    return out_dir


def _json_files(folder: str) -> Dict[str, object]:
    out = {}
    for root, _, files in os.walk(folder):
        for file in files:
            if file.endswith(".json"):
                path = os.path.join(root, file)
                out[os.path.relpath(path, folder)] = json.load(open(path))
    return out


def drift(jobs_dir: str = JOBS_DIR, spec: Optional[Dict[str, dict]] = None) -> List[str]:
    """One line per derived job folder that differs from its base + set (or is missing)."""
    spec = load_spec() if spec is None else spec
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in spec:
            have = os.path.join(jobs_dir, name)
            if not os.path.isdir(have):
                problems.append(f"jobs/{name}: missing (python -m fedpartial_tools jobs --write)")
                continue
            want = _json_files(derive(name, os.path.join(tmp, name), spec, jobs_dir))
            got = _json_files(have)
            for file in sorted(set(want) | set(got)):
                if want.get(file) != got.get(file):
                    problems.append(f"jobs/{name}/{file} differs from {spec[name]['base']} + {spec[name]['set']}")
    return problems


def write_all(jobs_dir: str = JOBS_DIR, spec: Optional[Dict[str, dict]] = None) -> List[str]:
    """Regenerate every derived job folder; returns their names."""
    spec = load_spec() if spec is None else spec
    for name in spec:
        out = os.path.join(jobs_dir, name)
        derive(name, out + ".tmp", spec, jobs_dir)
        shutil.rmtree(out, ignore_errors=True)
        os.rename(out + ".tmp", out)
    return list(spec)


def add_jobs_parser(sub) -> None:
    p = sub.add_parser("jobs", help="check or regenerate the job folders derived from another (job_variants.json)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="report folders that drifted from base + set (default)")
    g.add_argument("--write", action="store_true", help="regenerate the derived folders")
    p.set_defaults(func=_cmd_jobs)


def _cmd_jobs(args: argparse.Namespace) -> None:
    if args.write:
        for name in write_all():
            print(f"wrote jobs/{name}")
        return
    problems = drift()
    for line in problems:
        print(line)
    if problems:
        raise SystemExit(1)
    print(f"{len(load_spec())} derived job folders match their base + set")
