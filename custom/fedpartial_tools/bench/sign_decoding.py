"""What one published 2-site aggregate tells a job's lead about each site's update.

A lead who sets a tiny ``lr`` on large batches makes every site's round-0 update about
``+-k x lr`` per weight (the gradient's sign barely changes between such steps). With the
sites' weights w1 != w2 known (``metrics.json``), ``(theta0 - global) / lr = w1 a + w2 b`` takes
four levels per weight, and the two sites' signs decode from one aggregate. This measures that
on real site files, for the server's aggregation rule and for noise a site would add:

* ``mean``: the method's average, weighted by the sites' train sizes (FedAvg's default);
* ``median``: the server's ``weight_rule: median`` (with two sites their unweighted mean): the
  aggregate is the same whichever site sent which update, so no sign can be given to one site;
  the lead's best guess of each site's signs is the aggregate's own (the *consensus* column,
  right where both sites agree and where the site's change is the larger);
* ``rho``: each site adds Gaussian noise of std ``rho`` x its tensor's update RMS, afresh each
  round; ``rounds``: the lead averages that many rounds (at a tiny lr the model hardly moves, so
  each round repeats the same update and the noise averages away);
* ``concentration``: the share of a site's weight changes within 25 % of its median change (1:
  every weight moved alike, the regime the decoder needs);
* ``mask``: each site rescales each weight's update by its secret factor in ``[1 - mask, 1 + mask]``
  (:mod:`fedpartial.algorithms.update_mask`, the same in every round, so averaging rounds keeps it).

``python -m fedpartial_tools.bench.sign_decoding --data ../shared/data/ham10000_28.npz --out runs/signs``
"""
from __future__ import annotations

import argparse
import os
import tempfile
from typing import Dict, List, Sequence, Tuple

import numpy as np

_CLUSTER_ITERATIONS = 50


