"""``python -m fedpartial_tools throughput``: training images/s of each method's client rule against a
plain PyTorch loop on the same model, data and batch, measured in one run; and, from a finished
simulator workspace, FLARE time per round beyond local training and bytes sent per site per round
(weights and each method's statistics).

Images/s counts the images that pass through the student model in training mode (a forward
hook), so the extra passes a method makes (teacher, uncertainty estimation, MC dropout,
prototypes, IoU and completeness passes) show up as lower throughput, and the report says where
the time went.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from fedpartial.data.types import MULTI_LABEL, SEGMENTATION, SINGLE_LABEL, Dataset, Split

_CLASSIFICATION = (SINGLE_LABEL, MULTI_LABEL)


@dataclass(frozen=True)
class RuleSpec:
    """How to time one method's client rule.

    Attributes:
        client: registered name of the client rule (:mod:`fedpartial.algorithms.registry`).
        server: registered name of the server rule (gives the timed rounds real global statistics).
        tasks: site-file tasks the rule runs on.
        client_args / server_args: constructor arguments (besides ``batch_size``).
        untimed_rounds: rounds run before the clock starts, so that the timed rounds are the
            rule's steady state (FedMLP stage 2, FedIA after warm-up).
        hide_labels: train on the site's images with every label hidden (FedIRM's unlabelled
            branch); the untimed round then runs the labelled branch on the real labels, so the
            timed rounds match a relation matrix as at a real unlabelled site.
    """

    client: str
    server: str
    tasks: Sequence[str]
    client_args: Dict = field(default_factory=dict)
    server_args: Dict = field(default_factory=dict)
    untimed_rounds: int = 1
    hide_labels: bool = False


RULES: Dict[str, RuleSpec] = {
    "fedavg": RuleSpec("fedavg", "fedavg",
                       _CLASSIFICATION, {"loss_mode": "partial", "local_epochs": 1}),
    "fedlsm": RuleSpec("fedlsm", "fedlsm",
                       _CLASSIFICATION, {"local_epochs": 1.0}),
    "fedmlp": RuleSpec("fedmlp", "fedmlp",
                       (MULTI_LABEL,), {"warmup_rounds": 1}),
    "fedirm": RuleSpec("fedirm", "fedirm",
                       _CLASSIFICATION),
    "fedirm_unlabelled": RuleSpec("fedirm",
                                  "fedirm", _CLASSIFICATION,
                                  {"unlabelled_start_round": 0}, hide_labels=True),
    "fedavg_seg": RuleSpec("fedavg_seg",
                           "fedavg", (SEGMENTATION,)),
    "fedia": RuleSpec("fedia", "fedia",
                      (SEGMENTATION,), {"warmup_rounds": 2}, {"warmup_rounds": 2}, untimed_rounds=2),
}


def methods_for(task: str) -> List[str]:
    """The methods of :data:`RULES` that run on a site file of ``task``."""
    return [name for name, spec in RULES.items() if task in spec.tasks]


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
    """Images/s of the plainest loop: (flip,) forward, loss, backward, Adam step.

    Args:
        model: a fedpartial model.
        images: ``(N, C, H, W)`` normalised.
        labels: ``(N, C)`` multi-hot, or ``(N, H, W)`` 0/1 masks for segmentation.
        batch_size: samples per step.
        steps: timed steps (after 3 warm-up steps).
        device: torch device.
        task: ``single-label``, ``multi-label`` or ``segmentation`` (Dice loss as MONAI computes it,
            no flip: the segmentation rules train on the images as they are).
    """
    from fedpartial.data.transforms import flip_batch

    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model.train()
    rng = np.random.default_rng(0)
    if task == SEGMENTATION:
        from fedpartial.algorithms.segmentation import make_dice_loss

        dice = make_dice_loss()
        loss_fn = lambda logits, y: dice(logits, y.unsqueeze(1))  # noqa: E731
    elif task == SINGLE_LABEL:
        ce = torch.nn.CrossEntropyLoss()
        loss_fn = lambda logits, y: ce(logits, y.argmax(1))  # noqa: E731
    else:
        loss_fn = torch.nn.BCEWithLogitsLoss()

    def step():
        idx = rng.integers(0, len(images), batch_size)
        x = images[idx] if task == SEGMENTATION else flip_batch(images[idx])
        _, logits = model(x.to(device))
        loss = loss_fn(logits, labels[idx].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch_size / (time.perf_counter() - start)


def hide_labels(data: Dataset) -> Dataset:
    """The site's data with every train label hidden (labels and label mask all 0), as an
    unlabelled site of the ``semi-supervised`` scenario holds it."""
    train = data.splits["train"]
    splits = dict(data.splits)
    splits["train"] = Split(train.images, np.zeros_like(train.labels), np.zeros_like(train.labels, dtype=bool),
                            train.ids, train.groups)
    info = {k: v for k, v in dict(data.info).items() if k != "labelled"}
    return Dataset(data.task, list(data.class_names), splits, data.source, data.site, info)


def _context(data: Dataset, device, state_dir: str, seed: int):
    from fedpartial.algorithms.base import ClientContext

    return ClientContext(site=data.site or "site", data=data, device=device, state_dir=state_dir, seed=seed)


def rule_throughput(name: str, data: Dataset, arch: str, batch_size: int, rounds: int, device,
                    seed: int = 0, arch_args: Optional[Dict] = None,
                    memory_format: str = "contiguous") -> Dict[str, object]:
    """Images/s of one method's ``train_round`` on a site's data, after its untimed rounds.

    Args:
        name: a key of :data:`RULES`.
        data: the site's data (already at the job's input size).
        arch: model architecture (``fedpartial.models.build_model``).
        batch_size: the rule's batch size.
        rounds: timed rounds.
        device: torch device.
        seed: seeds the model and the rounds.
        arch_args: architecture options (e.g. a job's ``model.arch_args``).
        memory_format: the layout the model trains in, as the executor's ``memory_format``.

    Returns:
        ``images_per_s``, ``seconds_per_round``, ``train_images_per_round`` (images through the
        student in training mode) and ``stats_keys`` (the statistics the rule sends).
    """
    from fedpartial.algorithms.base import RoundInput, ServerContext, SiteUpdate
    from fedpartial.algorithms.registry import build_rule
    from fedpartial.models import build_model
    from fedpartial.training.common import place_model, state_dict_numpy

    spec = RULES[name]
    if data.task not in spec.tasks:
        raise ValueError(f"method '{name}' runs on {list(spec.tasks)} site files; '{data.site}' holds {data.task}")
    channels = 1 if data.splits["train"].images.ndim == 3 else 3
    torch.manual_seed(seed)
    model = place_model(build_model(arch, data.num_classes, channels, **dict(arch_args or {})), device, memory_format)
    server = build_rule("server", spec.server, spec.server_args)
    total = spec.untimed_rounds + rounds
    with tempfile.TemporaryDirectory() as state:
        rule = build_rule("client", spec.client, dict(spec.client_args, batch_size=batch_size))
        rule.setup(_context(data, device, state, seed))
        stats: dict = {}
        for r in range(spec.untimed_rounds):
            result = rule.train_round(model, RoundInput(r, total, stats))
            weights = state_dict_numpy(model)
            _, stats = server.aggregate([SiteUpdate(data.site or "site", weights, result.num_samples, result.stats)],
                                        ServerContext(r, total, model.classifier_param_names(), weights, stats))
        if spec.hide_labels:  # from here on the site has no label: the unlabelled branch
            rule = build_rule("client", spec.client, dict(spec.client_args, batch_size=batch_size))
            unlabelled_state = os.path.join(state, "unlabelled")
            os.makedirs(unlabelled_state)
            rule.setup(_context(hide_labels(data), device, unlabelled_state, seed))
        counter = _Counter(model)
        start = time.perf_counter()
        for r in range(spec.untimed_rounds, total):
            result = rule.train_round(model, RoundInput(r, total, stats))
        seconds = time.perf_counter() - start
        counter.handle.remove()
    return {"images_per_s": counter.images / seconds, "seconds_per_round": seconds / rounds,
            "train_images_per_round": counter.images / rounds, "stats_keys": sorted(result.stats)}


def flare_overhead(workspace: str) -> Dict[str, float]:
    """From a simulator workspace's metrics.json: per round, wall time between aggregations minus
    the slowest site's local time (validation + training), and bytes sent per site per round
    (mean over every site and round, and the largest statistics message: FedMLP sends prototypes
    only after warm-up, FedIRM matrices only from labelled sites)."""
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
            "bytes_stats_per_site_round": float(np.mean(stats_b)),
            "bytes_stats_max": float(np.max(stats_b)) if stats_b else 0.0}


def load_for_throughput(site_file: str, input_size: Optional[Sequence[int]] = None) -> Dataset:
    """A site file, resized to the job's ``input_size`` (H, W) when given, as the executor does."""
    from fedpartial.data.sitefile import load_site_file
    from fedpartial.data.transforms import resize_dataset

    data = load_site_file(site_file)
    return resize_dataset(data, input_size) if input_size else data


def _plain_targets(data: Dataset) -> torch.Tensor:
    train = data.splits["train"]
    if data.task == SEGMENTATION:
        return torch.as_tensor((np.asarray(train.labels) > 0).astype(np.float32))
    return torch.as_tensor(train.labels, dtype=torch.float32)


def _ratio_to(first: Dict[str, Dict], name: str, images_per_s: float) -> str:
    """``images_per_s`` over the first format's figure for ``name``; ``–`` when there is none."""
    return f"{images_per_s / first[name]['images_per_s']:.2f}" if name in first else "–"


def _cmd(args):
    from fedpartial.models import build_model
    from fedpartial.training.common import images_to_tensor, place_model, select_device

    torch.set_num_threads(args.threads)
    device = select_device(args.device)
    size = [int(v) for v in args.input_size.split(",")] if args.input_size else None
    data = load_for_throughput(args.site_file, size)
    methods = methods_for(data.task) if args.methods == "auto" else args.methods.split(",")
    arch = args.arch if args.arch != "auto" else ("unet" if data.task == SEGMENTATION else "small_cnn")
    arch_args = json.loads(args.arch_args) if args.arch_args else {}
    x = images_to_tensor(data.splits["train"].images)
    channels = x.shape[1]
    formats = [f.strip() for f in args.memory_format.split(",") if f.strip()]
    lines = [f"device {device}, {args.threads} thread(s), arch {arch} {arch_args or ''}, batch {args.batch_size}, "
             f"site file {args.site_file} ({data.task}, {len(data.splits['train'])} images {tuple(x.shape[2:])})",
             "", "| loop | memory format | images/s | ratio to plain loop | ratio to the first format | "
                 "images through the student per round | s per round |",
             "|---|---|---|---|---|---|---|"]
    results: Dict[str, Dict[str, object]] = {}
    for fmt in formats:  # formats in one run, so their ratios compare like with like
        torch.manual_seed(0)
        model = place_model(build_model(arch, data.num_classes, channels, **arch_args), device, fmt)
        plain = plain_loop(model, x, _plain_targets(data), args.batch_size, args.steps, device, data.task)
        first = results.get(formats[0], {})  # empty while the first format is measured
        results[fmt] = {"plain": {"images_per_s": plain}}
        lines.append(f"| plain PyTorch loop | {fmt} | {plain:.0f} | 1.00 | {_ratio_to(first, 'plain', plain)} | – | – |")
        for name in methods:
            try:
                r = rule_throughput(name, data, arch, args.batch_size, args.rounds, device, arch_args=arch_args,
                                    memory_format=fmt)
            except Exception as e:  # report and go on: one method's failure must not hide the others
                lines.append(f"| {name} | {fmt} | error: {e} | | | | |")
                continue
            results[fmt][name] = r
            lines.append(f"| {name} rule | {fmt} | {r['images_per_s']:.0f} | {r['images_per_s'] / plain:.2f} | "
                         f"{_ratio_to(first, name, r['images_per_s'])} | {r['train_images_per_round']:.0f} | "
                         f"{r['seconds_per_round']:.2f} |")
    for ws in args.workspace:
        o = flare_overhead(ws)
        lines += ["", f"{ws}: FLARE time per round beyond local work {o['flare_seconds_per_round']:.2f} s; "
                      f"sent per site per round: weights {o['bytes_weights_per_site_round'] / 1e6:.3f} MB, "
                      f"statistics {o['bytes_stats_per_site_round']:.0f} B (largest {o['bytes_stats_max']:.0f} B)"]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def add_throughput_parser(sub) -> None:
    s = sub.add_parser("throughput", help="images/s of each method's client rule vs a plain PyTorch loop")
    s.add_argument("--site-file", required=True, help="a site file made by 'split'")
    s.add_argument("--arch", default="auto", help="model arch; auto = small_cnn (classification) or unet")
    s.add_argument("--arch-args", default="", metavar="JSON", help="architecture options, e.g. a job's arch_args")
    s.add_argument("--input-size", default="", metavar="H,W",
                   help="resize the site's images first, as a job's model.input_size does (e.g. 64,64)")
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--steps", type=int, default=60, help="timed steps of the plain loop")
    s.add_argument("--rounds", type=int, default=1, help="timed rounds per method")
    s.add_argument("--methods", default="auto",
                   help=f"comma list of {sorted(RULES)}; auto = every method that runs on the site file's task")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--device", default="auto")
    s.add_argument("--memory-format", default="contiguous",
                   help="comma list of the layouts the model trains in (the executor's memory_format: contiguous, "
                        "channels_last), each for the plain loop too, all in one run")
    s.add_argument("--workspace", action="append", default=[], help="simulator workspace(s) for FLARE overhead")
    s.add_argument("--json", default="")
    s.set_defaults(func=_cmd)
