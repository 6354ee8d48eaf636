"""The fixed table of method rules a job may name.

A job's config names its client and server rule by a short registered name (``fedlsm``,
``fedia``, ...), never by an import path: a config value that names code would be code the job
carries, and the site's component allow-list checks class paths, not arguments. Nothing outside
this table can be reached from a config: the table holds fixed module paths written here, and a
name that is not a key of it is refused.

==============  ======================================================  =============================
name            client rule                                             server rule
==============  ======================================================  =============================
``fedavg``      :class:`fedpartial.algorithms.fedavg.SupervisedClient`  :class:`~.fedavg.FedAvgServer`
``fedavg_seg``  :class:`~.segmentation.SegmentationSupervisedClient`    :class:`~.fedavg.FedAvgServer`
``fedlsm``      :class:`~.fedlsm.FedLSMClient`                          :class:`~.fedlsm.AWPAServer`
``fedmlp``      :class:`~.fedmlp.FedMLPClient`                          :class:`~.fedmlp.FedMLPServer`
``fedirm``      :class:`~.fedirm.FedIRMClient`                          :class:`~.fedirm.FedIRMServer`
``fedia``       :class:`~.fedia.FedIAClient`                            :class:`~.fedia.FedIAServer`
==============  ======================================================  =============================
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, Optional

_PKG = "fedpartial.algorithms"
#: name -> class path of the site's rule (modules are imported on first use only)
CLIENT_RULES: Dict[str, str] = {
    "fedavg": f"{_PKG}.fedavg.SupervisedClient",
    "fedavg_seg": f"{_PKG}.segmentation.SegmentationSupervisedClient",
    "fedlsm": f"{_PKG}.fedlsm.FedLSMClient",
    "fedmlp": f"{_PKG}.fedmlp.FedMLPClient",
    "fedirm": f"{_PKG}.fedirm.FedIRMClient",
    "fedia": f"{_PKG}.fedia.FedIAClient",
}
#: name -> class path of the server's rule
SERVER_RULES: Dict[str, str] = {
    "fedavg": f"{_PKG}.fedavg.FedAvgServer",
    "fedavg_seg": f"{_PKG}.fedavg.FedAvgServer",
    "fedlsm": f"{_PKG}.fedlsm.AWPAServer",
    "fedmlp": f"{_PKG}.fedmlp.FedMLPServer",
    "fedirm": f"{_PKG}.fedirm.FedIRMServer",
    "fedia": f"{_PKG}.fedia.FedIAServer",
}
_TABLES = {"client": CLIENT_RULES, "server": SERVER_RULES}


def rule_path(side: str, name: str) -> str:
    """The class path registered for ``name`` on ``side``.

    Args:
        side: ``client`` or ``server``.
        name: the job's ``rule`` value.

    Raises:
        ValueError: naming the value and the registered names when ``name`` is not one of them.
    """
    table = _TABLES.get(side)
    if table is None:
        raise ValueError(f"rule side must be 'client' or 'server', got {side!r}")
    if not isinstance(name, str) or name not in table:
        raise ValueError(f"the job's {side} 'rule' {name!r} is not a registered {side} rule; "
                         f"a job names one of {sorted(table)}")
    return table[name]


def rule_class(side: str, name: str):
    """The registered rule class for ``name`` (see :func:`rule_path`)."""
    module_name, _, cls_name = rule_path(side, name).rpartition(".")
    return getattr(importlib.import_module(module_name), cls_name)


def build_rule(side: str, name: str, rule_args: Optional[Dict[str, Any]] = None):
    """An instance of the registered rule ``name`` with the job's ``rule_args``.

    Args:
        side: ``client`` or ``server``.
        name: the job's ``rule`` value.
        rule_args: the rule's hyperparameters.

    Raises:
        ValueError: an unregistered name, or arguments the rule does not take.
    """
    cls = rule_class(side, name)
    if rule_args is not None and not isinstance(rule_args, dict):
        raise ValueError(f"the job's {side} 'rule_args' must be a dict, got {type(rule_args).__name__}")
    try:
        return cls(**(rule_args or {}))
    except TypeError as e:
        raise ValueError(f"bad rule_args for the {side} rule '{name}': {e}") from e
