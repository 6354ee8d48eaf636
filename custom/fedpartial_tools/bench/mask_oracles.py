"""Two ways a job's lead combines several jobs against the sites' update mask
(:mod:`fedpartial.algorithms.update_mask`), measured on real site files (2 sites, tiny ``lr``):

* **weight-decay oracle**: a job whose weight decay outweighs the data's gradient makes every
  site's update about ``k x lr x sign(theta0)``, known to the lead, so its aggregate gives each
  weight's ``w1 f1 + w2 f2``; a data job from the same round-0 model then decodes with those
  divided out (the light site's sign is the aggregate's where ``|aggregate|`` is near that sum).
  A site's ``max_weight_decay`` bounds the decay a job may set.
* **levels across seeds**: with factors that stay the same while the signs change (jobs from other
  seeds' models), ``|aggregate|`` of one weight takes a high level where the two sites agree and a
  low one where they do not; two-means per weight over the jobs tells which, and the light site's
  sign follows from the aggregate's. Factors tied to the job's round-0 model (the filter's) change
  with the seed, and the levels blur.
* **levels across settings**: the same from one round-0 model (tied factors stay), with the signs
  changed by the loss instead (:data:`LOSS_VARIANTS`, each a job a lead may submit).

``factors``: ``fixed`` (key, name and shape only) or ``tied`` (and the round-0 model, as the
filter draws them). The truth is each site's unmasked update sign in the data job.

``python -m fedpartial_tools.bench.mask_oracles --data ../shared/data/ham10000_28.npz --out runs/mask_oracles``
"""
from __future__ import annotations

import argparse
from typing import List, Sequence, Tuple

import numpy as np

from fedpartial_tools.bench.sign_decoding import attack_arguments, two_site_split

FACTORS = ("fixed", "tied")
#: FedAvg losses a job may set, each moving some gradients' signs from the same round-0 model
LOSS_VARIANTS = ({}, {"loss_mode": "partial"}, {"label_smoothing": 0.1}, {"logit_adjustment": True},
                 {"label_smoothing": 0.3}, {"loss_mode": "partial", "label_smoothing": 0.1},
                 {"loss_mode": "partial", "logit_adjustment": True}, {"label_smoothing": 0.1, "logit_adjustment": True})


