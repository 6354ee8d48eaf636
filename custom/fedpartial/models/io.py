"""Self-describing model files.

A file is ``torch.save({"format": "fedpartial-model/1", "spec": model.spec, "meta": meta,
"state_dict": {name: tensor}})``. ``spec`` rebuilds the network with ``build_model``; ``meta``
says how to use it: ``class_names``, ``task``, ``input_size`` (H, W), ``normalisation``
``{"mean", "std"}`` plus anything extra (``round``, ``metrics``...). Files are written
atomically (temp file + rename) and read with ``torch.load(weights_only=True)``, so meta is
reduced to plain Python values (numpy scalars / arrays become floats / lists) on save.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

import numpy as np
import torch

from fedpartial.models.networks import FedModel, build_model

FORMAT = "fedpartial-model/1"
REQUIRED_META = ("class_names", "task", "input_size", "normalisation")


class ModelFileError(ValueError):
    """A file that is not a readable fedpartial model file; the message names the file."""


def _plain(value, where: str):
    """numpy / torch / tuple values -> plain Python (weights_only-loadable, JSON-like)."""
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return _plain(value.tolist(), where)
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"model file meta '{where}' has a value of type {type(value).__name__} that cannot be stored")


def _check_meta(meta: Mapping) -> Dict:
    if not isinstance(meta, Mapping):
        raise TypeError(f"model file meta must be a dict, got {type(meta).__name__}")
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise ValueError(f"model file meta lacks {missing} (needs {list(REQUIRED_META)})")
    norm = meta["normalisation"]
    if not isinstance(norm, Mapping) or "mean" not in norm or "std" not in norm:
        raise ValueError(f"model file meta 'normalisation' must be {{'mean', 'std'}}, got {norm!r}")
    return _plain(dict(meta), "meta")


def model_input_size(meta: Mapping) -> Optional[Tuple[int, int]]:
    """The ``(H, W)`` a model was trained at, from its meta; None when it has none (trained on
    images at their own size: ``input_size`` absent, empty or 0).

    Args:
        meta: the model file's meta.
    """
    size = tuple(int(s) for s in (meta.get("input_size") or (0, 0)))
    return size if len(size) == 2 and all(size) else None


def _write_atomic(path, payload: Dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def save_model_file(path, model: FedModel, meta: Mapping) -> Path:
    """Write ``model`` (weights + spec) and ``meta`` to ``path`` atomically.

    Args:
        path: output file (parent folders are created).
        model: a :class:`FedModel` from ``build_model``.
        meta: ``{"class_names", "task", "input_size", "normalisation": {"mean", "std"}, ...extra}``.

    Returns:
        the path written.
    """
    if not isinstance(model, FedModel):
        raise TypeError(f"save_model_file needs a model from build_model, got {type(model).__name__}")
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return _write_atomic(path, {"format": FORMAT, "spec": model.spec, "meta": _check_meta(meta), "state_dict": state})


def save_weights_file(path, weights: Mapping[str, np.ndarray], spec: Mapping, meta: Mapping,
                      validate: bool = True) -> Path:
    """Write numpy weights (what the server holds) as a model file.

    Args:
        path: output file.
        weights: ``{state_dict name: numpy array}``.
        spec: ``model.spec`` of the network the weights belong to.
        meta: as for :func:`save_model_file`.
        validate: rebuild the network from ``spec`` and check every name and shape (catches a
            spec / weights mismatch when writing rather than when someone loads the file).
    """
    spec = _check_spec(spec, str(path))
    state = {str(k): torch.as_tensor(np.array(v, copy=True)) for k, v in weights.items()}
    if validate:
        own = build_model(spec["arch"], spec["num_classes"], spec["in_channels"], **spec["arch_args"]).state_dict()
        missing = sorted(set(own) - set(state))
        extra = sorted(set(state) - set(own))
        if missing or extra:
            raise ValueError(f"weights for {path} do not match spec {spec['arch']}: missing {missing[:3]}, "
                             f"unexpected {extra[:3]}")
        for k, v in own.items():
            if tuple(state[k].shape) != tuple(v.shape):
                raise ValueError(f"weights for {path}: '{k}' has shape {tuple(state[k].shape)}, "
                                 f"spec {spec['arch']} expects {tuple(v.shape)}")
            state[k] = state[k].to(v.dtype)
    return _write_atomic(path, {"format": FORMAT, "spec": spec, "meta": _check_meta(meta), "state_dict": state})


def _check_spec(spec, where: str) -> Dict:
    if not isinstance(spec, Mapping) or not {"arch", "num_classes", "in_channels"} <= set(spec):
        raise ModelFileError(f"{where}: model spec must hold arch, num_classes, in_channels; got {spec!r}")
    out = _plain(dict(spec), "spec")
    out.setdefault("arch_args", {})
    return out


def read_model_file(path) -> Dict:
    """Load and check the raw payload (``format``, ``spec``, ``meta``, ``state_dict``) of a model file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist")
    try:
        payload = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated / not a torch file / foreign pickle
        # torch's own message for a foreign pickle is a page of advice; the first line suffices.
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ModelFileError(f"{path} is not a readable fedpartial model file (corrupt, truncated or not written "
                             f"by fedpartial): {type(exc).__name__}: {reason}") from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ModelFileError(f"{path} is not a fedpartial model file (format {found!r}, expected {FORMAT!r})")
    for key in ("spec", "meta", "state_dict"):
        if not isinstance(payload.get(key), dict):
            raise ModelFileError(f"{path}: model file lacks '{key}'")
    payload["spec"] = _check_spec(payload["spec"], str(path))
    return payload


def load_model_file(path, device="cpu") -> Tuple[FedModel, Dict]:
    """Rebuild the model saved in ``path``.

    Args:
        path: a file written by :func:`save_model_file` / :func:`save_weights_file`.
        device: where to put the model.

    Returns:
        ``(model in eval mode, meta)`` where ``meta`` also holds ``"spec"``.

    Raises:
        FileNotFoundError: no such file.
        ModelFileError: not a fedpartial model file, corrupt, or weights not matching the spec.
    """
    payload = read_model_file(path)
    spec = payload["spec"]
    try:
        model = build_model(spec["arch"], spec["num_classes"], spec["in_channels"], **spec["arch_args"])
    except ValueError as exc:
        raise ModelFileError(f"{path}: cannot rebuild model from spec {spec}: {exc}") from exc
    try:
        model.load_state_dict(payload["state_dict"], strict=True)
    except RuntimeError as exc:
        raise ModelFileError(f"{path}: weights do not match spec {spec['arch']}: {exc}") from exc
    model.to(device).eval()
    meta = dict(payload["meta"])
    meta["spec"] = spec
    return model, meta
