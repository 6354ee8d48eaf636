"""A site's secret, fixed rescaling of each weight's update before it leaves the site.

When a lead makes every site's update about ``+-k x lr`` per weight (a tiny ``lr``, or a couple of
steps, where the gradient's sign barely changes), a weighted 2-site average takes four levels per
weight and gives both sites' signs away. Multiplying each weight's update by a factor drawn once
from a site's own secret, uniform in ``[1 - spread, 1 + spread]``, blurs those levels: the factors
are the same in every round of a job and in every job that starts from the same model (averaging
rounds or such jobs does not remove them), differ between sites, and their mean is 1, so the update
keeps its expected direction. Jobs from other round-0 models get other factors: otherwise the same
factors under other signs (another seed's model) show, per weight, whether the sites agree.

Plain numpy; :class:`fedpartial.flare.site_policy.UpdateMask` applies it as a site's scope filter.
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Dict, Mapping

import numpy as np

_CONTEXT = b"fedpartial-update-mask/1"
#: normalisation statistics are averages over batches, not optimizer steps (and a rescaled running
#: variance can turn negative): sent as computed
STATISTIC_SUFFIXES = ("running_mean", "running_var")


def is_masked(name: str, value: np.ndarray) -> bool:
    """Whether entry ``name`` of a state dict is rescaled: floating-point parameters, not counters or
    normalisation statistics."""
    return np.issubdtype(np.asarray(value).dtype, np.floating) and not name.endswith(STATISTIC_SUFFIXES)


def model_digest(weights: Mapping[str, np.ndarray]) -> bytes:
    """SHA-256 of a state dict (names, dtypes, shapes and values, in name order): the round-0 model
    a job's factors are tied to."""
    h = hashlib.sha256()
    for name in sorted(weights):
        value = np.ascontiguousarray(weights[name])
        h.update(f"{name}|{value.dtype.str}|{value.shape}|".encode())
        h.update(value.tobytes())
    return h.digest()


def mask_factors(key: bytes, name: str, shape, spread: float, start: bytes = b"") -> np.ndarray:
    """The factors of parameter ``name``: uniform in ``[1 - spread, 1 + spread]``, a function of the
    site's ``key``, the parameter's name and shape, and the job's round-0 model only.

    Args:
        key: the site's secret (bytes).
        name: the parameter's name in the model's state dict.
        shape: the parameter's shape.
        spread: half the width of the factors' range, in [0, 1].
        start: :func:`model_digest` of the first model the job brought the site (b"": none).
    """
    spread = float(spread)
    if not 0.0 <= spread <= 1.0:
        raise ValueError(f"update mask spread must be in [0, 1], got {spread}")
    shape = tuple(int(s) for s in shape)
    message = _CONTEXT + b"|" + name.encode() + b"|" + repr(shape).encode() + (b"|" + start if start else b"")
    digest = hmac.new(key, message, hashlib.sha256).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:16], "little"))
    return rng.uniform(1.0 - spread, 1.0 + spread, size=shape)


def masked_weights(received: Mapping[str, np.ndarray], local: Mapping[str, np.ndarray], key: bytes,
                   spread: float, start: bytes = b"") -> Dict[str, np.ndarray]:
    """``received + factors x (local - received)`` for every floating-point parameter; other
    entries (step counters, normalisation statistics: :func:`is_masked`) are sent as trained.

    Args:
        received: the global model the site trained from (name -> array).
        local: the site's trained model (name -> array).
        key: the site's secret.
        spread, start: see :func:`mask_factors`.

    Raises:
        ValueError: naming a floating-point parameter missing from ``received`` or of another shape.
    """
    out = {}
    for name, value in local.items():
        value = np.asarray(value)
        if not is_masked(name, value):
            out[name] = value
            continue
        if name not in received or np.shape(received[name]) != value.shape:
            raise ValueError(f"update mask: parameter '{name}' {value.shape} has no counterpart of that shape in "
                             f"the model the site received")
        base = np.asarray(received[name], dtype=np.float64)
        update = value.astype(np.float64) - base
        out[name] = (base + mask_factors(key, name, value.shape, spread, start) * update).astype(value.dtype)
    return out


def masked_diff(diff: Mapping[str, np.ndarray], key: bytes, spread: float,
                start: bytes = b"") -> Dict[str, np.ndarray]:
    """A weight difference (``local - received``) with each parameter rescaled (:func:`is_masked`).

    Args:
        diff: name -> array.
        key: the site's secret.
        spread, start: see :func:`mask_factors`.
    """
    return {name: (np.asarray(v) * mask_factors(key, name, np.shape(v), spread, start)).astype(np.asarray(v).dtype)
            if is_masked(name, v) else v for name, v in diff.items()}
