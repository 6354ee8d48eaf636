"""Benchmark: one FedAvg round from a memory-mapped site folder (streaming) against the same
data held in memory, each in its own process so each has its own peak RSS, all in one run.

    python -m fedpartial_tools.streaming --images 20000 --size 224 --out DIR [--steps N]
        [--batch-size 64] [--arch small_cnn] [--arch-args JSON] [--loader-workers 0,2] [--repeats R]

It writes a synthetic grey multi-label site folder of ``--images`` train images at ``--size`` px
chunk by chunk (:class:`fedpartial.data.sitefile.SiteFolderWriter`; never whole in memory), then
trains one round of :class:`fedpartial.algorithms.fedavg.SupervisedClient` from a ``ClientContext``
built by hand (as ``fedpartial_tools.throughput`` does):

* ``streaming``: the site folder as the executor loads it (images memory-mapped); the folder's
  files are dropped from the page cache first (unless ``--warm``), so its reads come from disk;
* ``in-memory``: the arrays read whole into memory (``np.load`` without mmap), as an ``.npz`` holds them;
* ``in-memory, float split`` (``--modes`` ``floats``): as the client was before streaming, the whole
  labelled split converted once to one float tensor.

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

SITE = "site-1"
MODES = {"streaming": "streaming (site folder, memmap)", "memory": "in-memory (arrays read whole)",
         "floats": "in-memory, float split (before)"}
_RESULT = "STREAMING_RESULT "


def synthetic_chunk(rng: np.random.Generator, n: int, size: int, num_classes: int):
    """``n`` grey random-texture images with multi-label 0/1 labels: class c brightens band c
    (content hardly matters for speed; it keeps the labels learnable).

    Args:
        rng: numpy generator.
        n: images.
        size: side in pixels.
        num_classes: C.
    """
    labels = (rng.random((n, num_classes)) < 0.3).astype(np.uint8)
    images = rng.integers(0, 160, (n, size, size), dtype=np.uint8)
    band = max(1, size // num_classes)
    for c in range(num_classes):
        images[labels[:, c] == 1, c * band:(c + 1) * band] += 80
    return images, labels


def write_synthetic_site(folder: str, images: int, size: int, num_classes: int = 5, val: int = 256,
                         chunk: int = 1000, seed: int = 0) -> bool:
    """Write the benchmark's site folder chunk by chunk; an existing folder made with the same
    settings is kept (returns False then, True when written).

    Args:
        folder: the site folder.
        images: train images.
        size: side in pixels.
        num_classes: C.
        val: val images.
        chunk: images generated and appended at a time.
        seed: data seed.
    """
    from fedpartial.data.sitefile import META_FILE, SiteFolderWriter

    settings = {"benchmark": "streaming", "images": images, "size": size, "classes": num_classes, "val": val,
                "seed": seed}
    try:
        with open(os.path.join(folder, META_FILE)) as f:
            if json.load(f).get("info") == settings:
                return False
    except (OSError, ValueError):
        pass
    rng = np.random.default_rng(seed)
    names = [f"finding_{c}" for c in range(num_classes)]
    with SiteFolderWriter(folder, "multi-label", names, SITE, {"train": images, "val": val}, (size, size),
                          info=settings) as writer:
        for split, n in (("train", images), ("val", val)):
            for start in range(0, n, chunk):
                x, y = synthetic_chunk(rng, min(chunk, n - start), size, num_classes)
                writer.append(split, x, y, np.ones_like(y))
    return True


def folder_bytes(folder: str) -> int:
    """Bytes of a site folder's own files (its cache/ left out)."""
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
               if os.path.isfile(os.path.join(folder, f)))


