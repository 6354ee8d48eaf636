"""Progress lines of a running job: one line per aggregated round (round k/N, the key validation
metric over the sites, time left), read from the server's ``metrics.json``."""
from __future__ import annotations

import json
import time
from typing import Optional


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
