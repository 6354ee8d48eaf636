"""Packaging a job folder into a runnable one: ``--set`` overrides applied, the runtime version it
needs, the ``fedpartial`` runtime package carried in ``app/custom`` (bring-your-own-code, so POC
and provisioned sites accept it), and the ``min_clients`` check against the sites there are."""
from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Dict, Optional, Sequence

import fedpartial
from fedpartial.flare.common import runtime_identity
from fedpartial_tools.jobs.settings import _config_paths, apply_overrides


# Components that refuse a job naming another runtime version than the installed fedpartial.
RUNTIME_CHECKED = ("fedpartial.flare.executors.FedPartialExecutor", "fedpartial.flare.persistor.FedPartialPersistor")


def package_job(job_dir: str, out_dir: str, overrides: Sequence[str] = (), data_root: Optional[str] = None,
                with_code: bool = True, name: Optional[str] = None, runtime_version: Optional[str] = None,
                dataset: Optional[str] = None) -> str:
    """Copy ``job_dir`` to ``out_dir`` with overrides applied, the runtime version it needs written
    into its fedpartial executor and persistor, and (``with_code``) the fedpartial package in
    ``app/custom`` (bring-your-own-code). Returns ``out_dir``.

    Args:
        job_dir: a folder of ``jobs/``.
        out_dir: where the runnable job goes (replaced if present).
        overrides: ``key=value`` settings (see :func:`apply_overrides`).
        data_root: sets the client's ``data_root`` (where each site finds ``<site>.npz``): for
            development sites (simulator, POC) only; a provisioned site refuses a job that sets it.
        dataset: the name of the dataset each provisioned site offers for this federation
            (``local/fedpartial_site.json``); clears ``data_root``.
        with_code: copy the package into the job (bring-your-own-code: POC, and consortia whose
            sites grant the byoc right). False: the job names only classes, for sites with the
            runtime installed (``build-runtime``) and ``fedpartial.`` on their class allow-list.
        name: job name in meta.json (default: keep).
        runtime_version: the runtime the job needs (default: this checkout's
            :func:`~fedpartial.flare.common.runtime_identity`, version and content hash);
            sites and server with another version installed refuse the job at its start. "" = write
            none (the folders of ``jobs/``, derived from each other).
    """
    job_dir = os.path.abspath(job_dir)
    if not os.path.isfile(os.path.join(job_dir, "meta.json")):
        raise FileNotFoundError(f"'{job_dir}' is not a job folder (no meta.json)")
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    shutil.copytree(job_dir, out_dir, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    paths = _config_paths(out_dir)
    configs = {side: json.load(open(p)) for side, p in paths.items()}
    sets = list(overrides)
    if data_root is not None and dataset is not None:
        raise ValueError("package_job: give a dataset name (provisioned sites) or a data_root (development), not both")
    if data_root is not None:
        sets.insert(0, f"client.data_root={json.dumps(os.path.abspath(data_root))}")
    if dataset is not None:
        sets[:0] = [f"client.dataset={json.dumps(str(dataset))}", 'client.data_root=""']
    apply_overrides(configs, sets)
    if runtime_version != "":
        set_runtime_version(configs, runtime_identity() if runtime_version is None else runtime_version)
    for side, p in paths.items():
        with open(p, "w") as f:
            f.write(json.dumps(configs[side], indent=2) + "\n")
    meta_path = os.path.join(out_dir, "meta.json")
    meta = json.load(open(meta_path))
    if name:
        meta["name"] = name
    if "min_clients" in configs["server"]:
        meta["min_clients"] = configs["server"]["min_clients"]
    meta["description"] = packaged_description(meta.get("description", ""), configs["server"], configs["client"],
                                               dataset, data_root)
    with open(meta_path, "w") as f:
        f.write(json.dumps(meta, indent=2) + "\n")
    if with_code:
        for app in glob.glob(os.path.join(out_dir, "*", "config")):
            copy_runtime(os.path.join(os.path.dirname(app), "custom"))
    return out_dir


def packaged_description(shipped: str, server: dict, client: dict, dataset: Optional[str] = None,
                         data_root: Optional[str] = None) -> str:
    """What a packaged job says it is: the method (the shipped description up to its first ':' or
    '. ') and the settings it was packaged with (sites, rounds, classes, data), not the data setting
    the shipped job describes (e.g. "5 sites x 3 annotated classes")."""
    import re

    method = re.split(r":|\. ", shipped, maxsplit=1)[0].strip().rstrip(".") or "fedpartial job"
    model = server.get("model") or {}
    classes = model.get("class_names") or []
    counted = f"{len(classes)} class{'es' if len(classes) != 1 else ''}"
    parts = [f"min_clients {server['min_clients']}" if "min_clients" in server else "",
             f"{server['num_rounds']} rounds" if "num_rounds" in server else "",
             f"{model.get('task', '?')}, {counted} ({', '.join(map(str, classes))})" if classes else "",
             f"model {model['arch']}" if model.get("arch") else "",
             f"dataset '{dataset}'" if dataset else (f"data_root {data_root}" if data_root else "")]
    for component in client.get("executors", []):  # the rule's name, when the executor names one
        rule = ((component.get("executor") or {}).get("args") or {}).get("rule")
        if isinstance(rule, str):
            parts.append(f"client rule '{rule}'")
            break
    return f"{method}. Packaged with: " + "; ".join(p for p in parts if p) + "."


def set_runtime_version(configs: Dict[str, dict], version: str) -> int:
    """Write ``runtime_version`` into the args of every :data:`RUNTIME_CHECKED` component of the
    client / server configs (in place). Returns how many components got it."""
    found = 0
    for config in configs.values():
        comps = [e.get("executor", {}) for e in config.get("executors", [])] + list(config.get("components", []))
        for comp in comps:
            if comp.get("path") in RUNTIME_CHECKED:
                comp.setdefault("args", {})["runtime_version"] = str(version)
                found += 1
    return found


def check_min_clients(job_dir: str, sites: Sequence[str], what: str = "the deployment has") -> int:
    """Refuse a job whose ``min_clients`` exceeds the sites there are: FLARE would keep it SUBMITTED,
    silently, until that many sites connect. Returns the job's ``min_clients``.

    Args:
        job_dir: a packaged job (``meta.json``).
        sites: the site names the job can run on.
        what: how the message introduces ``sites`` (e.g. "the server lists").
    """
    meta_path = os.path.join(job_dir, "meta.json")
    need = int(json.load(open(meta_path)).get("min_clients", 1))
    if need > len(sites):
        raise ValueError(f"job '{job_dir}' needs min_clients={need} but {what} {len(sites)} site(s) "
                         f"({', '.join(sites) or 'none'}): FLARE would keep it SUBMITTED until {need} sites connect. "
                         f"Package it with --set min_clients={len(sites)} (or start / add the missing sites)")
    return need


# Not shipped: the ``python -m fedpartial`` entry point, a shim onto fedpartial_tools.cli.
NOT_SHIPPED = ("__main__.py", "__pycache__", "*.pyc")


def copy_runtime(custom_dir: str) -> str:
    """Copy the runtime package (what sites and the server execute: ``fedpartial`` without its
    command-line shim) into a job's ``app/custom``. Returns the package's folder there."""
    pkg = os.path.dirname(os.path.abspath(fedpartial.__file__))
    dest = os.path.join(custom_dir, "fedpartial")
    shutil.copytree(pkg, dest, ignore=shutil.ignore_patterns(*NOT_SHIPPED))
    return dest