def drop_page_cache(folder: str) -> None:
    """Ask the kernel to drop the folder's files from the page cache (no root needed: the pages
    are clean once written), so the next reads come from disk."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


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


def _float_client(base):
    """A SupervisedClient that holds the whole labelled split as one float tensor, as it did
    before streaming (same batches, same results)."""
    from fedpartial.training.common import images_to_tensor

    class FloatSplitClient(base):
        def setup(self, ctx):
            super().setup(ctx)
            self.all_images = images_to_tensor(np.asarray(self.images)[self.rows], self.norm["mean"], self.norm["std"])

        def batch_images(self, idx):
            return self.all_images[idx]

    return FloatSplitClient


def child(args) -> Dict[str, object]:
    """One measured round in this process (``--child MODE``); returns the figures."""
    import torch

    from fedpartial.algorithms.base import ClientContext, RoundInput
    from fedpartial.algorithms.fedavg import SupervisedClient
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
    torch.manual_seed(0)
    model = place_model(build_model(args.arch, data.num_classes, 1, **json.loads(args.arch_args or "{}")),
                        torch.device("cpu"))
    cls = _float_client(SupervisedClient) if args.child == "floats" else SupervisedClient
    rule = cls(loss_mode="partial", batch_size=args.batch_size, local_epochs=1, local_iterations=args.steps or 0,
               loader_workers=args.workers)
    data_seconds = [0.0]
    read = rule.batch_images

    def timed(idx):  # time spent reading + converting batches (in the prefetch thread when on)
        t = time.perf_counter()
        out = read(idx)
        data_seconds[0] += time.perf_counter() - t
        return out

    rule.batch_images = timed
    with tempfile.TemporaryDirectory() as state:
        rule.setup(ClientContext(site=SITE, data=data, device=torch.device("cpu"), state_dir=state, seed=0))
        setup_seconds = time.perf_counter() - started
        start = time.perf_counter()
        result = rule.train_round(model, RoundInput(0, 1, {}))
        seconds = time.perf_counter() - start
    steps = int(result.metrics["train_steps"])
    return {"mode": args.child, "workers": args.workers, "steps": steps, "images": steps * args.batch_size,
            "seconds": seconds, "images_per_s": steps * args.batch_size / seconds, "setup_seconds": setup_seconds,
            "data_seconds": data_seconds[0], "loss": float(result.metrics["train_loss"]),
            "maxrss_kb": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss), "anon_peak_kb": anon.stop(),
            "threads": torch.get_num_threads()}


def _run_child(args, mode: str, workers: int) -> Dict[str, object]:
    cmd = [sys.executable, "-m", "fedpartial_tools.streaming", "--child", mode, "--site", args.site,
           "--batch-size", str(args.batch_size), "--steps", str(args.steps or 0), "--arch", args.arch,
           "--arch-args", args.arch_args or "{}", "--workers", str(workers), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark run '{mode}' failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
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


def table(results: List[Dict[str, object]], site_bytes: int, args) -> str:
    """The printed report (markdown table plus the settings it was measured with)."""
    memory = next((r for r in results if r["mode"] == "memory" and r["workers"] == 0), None)
    bound = (f"cut to --steps {args.steps} batches of {args.batch_size}" if args.steps
             else f"a full epoch of the labelled train split, batches of {args.batch_size}")
    lines = [f"site folder {args.site}: {args.images} train images {args.size}x{args.size} grey, "
             f"{site_bytes / 1e6:.1f} MB on disk; arch {args.arch} {args.arch_args or ''}; "
             f"{results[0]['threads'] if results else '?'} torch thread(s); one FedAvg round {bound}; "
             f"page cache {'kept (--warm)' if args.warm else 'dropped before each streaming run'}",
             "",
             "| run | loader_workers | site on disk | peak RSS (ru_maxrss) | peak anon RSS | setup s | steps | "
             "images/s | data s (read+convert) | ratio streaming / in-memory | images/s of each repeat |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r['images_per_s'] / memory['images_per_s']:.3f}" if memory else "–"
        lines.append(f"| {MODES[r['mode']]} | {r['workers']} | {site_bytes / 1e6:.1f} MB | {_mb(r['maxrss_kb'])} | "
                     f"{_mb(r['anon_peak_kb'])} | {r['setup_seconds']:.1f} | {r['steps']} | "
                     f"{r['images_per_s']:.1f} | {r['data_seconds']:.2f} | {ratio} | "
                     f"{', '.join(f'{v:.1f}' for v in r.get('each', [r['images_per_s']]))} |")
    lines += ["", f"{max(1, args.repeats)} repeat(s) per run, round robin; images/s, data s and setup s are medians, "
                  f"RSS the largest; data s = time spent reading + converting batches",
              "ratio = images/s over the in-memory run's (loader_workers 0); peak anon RSS = memory the kernel "
                  "cannot reclaim (ru_maxrss also counts a memory map's resident, reclaimable pages)"]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> str:
    """Run the benchmark; prints and returns the table.

    Args:
        argv: command-line arguments (see ``--help``).
    """
    p = argparse.ArgumentParser(prog="python -m fedpartial_tools.streaming", description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=20000, help="train images of the synthetic site")
    p.add_argument("--size", type=int, default=224, help="image side in pixels")
    p.add_argument("--out", default="", help="folder for the site folder (default: a temporary folder)")
    p.add_argument("--steps", type=int, default=0, help="cut the round to this many batches (0 = a full epoch)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--arch", default="small_cnn")
    p.add_argument("--arch-args", default="", metavar="JSON", help='architecture options, e.g. {"stem_stride": 2}')
    p.add_argument("--classes", type=int, default=5)
    p.add_argument("--chunk", type=int, default=1000, help="images generated and written at a time")
    p.add_argument("--modes", default="streaming,memory", help=f"comma list of {list(MODES)}")
    p.add_argument("--loader-workers", default="0",
                   help="comma list of SupervisedClient loader_workers values for the streaming run")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0 = torch's default)")
    p.add_argument("--warm", action="store_true", help="keep the site folder in the page cache for streaming runs")
    p.add_argument("--repeats", type=int, default=1, help="runs of each configuration, round robin (median shown)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds allowed per run")
    p.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
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
    out = args.out or tempfile.mkdtemp(prefix="fedpartial-streaming-")
    args.site = os.path.join(out, SITE)
    t = time.perf_counter()
    wrote = write_synthetic_site(args.site, args.images, args.size, args.classes, chunk=args.chunk)
    print(f"{'wrote' if wrote else 'reusing'} {args.site} ({time.perf_counter() - t:.1f} s)", flush=True)
    runs = [(mode, workers) for mode in modes
            for workers in ([int(w) for w in args.loader_workers.split(",")] if mode == "streaming" else [0])]
    measured: Dict[tuple, List[Dict[str, object]]] = {run: [] for run in runs}
    for repeat in range(max(1, args.repeats)):  # round robin: a busy machine slows every run alike
        for mode, workers in runs:
            if mode == "streaming" and not args.warm:
                drop_page_cache(args.site)
            r = _run_child(args, mode, workers)
            measured[(mode, workers)].append(r)
            print(f"  [{repeat + 1}] {mode} (loader_workers {workers}): {r['images_per_s']:.1f} images/s", flush=True)
    results = [_summary(measured[run]) for run in runs]
    report = table(results, folder_bytes(args.site), args)
    print(report)
    return report


if __name__ == "__main__":
    main()
