"""What the statistics filters cost in accuracy.

``python -m fedpartial_tools.bench.privacy measure --workspace WS`` runs a job (default ``jobs/fedlsm``) in the
FLARE simulator twice on the same split, once as configured and once with a
:class:`fedpartial.flare.filters.StatisticsPrivacyFilter` (minimum-count rule + Gaussian noise on
the statistics) as the sites' train result filter, evaluates both final global models on a test
split and prints the AUC difference. Without ``--data-root`` it writes a small synthetic
label-set-mismatch split (3 sites, 4 classes, 16x16 grey images) so the whole command stays
within a few minutes on 2 CPU cores.

Example::

    python -m fedpartial_tools.bench.privacy measure --workspace /tmp/privacy --min-count 5 \\
        --sigma class_counts=10 --sigma label_pos=10 --sigma label_neg=10 --rounds 5 --seeds 0,1
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from fedpartial.data.types import SINGLE_LABEL, Dataset, Split

DEMO_CLASSES = ["c0", "c1", "c2", "c3"]
DEMO_ANNOTATED = [[0, 1, 2], [1, 2, 3], [0, 2, 3]]  # classes each demo site annotates
# A small job that learns the demo data in a few rounds (the paper-size model would not).
DEMO_SETS = [f"model.class_names={json.dumps(DEMO_CLASSES)}", "model.input_size=[16,16]", "model.in_channels=1",
             "model.arch_args.width=8", "model.arch_args.depth=2", "device=cpu", "rule_args.batch_size=16",
             "rule_args.lr=0.001", "rule_args.strong_view=flip", "rule_args.ude_pairs=4"]


def _demo_split(n: int, rng: np.random.Generator, noise: float = 40.0, signal: float = 60.0) -> Split:
    """Class c brightens its own 4x4 tile of a 16x16 grey image, faintly under heavy noise, so
    that a few rounds give an AUC below 1 (room to see a difference)."""
    labels = np.eye(len(DEMO_CLASSES), dtype=np.float32)[rng.integers(0, len(DEMO_CLASSES), n)]
    images = rng.normal(90, noise, size=(n, 16, 16))
    for c in range(len(DEMO_CLASSES)):
        images[labels[:, c] > 0, 4 * c:4 * c + 4, 4 * c:4 * c + 4] += signal
    return Split(np.clip(images, 0, 255).astype(np.uint8), labels, np.ones_like(labels, dtype=bool))


def write_demo_split(out_dir: str, n_train=(60, 40, 24), n_val: int = 16, n_test: int = 400,
                     seed: int = 0) -> Split:
    """Write ``site-k.npz`` (label-set mismatch: site k annotates DEMO_ANNOTATED[k]) and return
    a test split with complete labels.

    Args:
        out_dir: folder for the site files.
        n_train: training images per site (unequal, so small classes occur).
        n_val: validation images per site.
        n_test: test images.
        seed: data seed.
    """
    from fedpartial.data.sitefile import write_site_file

    rng = np.random.default_rng(seed)
    os.makedirs(out_dir, exist_ok=True)
    for k, (n, classes) in enumerate(zip(n_train, DEMO_ANNOTATED), start=1):
        train, val = _demo_split(n, rng), _demo_split(n_val, rng)
        mask = np.zeros_like(train.labels, dtype=bool)
        mask[:, classes] = True
        site = Dataset(SINGLE_LABEL, DEMO_CLASSES, {"train": Split(train.images, train.labels * mask, mask),
                                                      "val": val},
                       source="fedpartial_tools.bench.privacy demo", site=f"site-{k}",
                       info={"scenario": "label-set-mismatch", "annotated_classes": classes})
        write_site_file(os.path.join(out_dir, f"site-{k}.npz"), site)
    return _demo_split(n_test, rng)


def filter_chain(preset: str, min_count: int, sigma: Dict[str, float], seed: Optional[int] = None) -> list:
    """The client ``task_result_filters`` value with one StatisticsPrivacyFilter on ``train``."""
    args = {"preset": preset, "min_count": int(min_count), "noise_sigma": dict(sigma)}
    if seed is not None:
        args["seed"] = int(seed)
    return [{"tasks": ["train"], "filters": [{"path": "fedpartial.flare.filters.StatisticsPrivacyFilter",
                                              "args": args}]}]


def filter_settings(stats_chain: list, percentile: Optional[float] = None, gamma: float = 0.01) -> List[str]:
    """Job overrides putting the filters on: the statistics chain (may be empty) and, with
    ``percentile``, NVFlare's ``PercentilePrivacy`` on the weights. That filter works on weight
    differences, so the sites also get ``SendWeightDiff`` (in and out) and the server
    ``RestoreFullWeights`` (docs/FAILURE_BEHAVIOUR.md).

    Args:
        stats_chain: from :func:`filter_chain`, or ``[]``.
        percentile: PercentilePrivacy's percentile (its default is 10); None = no weight filter.
        gamma: PercentilePrivacy's clipping bound (its default is 0.01).
    """
    result = [f for block in stats_chain for f in block["filters"]]
    sets = []
    if percentile is not None:
        diff = {"path": "fedpartial.flare.filters.SendWeightDiff", "args": {}}
        result += [diff, {"path": "nvflare.app_common.filters.percentile_privacy.PercentilePrivacy",
                          "args": {"percentile": float(percentile), "gamma": float(gamma)}}]
        sets += ["client.task_data_filters=" + json.dumps([{"tasks": ["train"], "filters": [diff]}]),
                 "server.task_result_filters=" + json.dumps([{"tasks": ["train"], "filters": [
                     {"path": "fedpartial.flare.filters.RestoreFullWeights", "args": {}}]}])]
    chain = [{"tasks": ["train"], "filters": result}] if result else []
    return [f"client.task_result_filters={json.dumps(chain)}"] + sets


def _test_auc(model_file: str, test: Split) -> float:
    from fedpartial.data.transforms import resize_dataset
    from fedpartial.evaluation import evaluate_split
    from fedpartial.models.io import load_model_file, model_input_size

    model, meta = load_model_file(model_file)
    data = Dataset(meta["task"], meta["class_names"], {"test": test})
    size = model_input_size(meta)
    if size:
        data = resize_dataset(data, size)
    metrics = evaluate_split(model, data.splits["test"], meta["task"], meta["class_names"], meta["normalisation"],
                             "cpu")
    return float(metrics["auc"])


def measure(workspace: str, job: str = "jobs/fedlsm", data_root: Optional[str] = None, test: Optional[Split] = None,
            preset: str = "fedlsm", min_count: int = 5, sigma: Optional[Dict[str, float]] = None, rounds: int = 5,
            seeds: Sequence[int] = (0,), overrides: Sequence[str] = (), log=print, stats_filter: bool = True,
            percentile: Optional[float] = None, gamma: float = 0.01) -> dict:
    """Run ``job`` with and without the privacy filters and compare test AUC.

    Args:
        workspace: output folder (one simulator workspace per run, and ``privacy_effect.json``).
        job: job folder.
        data_root: site files; None = write the synthetic demo split (then ``test`` is made too).
        test: test split with complete labels (needed with ``data_root``).
        preset / min_count / sigma: the filter (see StatisticsPrivacyFilter).
        rounds: FL rounds per run.
        seeds: job seeds; each seed runs both variants (the noise seed follows it).
        overrides: extra ``key=value`` job settings (the demo adds a small model).
        stats_filter: the filtered runs use the statistics filter (``preset``, ``min_count``, ``sigma``).
        percentile / gamma: the filtered runs also put NVFlare's PercentilePrivacy on the weights.
    """
    if not stats_filter and percentile is None:
        raise ValueError("measure: nothing to compare: no statistics filter and no percentile filter")
    simulate = _simulate()
    workspace = os.path.abspath(workspace)
    os.makedirs(workspace, exist_ok=True)
    sets = list(overrides)
    if data_root is None:
        data_root = os.path.join(workspace, "sites")
        test = write_demo_split(data_root)
        sets = DEMO_SETS + sets
    elif test is None:
        raise ValueError("measure: give a test split together with data_root")
    else:
        from fedpartial_tools.data.sites import dataset_overrides

        sets = dataset_overrides(data_root) + sets  # class names, task, channels, size of the site files
    sigma = dict(sigma or {})
    runs: List[dict] = []
    for seed in seeds:
        for variant in ("plain", "filtered"):
            filters = filter_settings([])
            if variant == "filtered":
                chain = filter_chain(preset, min_count, sigma, seed) if stats_filter else []
                filters = filter_settings(chain, percentile, gamma)
            ws = os.path.join(workspace, f"{variant}_seed{seed}")
            started = time.time()
            summary = simulate(job, data_root, ws, [*sets, f"num_rounds={rounds}", f"seed={seed}", *filters],
                               log=lambda m: None)
            if summary["exit_code"] != 0:
                raise RuntimeError(f"{variant} run (seed {seed}) failed: {summary['errors']}")
            auc = _test_auc(os.path.join(ws, "global_model.pt"), test)
            runs.append({"variant": variant, "seed": seed, "auc": auc, "seconds": round(time.time() - started, 1)})
            log(f"seed {seed} {variant:8s}: test AUC {auc:.4f} ({runs[-1]['seconds']:.0f} s)")
    plain = np.mean([r["auc"] for r in runs if r["variant"] == "plain"])
    filtered = np.mean([r["auc"] for r in runs if r["variant"] == "filtered"])
    result = {"job": job, "stats_filter": {"preset": preset, "min_count": min_count, "sigma": sigma} if stats_filter
              else None, "percentile_filter": None if percentile is None else {"percentile": percentile, "gamma": gamma},
              "rounds": rounds,
              "seeds": list(seeds), "runs": runs, "auc_plain": float(plain), "auc_filtered": float(filtered),
              "auc_difference": float(filtered - plain)}
    with open(os.path.join(workspace, "privacy_effect.json"), "w") as f:
        json.dump(result, f, indent=1)
    log(f"mean test AUC: plain {plain:.4f}, filtered {filtered:.4f}, difference {filtered - plain:+.4f}")
    return result


def _simulate():
    from fedpartial_tools.run.simulator import simulate

    return simulate


def _parse_sigma(items: Sequence[str]) -> Dict[str, float]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--sigma '{item}' is not KEY=SIGMA")
        out[key] = float(value)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fedpartial_tools.bench.privacy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="test AUC with and without the privacy filters")
    m.add_argument("--workspace", required=True)
    m.add_argument("--job", default="jobs/fedlsm")
    m.add_argument("--data-root", default=None, help="site files (default: a synthetic demo split)")
    m.add_argument("--test", default=None, help="source .npz whose 'test' split is used (with --data-root)")
    m.add_argument("--preset", default="fedlsm")
    m.add_argument("--min-count", type=int, default=5)
    m.add_argument("--sigma", action="append", default=[], metavar="KEY=SIGMA", help="noise on one statistic")
    m.add_argument("--no-stats-filter", action="store_true", help="measure the weight filter alone")
    m.add_argument("--percentile", type=float, default=None,
                   help="also put NVFlare's PercentilePrivacy (this percentile) on the weights")
    m.add_argument("--gamma", type=float, default=0.01, help="PercentilePrivacy's clipping bound")
    m.add_argument("--rounds", type=int, default=5)
    m.add_argument("--seeds", default="0", help="comma-separated job seeds")
    m.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="job override")
    args = p.parse_args(argv)
    try:
        test = None
        if args.test:
            from fedpartial.data.npz import load_npz

            test = load_npz(args.test).splits["test"]
        measure(args.workspace, args.job, args.data_root, test, args.preset, args.min_count, _parse_sigma(args.sigma),
                args.rounds, [int(s) for s in args.seeds.split(",")], args.set, stats_filter=not args.no_stats_filter,
                percentile=args.percentile, gamma=args.gamma)
    except (ValueError, FileNotFoundError, RuntimeError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
