"""Matching a baseline to its method: the model keys, the local recipe, the optimizer steps per
round and the site weights a baseline takes from the method it is compared with, so that a
comparison is of rules, not of networks, recipes, compute or weighting."""
from __future__ import annotations

import json
from typing import Dict, List, Sequence, Tuple

from fedpartial.algorithms.base import ClientRule
from fedpartial.algorithms.registry import rule_class, rule_path
from fedpartial_tools.jobs.settings import constructor_defaults, job_settings


# What a baseline takes from the method it is compared with, so that a comparison is of rules,
# not of networks or recipes: the whole model block but the classes (and the local recipe, see
# :func:`recipe_of`).
SHARED_MODEL_KEYS = ("arch", "arch_args", "in_channels", "input_size", "normalisation", "pretrained")


def recipe_of(method_rule: str, method_rule_args: dict) -> Dict[str, object]:
    """The method's local recipe as a baseline names it: every client rule argument that is not
    declared the method's contribution (``ClientRule.CONTRIBUTION``), renamed by ``RECIPE_NAMES``.

    Args:
        method_rule: the method's registered client rule name (``fedirm``).
        method_rule_args: its effective rule arguments (constructor defaults included).
    """
    cls = rule_class("client", method_rule)
    return {cls.RECIPE_NAMES.get(k, k): v for k, v in method_rule_args.items() if k not in cls.CONTRIBUTION}


def compute_of(method_rule: str, method_rule_args: dict, baseline_rule_args: dict) -> Dict[str, object]:
    """What makes a baseline match its method in compute and weighting, where the baseline's rule
    takes it: ``steps_of`` (the method's rule and arguments, when it states its steps per round:
    ``ClientRule.round_steps``) and ``weight_by`` (the method's ``ClientRule.WEIGHT_BY``).

    Args:
        method_rule: the method's registered client rule name.
        method_rule_args: its effective rule arguments (those equal to the defaults are left out).
        baseline_rule_args: the baseline rule's arguments (any values: only the names count).
    """
    cls = rule_class("client", method_rule)
    out: Dict[str, object] = {}
    if "steps_of" in baseline_rule_args and cls.round_steps is not ClientRule.round_steps:
        defaults = _jsonable(constructor_defaults(rule_path("client", method_rule)))
        args = {k: v for k, v in _jsonable(method_rule_args).items() if k not in defaults or defaults[k] != v}
        out["steps_of"] = {"rule": method_rule, "rule_args": args}
    if "weight_by" in baseline_rule_args and cls.WEIGHT_BY:
        out["weight_by"] = cls.WEIGHT_BY
    return out


def _jsonable(value):
    return json.loads(json.dumps(value))


def taken_from_method(method: dict, baseline_rule: str, baseline_rule_args: dict, compute: bool = True
                      ) -> Tuple[dict, dict]:
    """The model keys (:data:`SHARED_MODEL_KEYS`) and rule arguments a baseline takes from its
    method, so that a comparison is of rules: the method's whole local recipe (:func:`recipe_of`)
    and, with ``compute``, its optimizer steps per round and site weights (:func:`compute_of`).

    Args:
        method: the method's effective ``rule`` (registered name), ``model`` and ``rule_args``
            (:func:`job_settings`).
        baseline_rule: the baseline's registered client rule name (for the error).
        baseline_rule_args: the baseline rule's arguments (any values: only the names count).
        compute: also the method's steps and weights (False: the baseline keeps its own epochs
            and weights its sites by the rows it trains on).

    Raises:
        ValueError: naming the setting, when the baseline's rule cannot take a recipe setting.
    """
    model = {k: method["model"][k] for k in SHARED_MODEL_KEYS if k in method["model"]}
    rule = recipe_of(method["rule"], method["rule_args"]) if method.get("rule") else {}
    missing = sorted(set(rule) - set(baseline_rule_args))
    if missing:
        raise ValueError(f"the baseline rule '{baseline_rule}' cannot take {missing} of the local recipe of "
                         f"'{method['rule']}': give it those settings, or declare them the method's CONTRIBUTION")
    if compute and method.get("rule"):
        rule.update(compute_of(method["rule"], method["rule_args"], baseline_rule_args))
    return model, rule


def matched_sets(method_dir: str, baseline_dir: str, overrides: Sequence[str] = (), compute: bool = True
                 ) -> List[str]:
    """``--set`` items that give a baseline job its method's model, whole local recipe and number
    of rounds, and with ``compute`` its optimizer steps per round and site weights
    (:func:`taken_from_method`), where they differ.

    Args:
        method_dir: the method's job folder (e.g. ``jobs/fedlsm``).
        baseline_dir: the baseline's job folder (e.g. ``jobs/fedavg``).
        overrides: ``--set`` items applied to both first (a profile, the data's size).
        compute: match steps and weights too (False: the baseline's own epochs, e.g. the bench's
            ``fedavg`` row beside ``fedavg_compute``).
    """
    method, base = job_settings(method_dir, overrides), job_settings(baseline_dir, overrides)
    if method["rule"] == base["rule"]:
        return []  # the method's own job with another setting: nothing to match
    model, rule = taken_from_method(method, base["rule"], base["rule_args"], compute)
    out = [f"num_rounds={method['num_rounds']}"] if base["num_rounds"] != method["num_rounds"] else []
    out += [f"model.{k}={json.dumps(v)}" for k, v in model.items() if base["model"].get(k) != v]
    out += [f"rule_args.{k}={json.dumps(v)}" for k, v in rule.items() if base["rule_args"][k] != v]
    return out
