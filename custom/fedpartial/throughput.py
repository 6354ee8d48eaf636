"""``python -m fedpartial throughput``: training images/s of each method's client rule against a
plain PyTorch loop on the same model, data and batch, measured in one run; and, from a finished
simulator workspace, FLARE time per round beyond local training and bytes sent per site per round.

Images/s counts the images that pass through the student model in training mode (a forward
hook), so the extra passes a method makes (teacher, uncertainty estimation, MC dropout,
prototypes) show up as lower throughput, and the report says where the time went.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Dict, List

import numpy as np
import torch

# method -> (client rule, its args, server rule): the untimed first round goes through the server
# rule so that the timed rounds see real global statistics (prototypes, relation matrix...).
RULES = {
    "fedavg": ("fedpartial.algorithms.fedavg.SupervisedClient", {"loss_mode": "partial", "local_epochs": 1},
               "fedpartial.algorithms.fedavg.FedAvgServer"),
    "fedlsm": ("fedpartial.algorithms.fedlsm.FedLSMClient", {"local_epochs": 1.0},
               "fedpartial.algorithms.fedlsm.AWPAServer"),
    "fedmlp": ("fedpartial.algorithms.fedmlp.FedMLPClient", {"warmup_rounds": 1},
               "fedpartial.algorithms.fedmlp.FedMLPServer"),
    "fedirm": ("fedpartial.algorithms.fedirm.FedIRMClient", {}, "fedpartial.algorithms.fedirm.FedIRMServer"),
}


class _Counter:
    """Counts images through a model in training mode."""

    def __init__(self, model):
        self.images = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, inputs):
        if module.training:
            self.images += int(inputs[0].shape[0])


def plain_loop(model, images: torch.Tensor, labels: torch.Tensor, batch_size: int, steps: int, device,
               task: str) -> float:
    """Images/s of the plainest loop: flip, forward, loss, backward, Adam step.

    Args:
        model: a fedpartial model.
        images: ``(N, C, H, W)`` normalised.
        labels: ``(N, C)`` multi-hot.
        batch_size: samples per step.
        steps: timed steps (after 3 warm-up steps).
        device: torch device.
        task: ``single-label`` or ``multi-label``.
    """
    from fedpartial.data.transforms import flip_batch

    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model.train()
    rng = np.random.default_rng(0)
    loss_fn = torch.nn.CrossEntropyLoss() if task == "single-label" else torch.nn.BCEWithLogitsLoss()

    def step():
        idx = rng.integers(0, len(images), batch_size)
        x = flip_batch(images[idx]).to(device)
        y = labels[idx].to(device)
        _, logits = model(x)
        loss = loss_fn(logits, y.argmax(1) if task == "single-label" else y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch_size / (time.perf_counter() - start)


def rule_throughput(name: str, site_file: str, arch: str, batch_size: int, rounds: int, device, seed: int = 0,
                    global_stats=None) -> Dict[str, float]:
    """Images/s of one method's ``train_round`` on a site file (after one untimed round)."""
    from fedpartial.algorithms.base import ClientContext, RoundInput, ServerContext, SiteUpdate
    from fedpartial.data.sitefile import load_site_file
    from fedpartial.flare.common import build_rule
    from fedpartial.models import build_model
    from fedpartial.training.common import state_dict_numpy

    path, args, server_path = RULES[name]
    data = load_site_file(site_file)
    channels = 1 if data.splits["train"].images.ndim == 3 else 3
    torch.manual_seed(seed)
    model = build_model(arch, data.num_classes, channels).to(device)
    rule = build_rule(path, dict(args, batch_size=batch_size))
    with tempfile.TemporaryDirectory() as state:
        rule.setup(ClientContext(site=data.site, data=data, device=device, state_dir=state, seed=seed))
        result = rule.train_round(model, RoundInput(0, rounds + 1, dict(global_stats or {})))
        weights = state_dict_numpy(model)
        _, stats = build_rule(server_path, {}).aggregate(
            [SiteUpdate(data.site, weights, result.num_samples, result.stats)],
            ServerContext(0, rounds + 1, model.classifier_param_names(), weights))
        counter = _Counter(model)
        start = time.perf_counter()
        for r in range(1, rounds + 1):
            rule.train_round(model, RoundInput(r, rounds + 1, stats))
        seconds = time.perf_counter() - start
        counter.handle.remove()
    return {"images_per_s": counter.images / seconds, "seconds_per_round": seconds / rounds,
            "train_images_per_round": counter.images / rounds, "stats_keys": sorted(result.stats)}


