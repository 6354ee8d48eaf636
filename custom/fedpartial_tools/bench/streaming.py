"""Benchmark: one round of a method's client from a memory-mapped site folder (streaming) against
the same data held in memory, each in its own process so each has its own peak RSS, all in one run.

    python -m fedpartial_tools.bench.streaming --images 20000 --size 224 --out DIR [--steps N]
        [--clients fedavg,fedlsm,fedmlp,fedirm,fedia] [--batch-size 64] [--arch small_cnn]
        [--arch-args JSON] [--seg-arch-args JSON] [--channels 1] [--loader-workers 0,2] [--repeats R]

It writes a synthetic grey (or ``--channels 3``) site folder of ``--images`` train images at
``--size`` px chunk by chunk (:class:`fedpartial.data.sitefile.SiteFolderWriter`; never whole in
memory): a multi-label one for the classification clients and, when ``fedia`` or
``segmentation`` is asked for, a segmentation one with disc-shaped lesions. Then it trains one
round of each client in ``--clients`` from a ``ClientContext`` built by hand (as
``fedpartial_tools.bench.throughput`` does):

* ``fedavg``: :class:`fedpartial.algorithms.fedavg.SupervisedClient` (``partial`` loss), all labels annotated;
* ``fedlsm``, ``fedmlp``, ``fedirm`` (labelled site): the site's last two classes unannotated on
  every other image; FedMLP in stage 2 with prototypes from the server (tagging pass, prototypes
  pass); FedLSM's entropy pass; FedIRM's relation statistics;
* ``fedia``: the round after warm-up with a correction pending, so it runs the prediction pass
  (completeness, correction), training and the IoU pass; ``segmentation``: the FedAvg
  segmentation baseline (training and the IoU pass).

Modes:

* ``streaming``: the site folder as the executor loads it (images memory-mapped); the folder's
  files are dropped from the page cache first (unless ``--warm``), so its reads come from disk;
* ``memory``: the arrays read whole into memory (``np.load`` without mmap), as an ``.npz`` holds them;
* ``floats``: in memory, and the client's whole train split converted once to one float tensor
  (how the clients held it before they read batch by batch).

``--steps N`` cuts each round to N training batches (FedAvg and FedLSM through
``local_iterations``, the others by stopping their epoch's batch generator); whole-site passes
always cover the whole split. images/s = training images of the round / the round's seconds
(whole-site passes included).

Peak RSS is ``ru_maxrss`` at the end of each process; it counts the resident pages of a memory
map, which the kernel can drop at any time, so the anonymous (not reclaimable) peak is shown too.
Tooling only: never shipped in a job's app/custom.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from fedpartial_tools.bench.synthetic_site import SITE, drop_page_cache, folder_bytes, write_synthetic_site
MODES = {"streaming": "streaming (site folder, memmap)", "memory": "in-memory (arrays read whole)",
         "floats": "in-memory, float split (before)"}
CLIENTS = ("fedavg", "fedlsm", "fedmlp", "fedirm", "fedia", "segmentation")
SEGMENTATION_CLIENTS = ("fedia", "segmentation")
_RESULT = "STREAMING_RESULT "


class _AnonPeak:
    """Samples RssAnon (/proc/self/status) in a thread: the peak of memory the kernel cannot
    drop, which ru_maxrss mixes with a memory map's resident (reclaimable) pages."""

    def __init__(self, every: float = 0.05):
        self.peak_kb, self._every, self._stop = 0, every, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def now_kb() -> int:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    def _run(self):
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, self.now_kb())
            time.sleep(self._every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak_kb, self.now_kb())


def _in_memory(data):
    """The site's data with every array read whole into memory (as from an ``.npz``)."""
    from fedpartial.data.types import Dataset, Split

    splits = {}
    for name, s in data.splits.items():
        images = np.load(os.path.join(data.source, f"{name}_images.npy"))  # read(), not mapped
        splits[name] = Split(images, np.array(s.labels), s.label_mask, s.ids, s.groups)
    return Dataset(data.task, list(data.class_names), splits, data.source, data.site, dict(data.info))


def _partial_labels(data):
    """The site with its last two classes unannotated on every other train image (in memory:
    labels are small), so the partial-label methods have missing entries to work on."""
    from fedpartial.data.types import Split

    train = data.splits["train"]
    mask = np.array(train.label_mask, dtype=np.uint8)
    mask[1::2, -2:] = 0
    labels = np.array(train.labels) * mask
    data.splits["train"] = Split(train.images, labels, mask, train.ids, train.groups)
    return data