def decode_two_sites(scaled: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The lead's decoder: both sites' signs from ``v = w_heavy a + w_light b`` (in units of lr).

    The heavier site's sign is ``sign(v)``; the lighter one's is the same where ``|v|`` sits
    in the upper of two clusters (``w_heavy + w_light``) and the opposite in the lower
    (``|w_heavy - w_light|``); the clusters are found by two-centre k-means on ``|v|``.

    Args:
        scaled: the aggregate's change per weight divided by lr, flattened.

    Returns:
        (heavy site's signs, light site's signs).
    """
    magnitude = np.abs(scaled)
    low, high = np.quantile(magnitude, 0.1), np.quantile(magnitude, 0.9)
    for _ in range(_CLUSTER_ITERATIONS):
        near_high = np.abs(magnitude - high) < np.abs(magnitude - low)
        if near_high.all() or not near_high.any():
            break
        high, low = magnitude[near_high].mean(), magnitude[~near_high].mean()
    signs = np.sign(scaled)
    same = np.abs(magnitude - high) < np.abs(magnitude - low)
    return signs, np.where(same, signs, -signs)


def binned_bound(scaled: np.ndarray, truth: np.ndarray, bins: int = 200) -> float:
    """An upper bound on any decoder that reads one weight at a time: within each of ``bins``
    quantile bins of ``|v|``, the better of "the aggregate's sign" and "its opposite", chosen
    knowing ``truth`` (the site's real signs).

    Args:
        scaled: the aggregate's change per weight, flattened.
        truth: the site's signs, flattened.
        bins: quantile bins of ``|scaled|``.
    """
    magnitude = np.abs(scaled)
    edges = np.quantile(magnitude, np.linspace(0.0, 1.0, bins + 1))
    which = np.clip(np.searchsorted(edges, magnitude, side="right") - 1, 0, bins - 1)
    same = np.sign(scaled) == truth
    agree = np.bincount(which, weights=same.astype(float), minlength=bins)
    total = np.bincount(which, minlength=bins)
    return float(np.maximum(agree, total - agree).sum() / len(scaled))


def concentration(update: np.ndarray, band: float = 0.25) -> float:
    """Share of an update's weights whose change lies within ``band`` x the median change of it.

    Near 1 the update is quantized (every weight moved by about the same amount, the regime in
    which a weighted 2-site aggregate decodes to both sites' signs); a trained round spreads it.

    Args:
        update: one site's change per weight, flattened.
        band: the relative width around the median absolute change.
    """
    magnitude = np.abs(np.asarray(update, float))
    median = float(np.median(magnitude))
    if median == 0:
        return 0.0
    return float(np.mean(np.abs(magnitude - median) <= band * median))


def decoded_shares(updates: Sequence[np.ndarray], site_weights: Sequence[float], rule: str,
                   rho: float = 0.0, rounds: int = 1, rng: np.random.Generator = None,
                   tensor_sizes: Sequence[int] = (), mask: float = 0.0) -> Dict[str, float]:
    """Share of each site's update signs the lead reads from the (round-averaged) aggregate.

    Args:
        updates: the two sites' updates (theta0 - local) / lr, flattened over the same weights.
        site_weights: the sites' published weights (``mean``); ignored by ``median``.
        rule: ``mean`` or ``median`` (the server's ``weight_rule``).
        rho: site noise, std as a multiple of each tensor's update RMS (0 = none).
        rounds: rounds the lead averages (each repeats the update, with fresh noise).
        rng: noise generator.
        tensor_sizes: sizes of the tensors ``updates`` concatenates, for the per-tensor RMS
            (empty: one tensor).
        mask: the sites' update mask spread (0 = none); site i masks with the key ``site-<i+1>``.

    Returns:
        ``decoded_<i>`` (the lead's share for site i: the decoder's under ``mean``, the
        consensus under ``median``), ``consensus_<i>`` (the aggregate's sign taken for site i),
        ``bound_<i>`` (:func:`binned_bound`: what any one-weight-at-a-time decoder can reach) and
        ``agree`` (share of weights where both sites' signs agree).
    """
    from fedpartial.algorithms.robust import coordinate_median
    from fedpartial.algorithms.update_mask import masked_diff

    if len(updates) != 2 or len(site_weights) != 2:
        raise ValueError(f"decoded_shares measures a 2-site aggregate, got {len(updates)} updates")
    rng = rng or np.random.default_rng(0)
    sizes = list(tensor_sizes) or [updates[0].size]
    noisy = []
    for i, update in enumerate(updates):
        if mask > 0:
            update = masked_diff({"update": update}, f"site-{i + 1}".encode(), mask)["update"]
        if rho > 0:
            pieces = np.split(update, np.cumsum(sizes)[:-1])
            scale = np.concatenate([np.full(p.size, np.sqrt(np.mean(p ** 2))) for p in pieces])
            noise = rng.standard_normal((rounds, update.size)).mean(axis=0) * rho * scale
            update = update + noise
        noisy.append(update)
    if rule == "mean":
        w = np.asarray(site_weights, float) / float(np.sum(site_weights))
        scaled = w[0] * noisy[0] + w[1] * noisy[1]
    elif rule == "median":
        scaled = coordinate_median(noisy)  # the server's own median
    else:
        raise ValueError(f"rule '{rule}' unknown; choose 'mean' or 'median'")
    truth = [np.sign(u) for u in updates]
    out = {"agree": float(np.mean(truth[0] == truth[1]))}
    for i in range(2):
        out[f"consensus_{i}"] = float(np.mean(np.sign(scaled) == truth[i]))
        out[f"bound_{i}"] = binned_bound(scaled, truth[i])
    if rule == "median":
        # the aggregate does not change when the sites swap updates, so no weight's sign can be
        # given to one site: the lead's best guess for each is the aggregate's own sign
        out.update(decoded_0=out["consensus_0"], decoded_1=out["consensus_1"])
        return out
    heavy = int(np.argmax(site_weights))
    signs_heavy, signs_light = decode_two_sites(scaled)
    out[f"decoded_{heavy}"] = float(np.mean(signs_heavy == truth[heavy]))
    out[f"decoded_{1 - heavy}"] = float(np.mean(signs_light == truth[1 - heavy]))
    return out


def small_model_block(site_file: str) -> dict:
    """The job's model block for the small CNN on a classification site file: its classes, task,
    channels and image size.

    Args:
        site_file: one site's ``.npz``.
    """
    from fedpartial.data.sitefile import load_site_file

    site = load_site_file(site_file)
    images = site.splits["train"].images
    return {"arch": "small_cnn", "arch_args": {"width": 8}, "class_names": list(site.class_names),
            "task": site.task, "in_channels": int(images.shape[-1]) if images.ndim == 4 else 1,
            "input_size": [int(images.shape[1]), int(images.shape[2])]}


def fedavg_sites(site_files: Sequence[str], settings: dict, rule_args: dict, seed: int, state_root: str) -> list:
    """Each site's FedAvg client rule, set up on its file as the executor would, on the CPU.

    Args:
        site_files: the sites' ``.npz`` files (the site is named after the file).
        settings: the model settings (``fedpartial.flare.common.model_settings``).
        rule_args: the FedAvg client rule's settings.
        seed: the job's seed (the batches).
        state_root: a folder for the rules' state, one subfolder per site.

    Returns:
        ``[(site, rule)]`` in the files' order.
    """
    import torch

    from fedpartial.algorithms.base import ClientContext
    from fedpartial.algorithms.registry import build_rule
    from fedpartial.flare.executors import load_site_dataset

    sites = []
    for path in site_files:
        site = os.path.splitext(os.path.basename(path))[0]
        rule = build_rule("client", "fedavg", dict(rule_args))
        rule.setup(ClientContext(site=site, data=load_site_dataset(path, site, settings), device=torch.device("cpu"),
                                 state_dir=os.path.join(state_root, site), seed=seed,
                                 normalisation=settings["normalisation"]))
        sites.append((site, rule))
    return sites


def round0_weights(model: dict, seed: int) -> Tuple[Dict[str, np.ndarray], List[str]]:
    """The seeded round-0 model a job's sites train from, and the names of its trained weights
    (floating-point, not normalisation statistics).

    Args:
        model: the job's model block.
        seed: the job's seed.
    """
    import torch

    from fedpartial.flare.common import build_model_from_settings, model_settings
    from fedpartial.training.common import state_dict_numpy

    torch.manual_seed(seed)
    theta0 = state_dict_numpy(build_model_from_settings(model_settings(model)))
    return theta0, [k for k, t in theta0.items() if np.issubdtype(t.dtype, np.floating) and "running" not in k]


def site_updates(site_files: Sequence[str], model: dict, rule_args: dict, seed: int = 0
                 ) -> Tuple[List[np.ndarray], List[int], List[int]]:
    """Each site's round-0 FedAvg update from the same seeded initial model, in units of lr.

    Args:
        site_files: the two sites' ``.npz`` files (``python -m fedpartial split``).
        model: the job's model block.
        rule_args: the FedAvg client rule's settings (``lr``, ``batch_size``, ``local_iterations``...).
        seed: the job's seed (the initial model and the batches).

    Returns:
        (updates, train sizes, tensor sizes): each update (theta0 - local) / lr flattened over the
        floating-point parameters (no running statistics), the sites' sample counts.
    """
    from fedpartial.algorithms.base import RoundInput
    from fedpartial.flare.common import build_model_from_settings, model_settings
    from fedpartial.training.common import load_state_numpy, state_dict_numpy

    settings = model_settings(model)
    theta0, keys = round0_weights(model, seed)
    lr = float(rule_args["lr"])
    updates, sizes = [], []
    with tempfile.TemporaryDirectory() as state_root:
        for _, rule in fedavg_sites(site_files, settings, rule_args, seed, state_root):
            net = build_model_from_settings(settings)
            load_state_numpy(net, theta0)
            result = rule.train_round(net, RoundInput(0, 1, {}))
            local = state_dict_numpy(net)
            updates.append(np.concatenate([((theta0[k] - local[k]).astype(np.float64) / lr).ravel() for k in keys]))
            sizes.append(int(result.num_samples))
    return updates, sizes, [int(theta0[k].size) for k in keys]


def attack_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of a 2-site attack setting (:func:`two_site_split`): data, folder, lr, batch, seed."""
    parser.add_argument("--data", required=True, help="a classification .npz (split into 2 sites here)")
    parser.add_argument("--out", required=True, help="folder for the 2 site files")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)


def two_site_split(data: str, out: str, seed: int) -> Tuple[List[str], dict]:
    """The attack's setting: ``data`` split into 2 sites of 4 classes each (label-set mismatch).

    Args:
        data: a classification ``.npz``.
        out: folder for the site files.
        seed: the split's seed.

    Returns:
        the two site files and the small CNN's model block for them.
    """
    from fedpartial_tools.data.partition import split_file

    split_file(data, "label-set-mismatch", 2, seed, out, classes_per_site=4)
    files = [os.path.join(out, f"site-{i}.npz") for i in (1, 2)]
    return files, small_model_block(files[0])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedpartial_tools.bench.sign_decoding",
                                     description=__doc__.split("\n\n")[0])
    attack_arguments(parser)
    parser.add_argument("--steps", default="2,10", help="comma list of local steps (0: one epoch)")
    parser.add_argument("--rho", default="0,0.5,1,2", help="comma list of site noise (x update RMS)")
    parser.add_argument("--rounds", default="1,10,100", help="comma list of rounds the lead averages")
    parser.add_argument("--mask", default="0", help="comma list of the sites' update mask spreads")
    args = parser.parse_args(argv)

    files, model = two_site_split(args.data, args.out, args.seed)
    rng = np.random.default_rng(args.seed)
    print("steps | rule | mask | rho | rounds | site weights | decoded site-1 / site-2 | consensus site-1 / site-2 | "
          "bound site-1 / site-2 | signs agree | concentration site-1 / site-2")
    for steps in (int(s) for s in args.steps.split(",")):
        rule_args = {"lr": args.lr, "batch_size": args.batch_size, "augmentation": "none"}
        if steps > 0:  # 0: the shipped recipe's one epoch over each site's labelled rows
            rule_args["local_iterations"] = steps
        updates, sizes, tensors = site_updates(files, model, rule_args, args.seed)
        weights = [s / sum(sizes) for s in sizes]
        held = [concentration(u) for u in updates]
        for rule in ("mean", "median"):
            for mask, rho, rounds in ((m, r, n) for m in args.mask.split(",") for r in args.rho.split(",")
                                      for n in args.rounds.split(",")):
                mask, rho, rounds = float(mask), float(rho), int(rounds)
                if rho == 0 and rounds > 1:
                    continue
                s = decoded_shares(updates, weights, rule, rho, rounds, rng, tensors, mask)
                print(f"{steps} | {rule} | {mask:g} | {rho:g} | {rounds} | {weights[0]:.3f} / {weights[1]:.3f} | "
                      f"{s['decoded_0']:.3f} / {s['decoded_1']:.3f} | {s['consensus_0']:.3f} / "
                      f"{s['consensus_1']:.3f} | {s['bound_0']:.3f} / {s['bound_1']:.3f} | {s['agree']:.3f} | "
                      f"{held[0]:.3f} / {held[1]:.3f}", flush=True)


if __name__ == "__main__":
    main()
