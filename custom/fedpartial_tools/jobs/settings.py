"""A job folder's settings: ``--set key=value`` parsing and application to its server / client
configs, the constructor defaults of its components and rules, and the effective settings of a
job (:func:`job_settings`). Imports no recipe: recipes build on it."""
from __future__ import annotations

import copy
import functools
import glob
import importlib
import inspect
import json
import os
from typing import Dict, List, Optional, Sequence

from fedpartial.algorithms.registry import rule_path


CONFIGS = {"server": "config_fed_server.json", "client": "config_fed_client.json"}


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