def _float_split(source):
    """``source`` (an :class:`fedpartial.training.common.ImageSource`) with its whole split
    converted once to one float tensor, as the clients held it before reading batch by batch
    (same batches, same results)."""
    from fedpartial.training.common import ImageSource

    class FloatSplit(ImageSource):
        def __init__(self):
            super().__init__(source.images, {"mean": source.mean, "std": source.std}, source.rows)
            self.floats = source.batch(np.arange(len(source)))

        def batch(self, idx):
            return self.floats[idx]

    return FloatSplit()


def _cap_epochs(module, steps: int) -> None:
    """Stop ``module``'s per-epoch batch generators after ``steps`` batches (``--steps`` for the
    clients that count epochs, not iterations). Benchmark only: the first ``steps`` batches are
    those of the uncut round."""
    for name in ("batch_indices", "lesion_batches"):
        full = getattr(module, name, None)
        if full is not None:
            def capped(*args, _full=full, **kwargs):
                for i, idx in enumerate(_full(*args, **kwargs)):
                    if i >= steps:
                        return
                    yield idx
            setattr(module, name, capped)


def _make_client(name: str, args, model):
    """The client rule of ``name`` with the benchmark's settings, and its round's input."""
    from fedpartial.algorithms.base import RoundInput

    steps, batch = int(args.steps or 0), int(args.batch_size)
    if name == "fedavg":
        from fedpartial.algorithms.fedavg import SupervisedClient

        return (SupervisedClient(loss_mode="partial", batch_size=batch, local_epochs=1, local_iterations=steps,
                                 loader_workers=args.workers), RoundInput(0, 1, {}))
    if name == "fedlsm":
        from fedpartial.algorithms.fedlsm import FedLSMClient

        return (FedLSMClient(batch_size=batch, local_iterations=steps or None, local_epochs=None if steps else 1.0),
                RoundInput(0, 1, {}))
    if name == "fedmlp":
        from fedpartial.algorithms import fedmlp

        if steps:
            _cap_epochs(fedmlp, steps)
        dim, c = model.fc.in_features, model.num_classes
        rng = np.random.default_rng(0)
        stats = {"prototypes_neg": rng.normal(size=(c, dim)).astype(np.float32),
                 "prototypes_pos": rng.normal(size=(c, dim)).astype(np.float32), "prototype_valid": np.ones(c),
                 "tau0": np.full(c, 0.01), "tau1": np.full(c, 0.01)}
        return fedmlp.FedMLPClient(batch_size=batch, warmup_rounds=1), RoundInput(1, 2, stats)
    if name == "fedirm":
        from fedpartial.algorithms import fedirm

        if steps:
            _cap_epochs(fedirm, steps)
        return fedirm.FedIRMClient(batch_size=batch), RoundInput(0, 1, {})
    from fedpartial.algorithms import segmentation

    if steps:
        _cap_epochs(segmentation, steps)
    if name == "segmentation":
        return segmentation.SegmentationSupervisedClient(batch_size=batch), RoundInput(0, 1, {})
    from fedpartial.algorithms.fedia import FedIAClient

    return FedIAClient(batch_size=batch, warmup_rounds=2, min_predicted_ratio=0.0), RoundInput(2, 3, {})


def child(args) -> Dict[str, object]:
    """One measured round in this process (``--child MODE``); returns the figures."""
    import torch

    from fedpartial.algorithms.base import ClientContext
    from fedpartial.data.sitefile import load_site_file
    from fedpartial.models import build_model
    from fedpartial.training.common import place_model

    anon = _AnonPeak()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    data = load_site_file(args.site, expected_site=SITE)
    if args.child != "streaming":
        data = _in_memory(data)
    segmentation = args.client in SEGMENTATION_CLIENTS
    if not segmentation and args.client != "fedavg":
        data = _partial_labels(data)
    torch.manual_seed(0)
    arch, arch_args = ("unet", args.seg_arch_args) if segmentation else (args.arch, args.arch_args)
    in_channels = 1 if data.splits["train"].images.ndim == 3 else data.splits["train"].images.shape[3]
    model = place_model(build_model(arch, 1 if segmentation else data.num_classes, in_channels,
                                    **json.loads(arch_args or "{}")), torch.device("cpu"))
    rule, round_input = _make_client(args.client, args, model)
    data_seconds = [0.0]
    with tempfile.TemporaryDirectory() as state:
        rule.setup(ClientContext(site=SITE, data=data, device=torch.device("cpu"), state_dir=state, seed=0))
        if args.child == "floats":
            rule.images = _float_split(rule.images)
        if args.client == "fedia":
            rule.state["correction_pending"] = True  # the round runs every FedIA pass
        read = rule.images.batch

        def timed(idx):  # time spent reading + converting batches (in the prefetch thread when on)
            t = time.perf_counter()
            out = read(idx)
            data_seconds[0] += time.perf_counter() - t
            return out

        rule.images.batch = timed
        setup_seconds = time.perf_counter() - started
        start = time.perf_counter()
        result = rule.train_round(model, round_input)
        seconds = time.perf_counter() - start
    steps = int(result.metrics["train_steps"])
    return {"client": args.client, "mode": args.child, "workers": args.workers, "steps": steps,
            "images": steps * args.batch_size, "seconds": seconds, "images_per_s": steps * args.batch_size / seconds,
            "setup_seconds": setup_seconds, "data_seconds": data_seconds[0],
            "loss": float(result.metrics.get("train_loss", result.metrics.get("loss", float("nan")))),
            "maxrss_kb": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss), "anon_peak_kb": anon.stop(),
            "threads": torch.get_num_threads()}


