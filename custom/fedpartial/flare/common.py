"""Small FLARE-side helpers shared by the executor, aggregator and persistor."""
from __future__ import annotations

import importlib
import json
import math
import os
from typing import Any, Dict

import numpy as np

# Keys of DXO meta used on the wire (see docs/ARCHITECTURE.md).
GLOBAL_STATS = "global_stats"
SITE_STATS = "site_stats"
SITE_METRICS = "site_metrics"
# the size of the site's train split, sent with every update: the server caps sample counts at the first
SITE_TRAIN_SIZE = "site_train_size"


def runtime_version_error(required: str, where: str) -> str:
    """Why the installed fedpartial cannot run a job that needs runtime ``required`` ("" = fine).

    Jobs packaged for an installed runtime name the version they were written for
    (``package-job --installed-runtime``); a site or server with another version must refuse the
    job at its start rather than train with different code than the other participants.

    Args:
        required: the job's ``runtime_version`` ("" = the job names none: no check).
        where: who checks, for the message (e.g. ``site 'site-1'`` or ``the server``).
    """
    import fedpartial

    required = str(required or "").strip()
    if not required or required == fedpartial.__version__:
        return ""
    return (f"the job needs fedpartial runtime {required} but {where} has fedpartial {fedpartial.__version__} "
            f"installed ({os.path.dirname(fedpartial.__file__)}); install fedpartial_runtime-{required} there "
            f"or package the job for {fedpartial.__version__}")


def runtime_description() -> str:
    """``fedpartial <version> from <folder>``: which code this process runs (logged at job start)."""
    import fedpartial

    return f"fedpartial {fedpartial.__version__} from {os.path.dirname(os.path.abspath(fedpartial.__file__))}"


def import_class(dotted: str):
    """``"pkg.module.Class"`` -> the class; clear error naming the path when it is wrong."""
    module_name, _, name = dotted.rpartition(".")
    if not module_name:
        raise ValueError(f"'{dotted}' is not a dotted class path like 'fedpartial.algorithms.fedavg.FedAvgServer'")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import '{dotted}' named in the job config: {e}") from e


def build_rule(dotted: str, rule_args: Dict[str, Any] | None):
    """Instantiate a client or server rule from the job config."""
    cls = import_class(dotted)
    try:
        return cls(**(rule_args or {}))
    except TypeError as e:
        raise ValueError(f"bad rule_args for {dotted}: {e}") from e


def jsonable(value):
    """Numbers / arrays / nested dicts -> JSON-safe values (NaN -> None)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, (np.floating, float)):
        f = float(value)
        return f if math.isfinite(f) else None
    if isinstance(value, (np.integer,)):
        return int(value)
    return value


def atomic_write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(jsonable(obj), f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def model_settings(model: Dict[str, Any]) -> Dict[str, Any]:
    """Validate the job's ``model`` block, shared by the server persistor and the site executor.

    Keys: ``arch``, ``arch_args`` (dict), ``in_channels``, ``class_names`` (list), ``task``,
    ``input_size`` ([H, W]; the size sites resize their images to, 0 = keep), ``normalisation``
    ({mean, std}), ``pretrained`` (server only: a local weights file whose body starts the
    round-0 global model, see ``fedpartial.models.pretrained``; "" = none, the default; the
    persistor expands ``~`` and looks a relative path up in the job's app folder, then the
    server's workspace root).
    """
    from fedpartial.data.types import SEGMENTATION, TASKS

    required = ("arch", "in_channels", "class_names", "task")
    missing = [k for k in required if k not in model]
    if missing:
        raise ValueError(f"job config 'model' block lacks {missing}; it needs {list(required)}")
    if model["task"] not in TASKS:
        raise ValueError(f"job config model.task '{model['task']}' is not one of {TASKS}")
    out = dict(model)
    out.setdefault("arch_args", {})
    out.setdefault("input_size", [0, 0])
    out.setdefault("normalisation", {"mean": 0.5, "std": 0.5})
    # --set parses JSON, so a file named "123" would arrive as a number: keep it a path.
    out["pretrained"] = "" if out.get("pretrained") in (None, "") else str(out["pretrained"])
    out["num_classes"] = 1 if model["task"] == SEGMENTATION else len(model["class_names"])
    return out


def build_model_from_settings(settings: Dict[str, Any]):
    from fedpartial.models import build_model

    return build_model(settings["arch"], settings["num_classes"], settings["in_channels"], **settings["arch_args"])


def model_file_meta(settings: Dict[str, Any], **extra) -> Dict[str, Any]:
    """The self-describing part of a saved model file (see fedpartial.models.io)."""
    meta = {"class_names": list(settings["class_names"]), "task": settings["task"],
            "input_size": list(settings["input_size"]), "normalisation": dict(settings["normalisation"])}
    meta.update(extra)
    return meta
