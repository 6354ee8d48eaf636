"""Small FLARE-side helpers shared by the executor, aggregator and persistor."""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from typing import Any, Dict

import numpy as np

from fedpartial.data.grid import AGREEMENT_KEY

# Keys of DXO meta used on the wire (see docs/ARCHITECTURE.md).
GLOBAL_STATS = "global_stats"
SITE_STATS = "site_stats"
SITE_METRICS = "site_metrics"
# the size of the site's train split, sent with every update: the server caps sample counts at the first
SITE_TRAIN_SIZE = "site_train_size"
# distinct images the round's training drew (fedpartial.training.common.DRAWS): the site policy's
# evidence of how many images stand behind the weights and metrics; an FLContext property of the
# task, never a key of the result
SITE_IMAGES_SEEN = "site_images_seen"
# optimizer steps of the round's training (fedpartial.training.common.STEPS), the same kind of property
SITE_OPTIMIZER_STEPS = "site_optimizer_steps"
# the k below which a class of the val split was left out of the classification scores the task
# sends (fedpartial.evaluation.describable), the same kind of property
SITE_VAL_MIN_CLASS_COUNT = "site_val_min_class_count"


#: files of the package that make up the runtime's identity (the wheel ships exactly these)
_NOT_HASHED = ("__main__.py",)


@functools.lru_cache(maxsize=1)
def runtime_identity() -> str:
    """``<version>+sha256.<12 hex>``: the package version plus a hash of every ``.py`` file of
    the installed ``fedpartial`` (path and content). Two installs run the same code exactly when
    their identities agree: a site with edited or other files under the same version differs."""
    import fedpartial

    root = os.path.dirname(os.path.abspath(fedpartial.__file__))
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py") or name in _NOT_HASHED:
                continue
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read() + b"\0")
    return f"{fedpartial.__version__}+sha256.{digest.hexdigest()[:12]}"


def runtime_version_error(required: str, where: str, required_at_site: bool = False) -> str:
    """Why the installed fedpartial cannot run a job that needs runtime ``required`` ("" = fine).

    Jobs name the runtime they were packaged with (``package-job`` writes
    :func:`runtime_identity`); a site or server with other code must refuse the job at its start
    rather than train with different code than the other participants. A development site also
    takes a bare version (no hash) that equals its version.

    Args:
        required: the job's ``runtime_version``.
        where: who checks, for the message (e.g. ``site 'site-1'`` or ``the server``).
        required_at_site: a provisioned site or server: a job naming no version is refused.
    """
    import fedpartial

    required = str(required or "").strip()
    here = runtime_identity()
    if not required:
        if required_at_site:
            return (f"{where} refuses the job: it names no 'runtime_version'; this site runs {here} and "
                    f"accepts jobs packaged for it (package-job --installed-runtime writes it)")
        return ""
    if required == here:
        return ""
    if not required_at_site and "+" not in required and required == fedpartial.__version__:
        return ""  # a development site also takes a bare version
    return (f"the job needs fedpartial runtime {required} but {where} has fedpartial {here} "
            f"installed ({os.path.dirname(fedpartial.__file__)}); install the runtime the job was packaged "
            f"with there, or package the job for {here}")


def runtime_description() -> str:
    """``fedpartial <version> from <folder>``: which code this process runs (logged at job start)."""
    import fedpartial

    return f"fedpartial {runtime_identity()} from {os.path.dirname(os.path.abspath(fedpartial.__file__))}"


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
    server's workspace root), ``input_agreement`` (optional: the federation's input agreement,
    :class:`fedpartial.data.grid.InputAgreement` as JSON; sites refuse a data file that records
    another, the model file records it and ``predict nifti`` applies it; ``input_size`` must then
    be [0, 0] or the agreement's ``size``).
    """
    from fedpartial.data.grid import agreement_from
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
    agreement = agreement_from(out.pop(AGREEMENT_KEY, None), f"job config model.{AGREEMENT_KEY}")
    if agreement is not None:
        size = [int(v) for v in out["input_size"]]
        if any(size) and size != list(agreement.size):
            raise ValueError(f"job config model.input_size {size} differs from model.{AGREEMENT_KEY}.size "
                             f"{list(agreement.size)}: resizing the agreed slices would undo the agreed spacing; set "
                             f"input_size to [0, 0] or {list(agreement.size)}")
        out[AGREEMENT_KEY] = agreement.to_dict()
    return out


def build_model_from_settings(settings: Dict[str, Any]):
    from fedpartial.models import build_model

    return build_model(settings["arch"], settings["num_classes"], settings["in_channels"], **settings["arch_args"])


def model_file_meta(settings: Dict[str, Any], **extra) -> Dict[str, Any]:
    """The self-describing part of a saved model file (see fedpartial.models.io)."""
    meta = {"class_names": list(settings["class_names"]), "task": settings["task"],
            "input_size": list(settings["input_size"]), "normalisation": dict(settings["normalisation"])}
    if settings.get(AGREEMENT_KEY) is not None:  # how predict must prepare a volume for this model
        meta[AGREEMENT_KEY] = settings[AGREEMENT_KEY]
    meta.update(extra)
    return meta


def app_targets(deploy_map) -> dict:
    """``{app: (goes to the server, goes to a site)}`` of a job's ``deploy_map``."""
    out = {}
    for app, targets in (deploy_map or {}).items():
        names = [t if isinstance(t, str) else (t or {}).get("sites", t) for t in targets or []]
        flat = [str(n).lower() for t in names for n in (t if isinstance(t, list) else [t])]
        out[app] = ("server" in flat or "@all" in flat, any(n != "server" for n in flat))
    return out