def across_seed_levels(scaled: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The lead's reading of J aggregates of the same weights (jobs x weights, each ``aggregate /
    (steps x lr)``): per weight, two-means on ``|aggregate|`` over the jobs; the high level means
    both sites moved the weight the same way, the low one opposite ways.

    Returns:
        ``(heavy, light)``: the sign read for the heavier site (the aggregate's) and the lighter's,
        jobs x weights.
    """
    size, sign = np.abs(scaled), np.sign(scaled)
    high, low = size.max(axis=0), size.min(axis=0)
    for _ in range(30):
        is_high = np.abs(size - high) <= np.abs(size - low)
        high = np.where(is_high.any(axis=0), (size * is_high).sum(0) / np.maximum(is_high.sum(0), 1), high)
        low = np.where((~is_high).any(axis=0), (size * ~is_high).sum(0) / np.maximum((~is_high).sum(0), 1), low)
    is_high = np.abs(size - high) <= np.abs(size - low)
    return sign, np.where(is_high, sign, -sign)


def decay_oracle(data: np.ndarray, decay: np.ndarray, theta_sign: np.ndarray, threshold: float = 0.9) -> np.ndarray:
    """The light site's signs read from a data job with the factors measured by a decay job.

    Args:
        data: the data job's ``aggregate / (steps x lr)`` (positive: the weight moved down).
        decay: the decay job's, from the same round-0 model.
        theta_sign: the sign of each round-0 weight (the lead knows the model).
        threshold: ``|data| / (w1 f1 + w2 f2)`` above it: the sites agree.
    """
    total = np.maximum(decay * theta_sign, 1e-12)  # w1 f1 + w2 f2 where the decay ruled
    sign = np.sign(data)
    return np.where(np.abs(data) / total > threshold, sign, -sign)


def _job(files: Sequence[str], model: dict, rule_args: dict, seed: int, spread: float, factors: str):
    """Both sites' masked and unmasked updates of one job: ``(masked, plain, weights, theta_sign)``."""
    from fedpartial.algorithms.update_mask import masked_diff, model_digest
    from fedpartial_tools.bench.sign_decoding import round0_weights, site_updates

    updates, sizes, _ = site_updates(files, model, rule_args, seed)
    theta0, names = round0_weights(model, seed)
    start = model_digest(theta0) if factors == "tied" else b""
    masked = [masked_diff({"update": u}, f"site-{i + 1}".encode(), spread, start)["update"] if spread else u
              for i, u in enumerate(updates)]
    weights = np.asarray(sizes, float) / float(sum(sizes))
    theta_sign = np.sign(np.concatenate([theta0[k].ravel() for k in names]))
    return masked, updates, weights, theta_sign


def _aggregate(updates: List[np.ndarray], weights: np.ndarray, steps: int) -> np.ndarray:
    return (weights[0] * updates[0] + weights[1] * updates[1]) / steps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedpartial_tools.bench.mask_oracles",
                                     description=__doc__.split("\n\n")[0])
    attack_arguments(parser)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--spread", type=float, default=1.0)
    parser.add_argument("--decays", default="1.0,0.1,0.01", help="comma list of the decay job's weight_decay")
    parser.add_argument("--jobs", default="2,4,8", help="comma list of jobs (seeds) the levels attack combines")
    args = parser.parse_args(argv)

    files, model = two_site_split(args.data, args.out, args.seed)
    base = {"lr": args.lr, "batch_size": args.batch_size, "augmentation": "none", "local_iterations": args.steps}

    def read(job_seed, decay, factors, variant=None):
        masked, plain, weights, theta_sign = _job(files, model, {**base, "weight_decay": decay, **(variant or {})},
                                                  job_seed, args.spread, factors)
        return _aggregate(masked, weights, args.steps), plain, weights, theta_sign

    print("attack | factors | setting | light site decoded | heavy site (aggregate's sign)")
    data, plain, weights, theta_sign = read(args.seed, 0.0, "tied")
    light, heavy = int(np.argmin(weights)), int(np.argmax(weights))
    truth = [np.sign(u) for u in plain]
    for decay in (float(d) for d in args.decays.split(",")):
        oracle, _, _, _ = read(args.seed, decay, "tied")  # same round-0 model: same factors either way
        share = float(np.mean(decay_oracle(data, oracle, theta_sign) == truth[light]))
        print(f"weight-decay oracle | fixed or tied | decay {decay:g} | {share:.3f} | "
              f"{float(np.mean(np.sign(data) == truth[heavy])):.3f}", flush=True)
    most = max(int(j) for j in args.jobs.split(","))
    attacks = [(f"levels across seeds | {factors}", [read(args.seed + j, 0.0, factors) for j in range(most)])
               for factors in FACTORS]
    attacks.append(("levels across settings | tied",
                    [read(args.seed, 0.0, "tied", v) for v in LOSS_VARIANTS[:most]]))
    for name, runs in attacks:
        for count in (int(j) for j in args.jobs.split(",") if int(j) <= len(runs)):
            signs_heavy, signs_light = across_seed_levels(np.stack([r[0] for r in runs[:count]]))
            right_light = np.mean([np.mean(signs_light[j] == np.sign(runs[j][1][light])) for j in range(count)])
            right_heavy = np.mean([np.mean(signs_heavy[j] == np.sign(runs[j][1][heavy])) for j in range(count)])
            print(f"{name} | {count} jobs | {right_light:.3f} | {right_heavy:.3f}", flush=True)


if __name__ == "__main__":
    main()
