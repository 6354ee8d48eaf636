"""The decision of a result model on its probabilities: per class the threshold the model card
records (or the one given), where it came from, and the decision it makes."""
from __future__ import annotations

from typing import Mapping, Optional

import numpy as np

from fedpartial.data.types import SEGMENTATION, SINGLE_LABEL


# ---- decisions ------------------------------------------------------------------------------------
def decision_thresholds(meta: Mapping, override: Optional[float] = None) -> np.ndarray:
    """The decision threshold of each output class of a model.

    In order: ``override`` for every class; else the model file's ``meta["decision_thresholds"]``
    (``{"thresholds": {class name: value}, "rule", "source"}``) for the classes it lists; else 0.5
    (multi-label, segmentation) or NaN = argmax (single-label).

    Args:
        meta: the model file's meta (``task``, ``class_names``, optionally ``spec`` and
            ``decision_thresholds``).
        override: one threshold in [0, 1] for every class (``--threshold``), or None.

    Returns:
        float ``(C,)``, C = the model's outputs (1 for segmentation); NaN marks a class decided
        by argmax (see :func:`decide`).

    Raises:
        ValueError: ``override`` or a stored threshold outside [0, 1], a malformed
            ``decision_thresholds`` or one naming a class the model does not have.
    """
    names = [str(c) for c in meta["class_names"]]
    segmentation = meta["task"] == SEGMENTATION
    outputs = int((meta.get("spec") or {}).get("num_classes") or (1 if segmentation else len(names)))
    names = names[:outputs]
    if override is not None:
        value = float(override)
        if not 0.0 <= value <= 1.0:  # "not <=": NaN fails too
            raise ValueError(f"--threshold {override} is not a probability in [0, 1]")
        return np.full(outputs, value)
    out = np.full(outputs, np.nan if meta["task"] == SINGLE_LABEL else 0.5)
    stored = meta.get("decision_thresholds")
    if stored is None:
        return out
    if not isinstance(stored, Mapping) or not isinstance(stored.get("thresholds"), Mapping):
        raise ValueError(f"model meta 'decision_thresholds' must be {{'thresholds': {{class: value}}, 'rule', "
                         f"'source'}}, got {stored!r}")
    unknown = sorted(set(stored["thresholds"]) - set(names))
    if unknown:
        raise ValueError(f"model meta 'decision_thresholds' names class(es) {unknown} the model does not have "
                         f"({names})")
    for c, name in enumerate(names):
        value = stored["thresholds"].get(name)
        if value is None:  # a class left uncalibrated keeps the default
            continue
        value = float(value)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"model meta 'decision_thresholds' gives class '{name}' threshold {value}, not a "
                             f"probability in [0, 1]")
        out[c] = value
    return out


def threshold_source(meta: Mapping, override: Optional[float] = None) -> str:
    """Where :func:`decision_thresholds` took its values from, in words (for the summary)."""
    if override is not None:
        return f"--threshold {float(override):g} for every class"
    stored = meta.get("decision_thresholds")
    if stored:
        # the source may list every class's counts: its first clause says which validation it is
        source = str(stored.get("source", "?")).split(";")[0]
        return f"the model file's decision_thresholds (rule {stored.get('rule', '?')}; {source})"
    return "argmax (single-label)" if meta["task"] == SINGLE_LABEL else "0.5 (the default)"


def threshold_words(meta: Mapping, thresholds: np.ndarray, override: Optional[float] = None) -> str:
    """The decision rule in plain words, for whoever reads the predictions (a clinician): each class's
    threshold, and where it came from without the model card's shorthand.

    Args:
        meta: the model file's meta.
        thresholds: :func:`decision_thresholds`' result for it.
        override: ``--threshold`` when given.
    """
    import re

    names = [str(c) for c in meta["class_names"]][:len(thresholds)]
    if meta["task"] == SINGLE_LABEL and np.isnan(thresholds).all():
        return "Each image is given the one class with the highest probability."
    values = ", ".join(f"{n} {'highest probability' if np.isnan(t) else f'{t:.2f}'}" for n, t in zip(names, thresholds))
    head = f"A class is reported present when its probability is at least its threshold: {values}."
    if override is not None:
        return f"{head} The threshold was given by whoever ran the prediction (--threshold), the same for every class."
    stored = meta.get("decision_thresholds")
    if not stored:
        return f"{head} No threshold was chosen for this model: 0.5 is the default, not a calibrated value."
    source = str(stored.get("source", ""))
    rounds = re.findall(r"the global model of round (\d+)|the (initial) global model", source)
    chosen = [f"round {r}" if r else "the start" for r, initial in rounds[-1:]]
    when = f" ({chosen[0]})" if chosen else ""
    rest = "A class the hospitals had too few validation examples of keeps 0.5."
    if "NOT this file's model" in source:
        this = [f"round {r}" if r else "the start" for r, initial in rounds[:1]] if len(rounds) > 1 else []
        return (f"{head} The thresholds were chosen on the participating hospitals' validation images with an "
                f"earlier model of the same training{when}{'; this file holds ' + this[0] if this else ''}: they "
                f"fit this model closely but were not computed on it. {rest}")
    return (f"{head} The thresholds were chosen on the participating hospitals' validation images with this "
            f"model{when}. {rest}")


def decide(probs: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Per-class decisions: ``probs >= threshold``; a NaN threshold decides by argmax (the class is
    positive where it has the largest probability of the row).

    Args:
        probs: ``(N, C)`` probabilities.
        thresholds: ``(C,)`` from :func:`decision_thresholds`.

    Returns:
        bool ``(N, C)``.
    """
    probs, thresholds = np.asarray(probs, dtype=np.float64), np.asarray(thresholds, dtype=np.float64)
    by_argmax = np.isnan(thresholds)
    out = probs >= np.where(by_argmax, np.inf, thresholds)
    if by_argmax.any() and len(probs):
        top = np.zeros(probs.shape, bool)
        top[np.arange(len(probs)), probs.argmax(axis=1)] = True
        out[:, by_argmax] = top[:, by_argmax]
    return out
