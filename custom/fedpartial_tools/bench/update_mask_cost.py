"""What a site's update mask (:mod:`fedpartial.algorithms.update_mask`) costs a FedAvg training.

Runs FedAvg in-process (no FLARE: each site's shipped client rule trains from the global model,
the server takes FedAvg's sample-weighted mean, ``fedavg_weights``, of what the sites send) on a split of a classification
file, once with plain updates and once per mask spread, every site masking with its own key, the
same seed and batches otherwise; reports the global model's AUC on the source's val split by round.
The test split is not read.

``python -m fedpartial_tools.bench.update_mask_cost --data ../shared/data/ham10000_28.npz --out runs/mask_cost``
"""
from __future__ import annotations

import argparse
import os
import tempfile
from typing import List, Sequence

import numpy as np

from fedpartial_tools.bench.sign_decoding import fedavg_sites, small_model_block


def fedavg_with_mask(site_files: Sequence[str], source: str, model: dict, rule_args: dict, rounds: int,
                     spread: float, seed: int = 0) -> List[float]:
    """The global model's val AUC after each round of FedAvg whose sites mask their updates.

    Args:
        site_files: the sites' ``.npz`` files.
        source: the file they were split from (its val split scores the global model).
        model: the job's model block.
        rule_args: the FedAvg client rule's settings.
        rounds: rounds to run.
        spread: the mask's spread (0: plain updates).
        seed: the job's seed (initial model, batches).
    """
    import torch

    from fedpartial.algorithms.aggregation import fedavg_weights
    from fedpartial.algorithms.base import RoundInput, SiteUpdate
    from fedpartial.algorithms.update_mask import masked_weights
    from fedpartial.data.npz import load_npz
    from fedpartial.evaluation import evaluate_split
    from fedpartial.flare.common import build_model_from_settings, model_settings
    from fedpartial.training.common import load_state_numpy, state_dict_numpy

    settings = model_settings(model)
    torch.manual_seed(seed)
    net = build_model_from_settings(settings)
    global_weights = state_dict_numpy(net)
    val = load_npz(source).splits["val"]
    curve = []
    with tempfile.TemporaryDirectory() as state_root:
        sites = fedavg_sites(site_files, settings, rule_args, seed, state_root)
        for round_index in range(rounds):
            sent = []
            for site, rule in sites:
                load_state_numpy(net, global_weights)
                result = rule.train_round(net, RoundInput(round_index, rounds, {}))
                local = state_dict_numpy(net)
                weights = masked_weights(global_weights, local, site.encode(), spread) if spread > 0 else local
                sent.append(SiteUpdate(site, weights, result.num_samples))
            global_weights = fedavg_weights(sent)
            load_state_numpy(net, global_weights)
            metrics = evaluate_split(net, val, settings["task"], settings["class_names"], settings["normalisation"],
                                     torch.device("cpu"))
            curve.append(float(metrics["auc"]))
    return curve


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedpartial_tools.bench.update_mask_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a classification .npz")
    parser.add_argument("--out", required=True, help="folder for the site files")
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--classes-per-site", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--spread", default="0,1", help="comma list of mask spreads (0: plain updates)")
    parser.add_argument("--seeds", default="0")
    args = parser.parse_args(argv)

    from fedpartial_tools.data.partition import split_file

    print("seed | spread | val AUC by round (every 5th) | last | mean of the last 5")
    for seed in (int(s) for s in args.seeds.split(",")):
        out = os.path.join(args.out, f"seed{seed}")
        split_file(args.data, "label-set-mismatch", args.sites, seed, out, classes_per_site=args.classes_per_site)
        files = [os.path.join(out, f"site-{i}.npz") for i in range(1, args.sites + 1)]
        model = small_model_block(files[0])
        for spread in (float(s) for s in args.spread.split(",")):
            curve = fedavg_with_mask(files, args.data, model, {"lr": 1e-3, "batch_size": 64}, args.rounds, spread,
                                     seed)
            print(f"{seed} | {spread:g} | " + " ".join(f"{v:.3f}" for v in curve[4::5]) + f" | {curve[-1]:.4f} | "
                  f"{np.mean(curve[-5:]):.4f}", flush=True)


if __name__ == "__main__":
    main()