def _run_child(args, client: str, mode: str, workers: int) -> Dict[str, object]:
    site = args.seg_site if client in SEGMENTATION_CLIENTS else args.site
    cmd = [sys.executable, "-m", "fedpartial_tools.bench.streaming", "--child", mode, "--client", client,
           "--site", site,
           "--batch-size", str(args.batch_size), "--steps", str(args.steps or 0), "--arch", args.arch,
           "--arch-args", args.arch_args or "{}", "--seg-arch-args", args.seg_arch_args, "--workers", str(workers),
           "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark run '{client}' '{mode}' failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(_RESULT):])


def _summary(runs: List[Dict[str, object]]) -> Dict[str, object]:
    """Repeats of one configuration: median speed and data time, largest memory peaks."""
    out = dict(runs[0])
    for key in ("images_per_s", "data_seconds", "setup_seconds", "seconds"):
        out[key] = float(np.median([r[key] for r in runs]))
    for key in ("maxrss_kb", "anon_peak_kb"):
        out[key] = max(r[key] for r in runs)
    out["each"] = [r["images_per_s"] for r in runs]
    return out


def _mb(kb: float) -> str:
    return f"{kb / 1024:.0f} MB"


def table(results: List[Dict[str, object]], site_bytes: Dict[str, int], args) -> str:
    """The printed report (markdown table plus the settings it was measured with).

    Args:
        results: one summary per (client, mode, loader_workers).
        site_bytes: bytes on disk of the ``classification`` and ``segmentation`` site folders written.
        args: the parsed command line.
    """
    def memory_run(client):
        return next((r for r in results if r["client"] == client and r["mode"] == "memory" and r["workers"] == 0),
                    None)

    def streaming_run(client):
        return next((r for r in results if r["client"] == client and r["mode"] == "streaming" and r["workers"] == 0),
                    None)

    # a segmentation method is held against FedAvg on the same masks and UNet ("segmentation")
    baseline = {"classification": streaming_run("fedavg"), "segmentation": streaming_run("segmentation")}
    bound = (f"cut to --steps {args.steps} batches of {args.batch_size}" if args.steps
             else f"a full epoch of the train split, batches of {args.batch_size}")
    sites = ", ".join(f"{kind} {b / 1e6:.1f} MB on disk" for kind, b in site_bytes.items())
    lines = [f"site folder(s) under {os.path.dirname(args.site)}: {args.images} train images {args.size}x{args.size} "
             f"{'grey' if args.channels == 1 else 'RGB'} ({sites}); arch {args.arch} {args.arch_args or ''}"
             f"{f'; unet {args.seg_arch_args}' if any(r['client'] in SEGMENTATION_CLIENTS for r in results) else ''}; "
             f"{results[0]['threads'] if results else '?'} torch thread(s); one round of each client {bound}; "
             f"page cache {'kept (--warm)' if args.warm else 'dropped before each streaming run'}",
             "",
             "| run | loader_workers | client | site on disk | peak RSS (ru_maxrss) | peak anon RSS | "
             "anon RSS / its FedAvg streaming | setup s | steps | images/s | data s (read+convert) | "
             "ratio streaming / in-memory | images/s of each repeat |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        memory = memory_run(r["client"])
        ratio = f"{r['images_per_s'] / memory['images_per_s']:.3f}" if memory else "–"
        base = baseline["segmentation" if r["client"] in SEGMENTATION_CLIENTS else "classification"]
        to_fedavg = f"{r['anon_peak_kb'] / base['anon_peak_kb']:.2f}" if base else "–"
        on_disk = site_bytes["segmentation" if r["client"] in SEGMENTATION_CLIENTS else "classification"]
        lines.append(f"| {MODES[r['mode']]} | {r['workers']} | {r['client']} | {on_disk / 1e6:.1f} MB | "
                     f"{_mb(r['maxrss_kb'])} | {_mb(r['anon_peak_kb'])} | {to_fedavg} | {r['setup_seconds']:.1f} | "
                     f"{r['steps']} | {r['images_per_s']:.1f} | {r['data_seconds']:.2f} | {ratio} | "
                     f"{', '.join(f'{v:.1f}' for v in r.get('each', [r['images_per_s']]))} |")
    lines += ["", f"{max(1, args.repeats)} repeat(s) per run, round robin; images/s, data s and setup s are medians, "
                  f"RSS the largest; data s = time spent reading + converting batches (whole-site passes included)",
              "its FedAvg = fedavg for the classification clients, segmentation (FedAvg on the same masks and "
                  "UNet) for fedia",
              "ratio = images/s over the same client's in-memory run (loader_workers 0); images/s = training "
                  "images / the round's seconds, whole-site passes included; peak anon RSS = memory the kernel "
                  "cannot reclaim (ru_maxrss also counts a memory map's resident, reclaimable pages)"]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> str:
    """Run the benchmark; prints and returns the table.

    Args:
        argv: command-line arguments (see ``--help``).
    """
    p = argparse.ArgumentParser(prog="python -m fedpartial_tools.bench.streaming", description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=20000, help="train images of the synthetic site")
    p.add_argument("--size", type=int, default=224, help="image side in pixels")
    p.add_argument("--out", default="", help="folder for the site folder (default: a temporary folder)")
    p.add_argument("--steps", type=int, default=0, help="cut the round to this many batches (0 = a full epoch)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--arch", default="small_cnn")
    p.add_argument("--arch-args", default="", metavar="JSON", help='architecture options, e.g. {"stem_stride": 2}')
    p.add_argument("--seg-arch-args", default='{"channels": [8, 16, 32], "strides": [2, 2]}', metavar="JSON",
                   help="unet options of the segmentation clients")
    p.add_argument("--clients", default="fedavg", help=f"comma list of {list(CLIENTS)}")
    p.add_argument("--channels", type=int, default=1, choices=(1, 3), help="1 = grey, 3 = RGB images")
    p.add_argument("--classes", type=int, default=5)
    p.add_argument("--chunk", type=int, default=1000, help="images generated and written at a time")
    p.add_argument("--modes", default="streaming,memory", help=f"comma list of {list(MODES)}")
    p.add_argument("--loader-workers", default="0",
                   help="comma list of FedAvg SupervisedClient loader_workers values for its streaming run")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0 = torch's default)")
    p.add_argument("--warm", action="store_true", help="keep the site folder in the page cache for streaming runs")
    p.add_argument("--repeats", type=int, default=1, help="runs of each configuration, round robin (median shown)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds allowed per run")
    p.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    p.add_argument("--client", choices=CLIENTS, default="fedavg", help=argparse.SUPPRESS)
    p.add_argument("--site", default="", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        line = _RESULT + json.dumps(child(args))
        print(line, flush=True)
        return line
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode '{unknown[0]}'; choose from {list(MODES)}")
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    unknown = [c for c in clients if c not in CLIENTS]
    if unknown or not clients:
        p.error(f"unknown client '{unknown[0] if unknown else ''}'; choose from {list(CLIENTS)}")
    out = args.out or tempfile.mkdtemp(prefix="fedpartial-streaming-")
    args.site = os.path.join(out, SITE)
    args.seg_site = os.path.join(out, "segmentation", SITE)
    site_bytes = {}
    for kind, folder, wanted in (("classification", args.site, any(c not in SEGMENTATION_CLIENTS for c in clients)),
                                 ("segmentation", args.seg_site, any(c in SEGMENTATION_CLIENTS for c in clients))):
        if wanted:
            t = time.perf_counter()
            wrote = write_synthetic_site(folder, args.images, args.size, args.classes, chunk=args.chunk,
                                         channels=args.channels, segmentation=kind == "segmentation")
            print(f"{'wrote' if wrote else 'reusing'} {folder} ({time.perf_counter() - t:.1f} s)", flush=True)
            site_bytes[kind] = folder_bytes(folder)
    worker_values = [int(w) for w in args.loader_workers.split(",")]
    runs = [(client, mode, workers) for client in clients for mode in modes
            for workers in (worker_values if mode == "streaming" and client == "fedavg" else [0])]
    measured: Dict[tuple, List[Dict[str, object]]] = {run: [] for run in runs}
    for repeat in range(max(1, args.repeats)):  # round robin: a busy machine slows every run alike
        for client, mode, workers in runs:
            if mode == "streaming" and not args.warm:
                drop_page_cache(args.seg_site if client in SEGMENTATION_CLIENTS else args.site)
            r = _run_child(args, client, mode, workers)
            measured[(client, mode, workers)].append(r)
            print(f"  [{repeat + 1}] {client} {mode} (loader_workers {workers}): {r['images_per_s']:.1f} images/s, "
                  f"peak anon RSS {_mb(r['anon_peak_kb'])}", flush=True)
    results = [_summary(measured[run]) for run in runs]
    report = table(results, site_bytes, args)
    print(report)
    return report


if __name__ == "__main__":
    main()
