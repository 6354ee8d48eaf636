"""A training chosen on val is kept beside the committed rows, so that its test score (``bench
--reuse``) needs neither its workspace nor a new training, in a later session or on another machine.
"""
from __future__ import annotations

import json
import os
import shutil

#: what a bench run trained in a job's workspace (``--reuse`` scores it again only with the same settings)
TRAINED_FILE = "bench_trained.json"
#: the most a kept training may take in the repository (a small CPU model is about 0.4 MB)
MAX_KEPT_BYTES = 8 * 2 ** 20


def kept_training_dir(rows_dir: str, suite: str, job: str, seed: int, key_hash: str) -> str:
    """Where a training chosen on val keeps what its test score needs: ``models/`` beside the
    committed rows (``docs/results/models/<suite>/<job>-seed<k>-<settings hash>``).

    Args:
        rows_dir: the committed rows (a folder, or a device run's one CSV file).
        suite / job / seed: the training.
        key_hash: :func:`fedpartial_tools.bench.rows.settings_hash` of its settings.
    """
    return os.path.join(os.path.dirname(rows_dir.rstrip("/")), "models", suite, f"{job}-seed{seed}-{key_hash}")


def keep_training(ws: str, dest: str, with_best: bool = False, max_bytes: int = MAX_KEPT_BYTES) -> str:
    """Copy what scores a trained workspace again into ``dest``: its final model (and best model
    where the suite scores it), the server's ``metrics.json`` (:func:`trimmed_metrics`) and the
    bench's record of its settings. A training over ``max_bytes`` is not kept (a paper-scale model belongs outside git);
    its test score then needs its workspace or a new training.

    Args:
        ws: the trained workspace.
        dest: :func:`kept_training_dir`.
        with_best: keep ``best_global_model.pt`` too.
        max_bytes: the most the kept files may take.

    Returns:
        a line for the log.
    """
    names = ["global_model.pt", "metrics.json", TRAINED_FILE] + (["best_global_model.pt"] if with_best else [])
    present = [n for n in names if os.path.isfile(os.path.join(ws, n))]
    size = sum(os.path.getsize(os.path.join(ws, n)) for n in present)
    if "global_model.pt" not in present or TRAINED_FILE not in present:
        return f"not kept: '{ws}' holds no trained model of the bench"
    if size > max_bytes:
        return f"not kept: {size / 2 ** 20:.1f} MiB is over {max_bytes / 2 ** 20:.0f} MiB; score it from '{ws}'"
    os.makedirs(dest, exist_ok=True)
    for n in present:
        if n == "metrics.json":  # what a row reads of it: the rounds and each site's validation
            with open(os.path.join(ws, n)) as f:
                record = trimmed_metrics(json.load(f))
            with open(os.path.join(dest, n), "w") as f:
                json.dump(record, f)
        else:
            shutil.copyfile(os.path.join(ws, n), os.path.join(dest, n))
    return f"kept in {dest} ({size / 2 ** 20:.1f} MiB), for its test score later"


def trimmed_metrics(record: dict) -> dict:
    """The server's ``metrics.json`` as far as a bench row reads it (its number of rounds and the
    curve of the sites' validation): each round's number and each site's ``val``; a sixth of the
    file, which also records sizes, losses, timings and the server's trust checks.

    Args:
        record: the server's ``metrics.json``.
    """
    return {"rounds": [{"round": r.get("round"),
                        "sites": {site: {"val": m.get("val", {})} for site, m in r.get("sites", {}).items()}}
                       for r in record.get("rounds", [])]}


def restore_training(kept: str, ws: str) -> bool:
    """Copy a kept training (:func:`keep_training`) into the workspace ``ws``; False where none is kept.

    Args:
        kept: :func:`kept_training_dir`.
        ws: the workspace to score it in.
    """
    if not (os.path.isfile(os.path.join(kept, "global_model.pt")) and os.path.isfile(os.path.join(kept, TRAINED_FILE))):
        return False
    os.makedirs(ws, exist_ok=True)
    for n in os.listdir(kept):
        shutil.copyfile(os.path.join(kept, n), os.path.join(ws, n))
    return True
