"""Turning a job folder of ``jobs/`` into a runnable one: config overrides (``--set``), the
package carried in ``app/custom`` (bring-your-own-code, so POC and provisioned sites accept it),
and the FLARE simulator run behind ``python -m fedpartial simulate``."""
from __future__ import annotations

import atexit
import copy
import functools
import glob
import importlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

import fedpartial
from fedpartial.algorithms.registry import rule_class, rule_path
from fedpartial.flare.common import runtime_identity

CONFIGS = {"server": "config_fed_server.json", "client": "config_fed_client.json"}
RESULT_FILES = ("global_model.pt", "best_global_model.pt", "metrics.json", "model_card.md", "model_card.json")


def parse_value(text: str):
    """``--set`` values are JSON when they parse as JSON (numbers, lists, true), else strings."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _config_paths(job_dir: str) -> Dict[str, str]:
    paths = {}
    for side, name in CONFIGS.items():
        found = glob.glob(os.path.join(job_dir, "*", "config", name))
        if not found:
            raise FileNotFoundError(f"job '{job_dir}' has no */config/{name}")
        paths[side] = found[0]
    return paths


_LISTS = ("components", "workflows", "executors", "task_result_filters", "task_data_filters")


def _components(config: dict) -> List[tuple]:
    """``(class path, args)`` of every component, workflow, executor and filter of a config."""
    out = []
    for key in ("components", "workflows", "task_result_filters", "task_data_filters"):
        for item in config.get(key, []):
            if "path" in item:
                out.append((item["path"], item.setdefault("args", {})))
            for f in item.get("filters", []):
                out.append((f["path"], f.setdefault("args", {})))
    for item in config.get("executors", []):
        out.append((item["executor"]["path"], item["executor"].setdefault("args", {})))
    return out


def _set_path(target: dict, path: List[str], value, create: bool) -> bool:
    node = target
    for part in path[:-1]:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    if not isinstance(node, dict) or (path[-1] not in node and not create):
        return False
    node[path[-1]] = value
    return True


@functools.lru_cache(maxsize=None)
def _constructor_defaults(class_path: str) -> tuple:
    module, name = class_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    params = inspect.signature(cls.__init__).parameters.values()
    return tuple((p.name, None if p.default is p.empty else p.default) for p in params
                 if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def constructor_defaults(class_path: str) -> dict:
    """The constructor arguments of ``class_path`` and their defaults (``None`` where there is none).

    Args:
        class_path: e.g. ``fedpartial.algorithms.fedlsm.FedLSMClient``.
    """
    return {name: copy.deepcopy(default) for name, default in _constructor_defaults(class_path)}


#: the fedpartial components that run a registered rule, and on which side
RULE_SIDES = {"fedpartial.flare.executors.FedPartialExecutor": "client",
              "fedpartial.flare.aggregators.RuleAggregator": "server"}


def _rule_side(class_path: str) -> Optional[str]:
    """``client`` / ``server`` for the runtime's executor / aggregator or a subclass (a test's
    attacking executor), else None."""
    if class_path in RULE_SIDES:
        return RULE_SIDES[class_path]
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    for base, side in RULE_SIDES.items():
        base_module, _, base_name = base.rpartition(".")
        if isinstance(cls, type) and issubclass(cls, getattr(importlib.import_module(base_module), base_name)):
            return side
    return None


def _rule_of(class_path: str, args: dict) -> Optional[str]:
    """The class path of the rule a fedpartial executor / aggregator runs (its ``rule`` or default)."""
    side = _rule_side(class_path)
    if side is None:
        return None
    return rule_path(side, args.get("rule", constructor_defaults(class_path).get("rule")))


def _accepts(class_path: str, args: dict, path: List[str]) -> bool:
    """Whether the component takes the setting ``path`` (an argument, or ``rule_args.<key>`` of its rule)."""
    try:
        if len(path) == 1:
            return path[0] in constructor_defaults(class_path)
        rule = _rule_of(class_path, args)
        return len(path) == 2 and path[0] == "rule_args" and rule is not None and path[1] in constructor_defaults(rule)
    except (ImportError, AttributeError, ValueError):
        return False


def apply_overrides(configs: Dict[str, dict], overrides: Sequence[str]) -> None:
    """Apply ``key=value`` overrides to the loaded server / client configs in place.

    ``a.b.c=v`` sets a top-level variable where the config has it (``num_rounds``, ``model.arch``,
    ``seed``); otherwise the argument of every component that takes it, written in the job or left
    at the constructor's default (``data_file``, ``rule_args.lr`` for every rule accepting ``lr``).
    Prefix with ``server.`` or ``client.`` to touch one side only; only then may the last key be a
    new top-level variable. A key that nothing takes is an error (typos never pass silently).
    """
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set '{item}' is not key=value")
        key, raw = item.split("=", 1)
        value = parse_value(raw)
        path = key.split(".")
        sides = list(configs)
        create = False
        if path[0] in configs:
            sides, path, create = [path[0]], path[1:], True
        hit = False
        for side in sides:
            config = configs[side]
            if path[0] in config and path[0] not in _LISTS:
                hit = _set_path(config, path, value, create=False) or hit
                continue
            for class_path, args in _components(config):
                if _set_path(args, path, value, create=False):
                    hit = True
                elif _accepts(class_path, args, path):
                    if len(path) == 2:
                        args.setdefault(path[0], {})
                    hit = _set_path(args, path, value, create=True) or hit
        if not hit and create:
            hit = _set_path(configs[sides[0]], path, value, create=True)
        if not hit:
            raise ValueError(f"--set '{key}': no such setting in the job's configs (nor an argument of its components)")


# Components that refuse a job naming another runtime version than the installed fedpartial.
RUNTIME_CHECKED = ("fedpartial.flare.executors.FedPartialExecutor", "fedpartial.flare.persistor.FedPartialPersistor")


# What a baseline takes from the method it is compared with, so that a comparison is of rules,
# not of networks or recipes: the whole model block but the classes (and the local recipe, see
# :func:`recipe_of`).
SHARED_MODEL_KEYS = ("arch", "arch_args", "in_channels", "input_size", "normalisation", "pretrained")
JOBS_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "jobs"))


_EXPORTS: Dict[Tuple[str, str], str] = {}  # (recipe, profile) -> its export, read-only, made once


def _remove_exports() -> None:
    for folder in _EXPORTS.values():
        shutil.rmtree(os.path.dirname(folder), ignore_errors=True)


def find_job(job: str, profile: Optional[str] = None) -> str:
    """A job folder: ``job`` as a path, a name of the repository's ``jobs/`` (``fedlsm``), or a
    recipe with a profile (``fedmlp:ctich``, or ``job="fedmlp", profile="ctich"``), exported from
    :mod:`fedpartial_tools.recipes` once per process into a temporary folder (removed at exit; read
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
    from fedpartial_tools.recipes import RECIPES, export_job

    name = os.path.basename(job.rstrip("/"))
    if name not in RECIPES:
        raise ValueError(f"profile '{profile}' needs a recipe's job (one of {sorted(RECIPES)}), got '{job}'")
    if (name, profile) not in _EXPORTS:  # a bench asks for the same profile once per job and seed
        if not _EXPORTS:
            atexit.register(_remove_exports)
        folder = os.path.join(tempfile.mkdtemp(prefix="fedpartial-job-"), f"{name}_{profile}")
        _EXPORTS[(name, profile)] = export_job(name, folder, profile)
    return _EXPORTS[(name, profile)]


def job_settings(job_dir: str, overrides: Sequence[str] = ()) -> dict:
    """The effective client ``rule`` (registered name), ``model`` block, client ``rule_args`` (the
    rule's constructor defaults where the job leaves them) and ``num_rounds`` of a job folder.

    Args:
        job_dir: the job folder.
        overrides: ``--set`` items applied first.
    """
    configs = {side: json.load(open(path)) for side, path in _config_paths(job_dir).items()}
    apply_overrides(configs, list(overrides))
    executor = configs["client"]["executors"][0]["executor"]
    args = executor.get("args", {})
    rule = _rule_of(executor["path"], args)
    rule_args = {**(constructor_defaults(rule) if rule else {}), **args.get("rule_args", {})}
    name = args.get("rule", constructor_defaults(executor["path"]).get("rule")) if rule else None
    return {"rule": name, "model": configs["server"]["model"], "rule_args": json.loads(json.dumps(rule_args)),
            "num_rounds": configs["server"].get("num_rounds")}


def recipe_of(method_rule: str, method_rule_args: dict) -> Dict[str, object]:
    """The method's local recipe as a baseline names it: every client rule argument that is not
    declared the method's contribution (``ClientRule.CONTRIBUTION``), renamed by ``RECIPE_NAMES``.

    Args:
        method_rule: the method's registered client rule name (``fedirm``).
        method_rule_args: its effective rule arguments (constructor defaults included).
    """
    cls = rule_class("client", method_rule)
    return {cls.RECIPE_NAMES.get(k, k): v for k, v in method_rule_args.items() if k not in cls.CONTRIBUTION}


def taken_from_method(method: dict, baseline_rule: str, baseline_rule_args: dict) -> Tuple[dict, dict]:
    """The model keys (:data:`SHARED_MODEL_KEYS`) and rule arguments a baseline takes from its
    method, so that a comparison is of rules: the method's whole local recipe (:func:`recipe_of`).

    Args:
        method: the method's effective ``rule`` (registered name), ``model`` and ``rule_args``
            (:func:`job_settings`).
        baseline_rule: the baseline's registered client rule name (for the error).
        baseline_rule_args: the baseline rule's arguments (any values: only the names count).

    Raises:
        ValueError: naming the setting, when the baseline's rule cannot take a recipe setting.
    """
    model = {k: method["model"][k] for k in SHARED_MODEL_KEYS if k in method["model"]}
    rule = recipe_of(method["rule"], method["rule_args"]) if method.get("rule") else {}
    missing = sorted(set(rule) - set(baseline_rule_args))
    if missing:
        raise ValueError(f"the baseline rule '{baseline_rule}' cannot take {missing} of the local recipe of "
                         f"'{method['rule']}': give it those settings, or declare them the method's CONTRIBUTION")
    return model, rule


def matched_sets(method_dir: str, baseline_dir: str, overrides: Sequence[str] = ()) -> List[str]:
    """``--set`` items that give a baseline job its method's model, whole local recipe and number
    of rounds (:func:`taken_from_method`), where they differ.

    Args:
        method_dir: the method's job folder (e.g. ``jobs/fedlsm``).
        baseline_dir: the baseline's job folder (e.g. ``jobs/fedavg``).
        overrides: ``--set`` items applied to both first (a profile, the data's size).
    """
    method, base = job_settings(method_dir, overrides), job_settings(baseline_dir, overrides)
    if method["rule"] == base["rule"]:
        return []  # the method's own job with another setting: nothing to match
    model, rule = taken_from_method(method, base["rule"], base["rule_args"])
    out = [f"num_rounds={method['num_rounds']}"] if base["num_rounds"] != method["num_rounds"] else []
    out += [f"model.{k}={json.dumps(v)}" for k, v in model.items() if base["model"].get(k) != v]
    out += [f"rule_args.{k}={json.dumps(v)}" for k, v in rule.items() if base["rule_args"][k] != v]
    return out


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
    with open(meta_path, "w") as f:
        f.write(json.dumps(meta, indent=2) + "\n")
    if with_code:
        for app in glob.glob(os.path.join(out_dir, "*", "config")):
            copy_runtime(os.path.join(os.path.dirname(app), "custom"))
    return out_dir


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


def site_paths(data_root: str) -> Dict[str, str]:
    """Sites of ``data_root``: each ``<site>.npz`` file and each ``<site>/`` site folder (one holding
    ``meta.json``, the streaming layout); reference copies live in a subfolder and are not sites.

    Args:
        data_root: folder of site files / site folders.
    """
    found = {os.path.basename(p)[:-4]: p for p in glob.glob(os.path.join(data_root, "*.npz"))}
    for meta in glob.glob(os.path.join(data_root, "*", "meta.json")):
        folder = os.path.dirname(meta)
        name = os.path.basename(folder)
        if name in found:
            raise ValueError(f"data root '{data_root}' holds both '{name}.npz' and a site folder '{name}/': "
                             f"keep one")
        found[name] = folder
    if not found:
        raise FileNotFoundError(f"no site files (*.npz) or site folders in data root '{data_root}'; make them with "
                                f"'python -m fedpartial split ... --out {data_root}' or 'python -m fedpartial import'")
    return {name: found[name] for name in sorted(found, key=lambda s: (len(s), s))}


def site_names(data_root: str) -> List[str]:
    """The site names of ``data_root`` (see :func:`site_paths`), in natural order."""
    return list(site_paths(data_root))


def dataset_settings(data_root: str) -> dict:
    """The model keys fitting a job to the site files in ``data_root``: ``class_names``, ``task``,
    ``in_channels`` and ``input_size``, read from the first site file.

    Args:
        data_root: folder of site files / site folders.
    """
    from fedpartial.data.sitefile import load_site_file

    data = load_site_file(next(iter(site_paths(data_root).values())))
    images = data.splits["train"].images
    channels = 1 if images.ndim == 3 else int(images.shape[-1])
    return {"class_names": list(data.class_names), "task": data.task, "in_channels": channels,
            "input_size": [int(images.shape[1]), int(images.shape[2])]}


def dataset_overrides(data_root: str) -> List[str]:
    """:func:`dataset_settings` as ``--set`` items."""
    return [f"model.{key}={json.dumps(value)}" for key, value in dataset_settings(data_root).items()]


def simulate(job_dir: str, data_root: str, workspace: str, overrides: Sequence[str] = (), threads: int = 0,
             timeout: Optional[float] = None, log=print, progress_every: float = 3.0) -> dict:
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
    cmd = [sys.executable, "-m", "nvflare.private.fed.app.simulator.simulator", job, "-w", sim_ws,
           "-c", ",".join(sites), "-t", str(threads or len(sites))]
    env = dict(os.environ)
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
            raise RuntimeError(f"simulator exceeded {timeout} s; log: {workspace}/simulator.log")
        finally:
            if own_tmp:
                shutil.rmtree(own_tmp, ignore_errors=True)
    progress.update(_server_metrics(sim_ws))
    summary = collect_results(sim_ws, workspace, rc, time.time() - started, log)
    summary.update(num_rounds=num_rounds, rounds_completed=progress.rounds_done)
    summary["ok"] = rc == 0 and progress.rounds_done >= num_rounds
    return summary


def _server_metrics(sim_ws: str) -> Optional[str]:
    hits = glob.glob(os.path.join(sim_ws, "server", "*", "metrics.json"))
    return hits[0] if hits else None


def pooled_text(pooled: dict) -> str:
    """``val pooled dice D, lesion predicted in S % of N val images`` for a
    :func:`fedpartial.metrics.pooled_validation` result (D "undefined" when no pixel is lesion in
    truth or prediction)."""
    dice = pooled["dice_pooled"]
    dice = "undefined (no lesion in truth or prediction)" if dice != dice else f"{dice:.3f}"
    return (f"val pooled dice {dice}, lesion predicted in {100 * pooled['predicted_lesion_share']:.0f} % "
            f"of {pooled['n_images']} val images")


class RoundProgress:
    """Prints one line per aggregated round (round k/N, the key validation metric averaged over
    the sites, time left) from the server's ``metrics.json`` while a run goes on.

    Args:
        num_rounds: rounds the job runs.
        key_metric: validation metric to show (the job's ``key_metric``).
        log: printer.
        started: ``time.time()`` when the run started.
    """

    def __init__(self, num_rounds: int, key_metric: str, log=print, started: Optional[float] = None):
        self.num_rounds, self.key_metric, self.log = num_rounds, key_metric, log
        self.started = time.time() if started is None else started
        self.rounds_done = 0

    def update(self, metrics_path: Optional[str]) -> None:
        if not metrics_path:
            return
        try:
            with open(metrics_path) as f:
                rounds = json.load(f).get("rounds", [])
        except (OSError, ValueError):  # being replaced right now: read it next time
            return
        for record in rounds[self.rounds_done:]:
            self.rounds_done += 1
            self.log(self.line(record, self.rounds_done, time.time() - self.started))

    def line(self, record: dict, done: int, elapsed: float) -> str:
        """The progress line of one aggregated round."""
        from fedpartial.metrics.segmentation import pooled_validation

        values = [s.get("val", {}).get(self.key_metric) for s in record.get("sites", {}).values()]
        values = [float(v) for v in values if isinstance(v, (int, float))]
        validated = any(s.get("val") for s in record.get("sites", {}).values())
        pooled = pooled_validation({k: s.get("val") for k, s in record.get("sites", {}).items()})
        if pooled is not None:  # segmentation: Dice over every site's val pixels, as `evaluate` scores it
            metric = f"{pooled_text(pooled)} ({pooled['sites']} sites)"
            if pooled["predicted_lesion_share"] == 0:
                metric += "; WARNING: the global model predicts no lesion at all"
        elif values:
            metric = f"val {self.key_metric} {sum(values) / len(values):.3f} (mean of {len(values)} sites)"
        elif validated:  # e.g. AUC of a val split without a positive
            metric = f"val {self.key_metric} undefined at every site"
        else:
            metric = "no validation metric (no site has a val split)"
        left = elapsed / done * max(self.num_rounds - done, 0) if done else 0.0
        rejected = record.get("rejected") or {}
        extra = f"; rejected: {', '.join(sorted(rejected))}" if rejected else ""
        return (f"round {int(record.get('round', done - 1)) + 1}/{self.num_rounds}: {metric}; "
                f"{elapsed:.0f} s elapsed, ~{left:.0f} s left{extra}")


def _server_run_dir(sim_ws: str) -> Optional[str]:
    hits = glob.glob(os.path.join(sim_ws, "server", "*", "metrics.json")) or glob.glob(
        os.path.join(sim_ws, "server", "*", "global_model.pt"))
    return os.path.dirname(hits[0]) if hits else None


def collect_results(sim_ws: str, workspace: str, rc: int, seconds: float, log=print) -> dict:
    """Copy the server's results and every TensorBoard folder from a simulator workspace."""
    run_dir = _server_run_dir(sim_ws)
    errors = _log_errors(sim_ws)
    if run_dir is None or not os.path.isfile(os.path.join(run_dir, "global_model.pt")):
        raise RuntimeError(f"simulation failed (exit {rc}); no global model was written. "
                           f"First errors:\n{errors or '(none logged)'}\nlog: {workspace}/simulator.log")
    for name in RESULT_FILES:
        src = os.path.join(run_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(workspace, name))
    cross = glob.glob(os.path.join(run_dir, "cross_site_val", "cross_val_results.json"))
    if cross:
        shutil.copyfile(cross[0], os.path.join(workspace, "cross_site_val.json"))
    tb_out = os.path.join(workspace, "tb")
    shutil.rmtree(tb_out, ignore_errors=True)
    for tb in glob.glob(os.path.join(sim_ws, "*", "*", "tb")):
        shutil.copytree(tb, tb_out, dirs_exist_ok=True)
    # what the sites streamed to the server (TBAnalyticsReceiver): one folder per site
    streamed = os.path.join(run_dir, "tb_events")
    if os.path.isdir(streamed):
        shutil.copytree(streamed, os.path.join(workspace, "tb_server"), dirs_exist_ok=True)
    summary = {"exit_code": rc, "seconds": round(seconds, 1), "workspace": workspace, "errors": errors}
    log(f"simulation finished in {seconds:.0f} s (exit {rc}); results in {workspace}")
    if cross:
        with open(cross[0]) as f:
            for line in result_model_lines(json.load(f)):
                log(line)
    return summary


# cross-site evaluation names the server's models "SRV_<locator name>" (the locator's names
# already start with "SRV_"): matched by their end
SERVER_MODEL_FILES = {"best_global_model": "best_global_model.pt", "global_model": "global_model.pt"}


def server_model_validation(cross_site: dict) -> Dict[str, dict]:
    """What the server's models scored on the sites' val splits in cross-site evaluation:
    ``{file name: pooled}`` for segmentation (:func:`fedpartial.metrics.pooled_validation`: Dice
    over every site's val pixels, what ``evaluate --split val`` of the model on the site folder
    prints), ``{file name: {metric: mean over sites}}`` otherwise.

    Args:
        cross_site: ``cross_site_val.json``: ``{site: {model name: metrics}}``.
    """
    from fedpartial.metrics.segmentation import pooled_validation

    def model_of(models: dict, name: str):
        hits = [m for k, m in models.items() if k.startswith("SRV_") and k.endswith(name)
                and (name == "best_global_model" or not k.endswith("best_global_model"))]
        return hits[0] if hits else None

    out = {}
    for name, file in SERVER_MODEL_FILES.items():
        per_site = {site: model_of(models, name) for site, models in cross_site.items() if isinstance(models, dict)}
        per_site = {site: m for site, m in per_site.items() if isinstance(m, dict) and m}
        if not per_site:
            continue
        pooled = pooled_validation(per_site)
        if pooled is None:
            keys = [k for k, v in next(iter(per_site.values())).items() if isinstance(v, (int, float))]
            pooled = {k: sum(float(m[k]) for m in per_site.values() if isinstance(m.get(k), (int, float)))
                      / len(per_site) for k in keys}
        out[file] = pooled
    return out


def result_model_lines(cross_site: dict) -> List[str]:
    """One line per server model: its validation scores (:func:`server_model_validation`).

    Args:
        cross_site: ``cross_site_val.json``: ``{site: {model name: metrics}}``.
    """
    lines = []
    for file, scores in server_model_validation(cross_site).items():
        if "dice_pooled" in scores and "predicted_lesion_share" in scores:
            lines.append(f"{file}: {pooled_text(scores)}")
        elif scores:
            key = next(iter(scores))
            lines.append(f"{file}: val {key} {scores[key]:.3f} (mean over sites)")
    return lines


def _log_errors(sim_ws: str, limit: int = 5) -> str:
    lines = []
    for path in sorted(glob.glob(os.path.join(sim_ws, "**", "log.txt"), recursive=True)):
        with open(path, errors="replace") as f:
            lines += [ln.rstrip() for ln in f if " ERROR " in ln or "Traceback" in ln]
    return "\n".join(lines[:limit])