def flare_overhead(workspace: str) -> Dict[str, float]:
    """From a simulator workspace's metrics.json: per round, wall time between aggregations minus
    the slowest site's local time (validation + training), and bytes sent per site per round."""
    rounds = json.load(open(os.path.join(workspace, "metrics.json")))["rounds"]
    stamps = [r.get("aggregated_at") for r in rounds]
    overheads, weights_b, stats_b = [], [], []
    for prev, cur, r in zip(stamps, stamps[1:], rounds[1:]):
        local = max(s.get("train_seconds", 0.0) for s in r["sites"].values())
        overheads.append(cur - prev - local)
    for r in rounds:
        for s in r["sites"].values():
            weights_b.append(s.get("bytes_weights", 0))
            stats_b.append(s.get("bytes_stats", 0))
    return {"flare_seconds_per_round": float(np.median(overheads)) if overheads else float("nan"),
            "bytes_weights_per_site_round": float(np.mean(weights_b)),
            "bytes_stats_per_site_round": float(np.mean(stats_b))}


def _cmd(args):
    from fedpartial.data.sitefile import load_site_file
    from fedpartial.models import build_model
    from fedpartial.training.common import images_to_tensor, select_device

    torch.set_num_threads(args.threads)
    device = select_device(args.device)
    data = load_site_file(args.site_file)
    train = data.splits["train"]
    x = images_to_tensor(train.images)
    y = torch.as_tensor(train.labels, dtype=torch.float32)
    channels = x.shape[1]
    lines = [f"device {device}, {args.threads} thread(s), arch {args.arch}, batch {args.batch_size}, "
             f"site file {args.site_file} ({len(train)} images {tuple(x.shape[2:])})", "",
             "| loop | images/s | ratio to plain loop | images through the student per round | s per round |",
             "|---|---|---|---|---|"]
    torch.manual_seed(0)
    plain = plain_loop(build_model(args.arch, data.num_classes, channels).to(device), x, y, args.batch_size,
                       args.steps, device, data.task)
    lines.append(f"| plain PyTorch loop | {plain:.0f} | 1.00 | – | – |")
    results = {"plain": plain}
    for name in args.methods.split(","):
        try:
            r = rule_throughput(name, args.site_file, args.arch, args.batch_size, args.rounds, device)
        except Exception as e:  # report and go on: one method's failure must not hide the others
            lines.append(f"| {name} | error: {e} | | | |")
            continue
        results[name] = r
        lines.append(f"| {name} rule | {r['images_per_s']:.0f} | {r['images_per_s'] / plain:.2f} | "
                     f"{r['train_images_per_round']:.0f} | {r['seconds_per_round']:.2f} |")
    if args.workspace:
        for ws in args.workspace:
            o = flare_overhead(ws)
            lines += ["", f"{ws}: FLARE time per round beyond local work {o['flare_seconds_per_round']:.2f} s; "
                          f"sent per site per round: weights {o['bytes_weights_per_site_round'] / 1e6:.3f} MB, "
                          f"statistics {o['bytes_stats_per_site_round']:.0f} B"]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def add_throughput_parser(sub) -> None:
    s = sub.add_parser("throughput", help="images/s of each method's client rule vs a plain PyTorch loop")
    s.add_argument("--site-file", required=True, help="a site file made by 'split'")
    s.add_argument("--arch", default="small_cnn")
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--steps", type=int, default=60, help="timed steps of the plain loop")
    s.add_argument("--rounds", type=int, default=1, help="timed rounds per method")
    s.add_argument("--methods", default="fedavg,fedlsm,fedmlp,fedirm")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--device", default="auto")
    s.add_argument("--workspace", action="append", default=[], help="simulator workspace(s) for FLARE overhead")
    s.add_argument("--json", default="")
    s.set_defaults(func=_cmd)
