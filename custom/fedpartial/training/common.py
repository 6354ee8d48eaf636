"""Shared training mechanics: device, seeds, image tensors and the lazy image source, batches,
EMA, masked losses, prediction. Every method reuses these; none keeps its own copy."""
from __future__ import annotations

import copy
import math
import random
import threading
import zlib
from typing import Callable, Dict, Iterator, Optional

import numpy as np
import torch


def select_device(name: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else CPU. Several sites may share one GPU.

    Args:
        name: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    """
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' requested in the job config but no CUDA device is available")
    return device


MEMORY_FORMATS = ("contiguous", "channels_last")


def check_memory_format(memory_format: str) -> str:
    """Return ``memory_format`` if it is one of :data:`MEMORY_FORMATS`, else raise naming it.

    Args:
        memory_format: a job's ``memory_format`` setting.
    """
    if memory_format not in MEMORY_FORMATS:
        raise ValueError(f"memory_format '{memory_format}' is not one of {list(MEMORY_FORMATS)}")
    return memory_format


def place_model(model: torch.nn.Module, device: torch.device, memory_format: str = "contiguous") -> torch.nn.Module:
    """Move ``model`` to ``device`` in the given memory format (in place; returns it).

    With the default layout PyTorch's CPU kernels run markedly slower on interpolated
    (affine-augmented) images than on raw 8-bit ones; ``channels_last`` narrows that gap and is
    faster overall on CPU (docs/RESULTS.md, "Throughput and FLARE overhead"). It changes
    floating-point rounding, so a seeded run differs from a ``contiguous`` one; the weights sent
    and saved stay plain C-ordered arrays either way.

    Args:
        model: the network.
        device: where it trains.
        memory_format: ``contiguous`` (PyTorch's default NCHW) or ``channels_last``.
    """
    check_memory_format(memory_format)
    model.to(device)
    if memory_format == "channels_last":
        model.to(memory_format=torch.channels_last)
    return model


def round_seed(seed: int, site: str, round_index: int) -> int:
    """The seed of one site's round: the run's seed, the site's name and the round mixed by
    ``np.random.SeedSequence``, so equal-sized sites never draw the same shuffles and augmentations
    in a round, and a rerun with the same seed repeats every site's round exactly.

    Args:
        seed: the run's base seed (the job's ``seed``).
        site: the site's name.
        round_index: the round (0-based).
    """
    site_code = zlib.crc32(str(site).encode("utf-8"))
    return int(np.random.SeedSequence([int(seed) % (2**32), site_code, int(round_index)]).generate_state(1)[0] >> 1)


#: ``lr_schedule`` choices: the lr of every round, or a cosine decay over the job's rounds
LR_SCHEDULES = ("constant", "cosine")


def check_lr_schedule(schedule: str, final_fraction: float) -> None:
    """Raise ValueError naming the setting when ``schedule`` / ``final_fraction`` are not a valid
    :func:`round_lr` schedule.

    Args:
        schedule: the ``lr_schedule`` setting.
        final_fraction: the ``final_lr_fraction`` setting, in (0, 1].
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule '{schedule}' unknown; choose one of {LR_SCHEDULES}")
    if not 0.0 < float(final_fraction) <= 1.0:
        raise ValueError(f"final_lr_fraction must be in (0, 1], got {final_fraction}")


def round_lr(lr: float, round_index: int, num_rounds: int, schedule: str = "constant",
             final_fraction: float = 0.1) -> float:
    """The local learning rate of one round.

    ``cosine`` falls from ``lr`` at the first round to ``lr * final_fraction`` at the last, so the
    global model's last rounds take small steps and the kept model depends less on which round
    it is (the sites' updates stop swinging the average).

    Args:
        lr: the base learning rate.
        round_index: the round (0-based).
        num_rounds: the job's rounds.
        schedule: one of :data:`LR_SCHEDULES`.
        final_fraction: the last round's lr as a share of ``lr`` (``cosine`` only).
    """
    check_lr_schedule(schedule, final_fraction)
    if schedule == "constant" or num_rounds <= 1:
        return float(lr)
    progress = min(max(round_index, 0), num_rounds - 1) / (num_rounds - 1)
    final = float(lr) * float(final_fraction)
    return final + (float(lr) - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch so a round is repeatable.

    Args:
        seed: integer seed.
    """
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def images_to_tensor(images: np.ndarray, mean: float = 0.5, std: float = 0.5) -> torch.Tensor:
    """uint8 ``(N,H,W)`` / ``(N,H,W,3)`` -> float ``(N,C,H,W)`` scaled to [0,1] then normalised.

    Args:
        images: uint8 image array.
        mean: subtracted after scaling to [0, 1].
        std: divided by after subtracting the mean.
    """
    x = torch.from_numpy(np.ascontiguousarray(images))
    x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)
    # in place: one float buffer per batch (the same values as (x / 255 - mean) / std)
    return x.float().div_(255.0).sub_(mean).div_(std)


def take_rows(images: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``images[rows]`` in the order of ``rows``, read in ascending row order.

    A memory-mapped split (a site folder) reads fastest front to back, so the rows are fetched
    sorted and put back in the asked order in memory: a batch holds the same samples in the same
    order whether the split is memory-mapped or in memory (seeded runs are identical).

    Args:
        images: uint8 ``(N, H, W)`` / ``(N, H, W, 3)`` array or ``np.memmap``.
        rows: row indices (any order, no repeats needed).
    """
    rows = np.asarray(rows)
    if not isinstance(images, np.memmap):
        return images[rows]
    order = np.argsort(rows, kind="stable")
    block = images[rows[order]]
    out = np.empty_like(block)
    out[order] = block
    return out


class _Prefetcher:
    """Iterates ``items`` in a background thread, ``depth`` items ahead (see :func:`prefetch`)."""

    _DONE = object()

    def __init__(self, items: Iterator, depth: int):
        import queue
        import threading

        self._queue: "queue.Queue" = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(items,), daemon=True, name="fedpartial-prefetch")
        self._thread.start()

    def _run(self, items: Iterator) -> None:
        import queue

        try:
            for item in items:
                while not self._stop.is_set():
                    try:
                        self._queue.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put((self._DONE, None))
        except BaseException as e:  # handed to the consumer, raised there
            self._queue.put((self._DONE, e))

    def __iter__(self):
        return self

    def __next__(self):
        item, error = self._queue.get()
        if item is self._DONE:
            self._stop.set()
            if error is not None:
                raise error
            raise StopIteration
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def prefetch(items: Iterator, depth: int = 0) -> Iterator:
    """``items`` prepared ``depth`` ahead by a background thread (numpy copies and torch
    conversions release the GIL, so reading the next batch overlaps the current step); ``depth``
    0 returns ``items`` as they are. Either way the consumer sees the same items in the same
    order; call ``close()`` on the result when stopping early.

    Args:
        items: an iterator (e.g. a generator of batches).
        depth: items prepared ahead; 0 = no thread.
    """
    if depth <= 0:
        return items
    return _Prefetcher(iter(items), int(depth))


class DrawCounter:
    """How many distinct images a round's training drew: :func:`batch_indices`,
    :func:`iteration_batches` and the methods' own samplers record each batch they yield (per
    array length, so the indices of the train split are counted together), and the executor reads
    the count after ``train_round``. A metric or statistic over fewer images than a site's minimum
    count must not leave it, whatever sample count a rule reports (one iteration of batch size 1
    over 124 images trains on one image). Batches may be drawn in a prefetch thread: a lock, not a
    thread-local."""

    def __init__(self):
        self._lock = threading.Lock()
        self._rows: Optional[Dict[int, set]] = None

    def start(self) -> None:
        with self._lock:
            self._rows = {}

    def record(self, n: int, idx: np.ndarray) -> None:
        with self._lock:
            if self._rows is not None:
                self._rows.setdefault(int(n), set()).update(np.asarray(idx).ravel().tolist())

    def stop(self) -> int:
        """The most distinct rows drawn from one array since :meth:`start`; counting stops."""
        with self._lock:
            rows, self._rows = self._rows or {}, None
        return max((len(v) for v in rows.values()), default=0)


#: the process's counter (one training at a time per site process)
DRAWS = DrawCounter()


class StepCounter:
    """How many optimizer steps a round's training made, counted by torch's global step hook
    rather than by what a rule reports. One Adam step moves every parameter by +-lr (the sign of
    its gradient), so the weights of a one-step round hold the batch's gradient signs, which two
    sites' weighted average does not hide; a site's policy withholds such a result."""

    def __init__(self):
        self._lock = threading.Lock()
        self._steps: Optional[int] = None
        self._handle = None

    def _count(self, optimizer, args, kwargs) -> None:
        with self._lock:
            if self._steps is not None:
                self._steps += 1

    def start(self) -> None:
        with self._lock:
            self._steps = 0
            if self._handle is None:
                from torch.optim.optimizer import register_optimizer_step_post_hook

                self._handle = register_optimizer_step_post_hook(self._count)

    def stop(self) -> int:
        """The steps since :meth:`start`; counting stops."""
        with self._lock:
            steps, self._steps = self._steps or 0, None
        return steps


#: the process's step counter (one training at a time per site process)
STEPS = StepCounter()


def batch_indices(n: int, batch_size: int, rng: np.random.Generator, shuffle: bool = True,
                  drop_last: bool = False) -> Iterator[np.ndarray]:
    """Yield index arrays covering ``range(n)`` once (one epoch).

    Args:
        n: number of samples.
        batch_size: samples per batch.
        rng: numpy generator (seeded per round for repeatability).
        shuffle: permute before batching.
        drop_last: skip a final batch smaller than ``batch_size`` (kept when it is the only one).
    """
    order = rng.permutation(n) if shuffle else np.arange(n)
    for start in range(0, n, batch_size):
        idx = order[start:start + batch_size]
        if drop_last and len(idx) < batch_size and start > 0:
            break
        DRAWS.record(n, idx)
        yield idx


def epoch_steps(n: int, batch_size: int, drop_last: bool = True) -> int:
    """How many batches :func:`batch_indices` yields for one epoch of ``n`` samples (0 when ``n`` is 0).

    Args:
        n: number of samples.
        batch_size: samples per batch.
        drop_last: as in :func:`batch_indices` (a lone smaller batch is kept).
    """
    n, batch_size = int(n), int(batch_size)
    if n <= 0:
        return 0
    if drop_last and n >= batch_size:
        return n // batch_size
    return -(-n // batch_size)


def iteration_batches(n: int, batch_size: int, iterations: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Yield exactly ``iterations`` shuffled batches, re-shuffling at each epoch boundary
    (used by methods that count local iterations rather than epochs)."""
    done = 0
    while done < iterations:
        for idx in batch_indices(n, batch_size, rng, shuffle=True, drop_last=n > batch_size):
            yield idx
            done += 1
            if done >= iterations:
                return


class EMATeacher:
    """Exponential-moving-average copy of a student model (parameters averaged, buffers copied).

    Args:
        student: the model being trained.
        decay: EMA decay (0.999 in FedLSM, 0.99 in FedIRM).
    """

    def __init__(self, student: torch.nn.Module, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.model = copy.deepcopy(student)
        for p in self.model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, student: torch.nn.Module) -> None:
        for t, s in zip(self.model.parameters(), student.parameters()):
            t.mul_(self.decay).add_(s.detach(), alpha=1.0 - self.decay)
        for t, s in zip(self.model.buffers(), student.buffers()):
            t.copy_(s)


class ImageSource:
    """A split's uint8 images (in memory, or memory-mapped from a site folder) handed out as
    normalised float batches, so no client ever holds a whole split as floats (at 224 px RGB a
    float image is 600 kB). Each batch is the slice of what ``images_to_tensor`` of the whole
    split (or of ``images[rows]``) would give: same values, same order, so seeded runs are equal.

    It can stand where a float ``(N, C, H, W)`` tensor was indexed: ``source[idx]``, ``len`` and
    ``shape`` behave alike, and :func:`predict` accepts it.

    Args:
        images: uint8 ``(N, H, W)`` / ``(N, H, W, 3)`` array or ``np.memmap``.
        normalisation: ``{"mean": float, "std": float}`` (None = 0.5 / 0.5, as images_to_tensor).
        rows: optional row indices of ``images`` that make up the source (e.g. the labelled
            samples); position ``i`` of the source is ``images[rows[i]]``.
    """

    def __init__(self, images: np.ndarray, normalisation: Optional[dict] = None, rows: Optional[np.ndarray] = None):
        norm = normalisation or {"mean": 0.5, "std": 0.5}
        self.images, self.mean, self.std = images, norm["mean"], norm["std"]
        self.rows = None if rows is None else np.asarray(rows)

    def __len__(self) -> int:
        return int(self.images.shape[0] if self.rows is None else len(self.rows))

    @property
    def shape(self) -> tuple:
        """``(N, C, H, W)``: the shape of the float tensor the whole source would be."""
        s = self.images.shape
        return (len(self), 1, s[1], s[2]) if len(s) == 3 else (len(self), s[3], s[1], s[2])

    def batch(self, idx) -> torch.Tensor:
        """Normalised float ``(B, C, H, W)`` images at positions ``idx``, in that order.

        Args:
            idx: a slice, or integer positions (numpy array, list or torch tensor; repeats allowed).
        """
        if isinstance(idx, slice):
            if self.rows is None:
                # np.array: one block copied out of a (read-only) memory map, front to back
                return images_to_tensor(np.array(self.images[idx]), self.mean, self.std)
            idx = np.arange(len(self))[idx]
        positions = idx.cpu().numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)
        rows = positions if self.rows is None else self.rows[positions]
        return images_to_tensor(take_rows(self.images, rows), self.mean, self.std)

    def __getitem__(self, idx) -> torch.Tensor:
        return self.batch(idx)

    def predict(self, model: torch.nn.Module, device: torch.device, batch_size: int = 256,
                view: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, with_features: bool = False):
        """:func:`predict` over the whole source, one batch of floats at a time."""
        return predict(model, self, device, batch_size, view, with_features)

    def predict_batches(self, model: torch.nn.Module, device: torch.device, batch_size: int = 256,
                        view: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, with_features: bool = False):
        """:func:`predict_batches` over the whole source (for passes that reduce as they go)."""
        return predict_batches(model, self, device, batch_size, view, with_features)


@torch.no_grad()
def predict_batches(model: torch.nn.Module, images, device: torch.device, batch_size: int = 256,
                    view: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, with_features: bool = False):
    """Run ``model`` in eval mode over ``images`` in order, ``batch_size`` at a time, yielding
    ``(start, logits)`` (or ``(start, logits, features)``) per batch as CPU tensors; the model's
    train / eval mode is restored afterwards.

    Args:
        model: the network.
        images: ``(N, C, H, W)`` float CPU tensor or an :class:`ImageSource`.
        device: where the model runs.
        batch_size: images per forward pass.
        view: optional batch view applied before the forward pass.
        with_features: also yield the features.
    """
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(images), batch_size):
            x = images[start:start + batch_size]
            if view is not None:
                x = view(x)
            f, z = model(x.to(device, non_blocking=True))
            yield (start, z.float().cpu(), f.float().cpu()) if with_features else (start, z.float().cpu())
    finally:
        model.train(was_training)


def predict(model: torch.nn.Module, images, device: torch.device, batch_size: int = 256,
            view: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, with_features: bool = False):
    """Run ``model`` in eval mode over ``images`` (``(N,C,H,W)`` CPU tensor or an
    :class:`ImageSource`); returns logits (and features) as CPU tensors.

    Args:
        model: the network.
        images: float tensor or :class:`ImageSource`.
        device: where the model runs.
        batch_size: images per forward pass.
        view: optional batch view applied before the forward pass.
        with_features: also return the features.
    """
    # The outputs are written into tensors of the whole split's size, allocated at the first
    # batch: small per-batch tensors kept in a list pin glibc's heap between the freed image and
    # activation buffers, and a 20,000-image pass then kept about 1 GB it no longer used.
    n = len(images)
    outputs: Optional[list] = None
    for out in predict_batches(model, images, device, batch_size, view, with_features):
        start, batch = out[0], out[1:]
        if outputs is None:
            outputs = [torch.empty((n,) + tuple(t.shape[1:]), dtype=t.dtype) for t in batch]
        for whole, part in zip(outputs, batch):
            whole[start:start + part.shape[0]] = part
    if outputs is None:
        outputs = [torch.empty(0)] * (2 if with_features else 1)
    return (outputs[0], outputs[1]) if with_features else outputs[0]


def predict_uint8(model: torch.nn.Module, images: np.ndarray, normalisation: Optional[dict], device: torch.device,
                  batch_size: int = 256, view: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                  with_features: bool = False):
    """:func:`predict` over a uint8 image array (in memory or memory-mapped), converting one
    batch at a time to floats (:class:`ImageSource`). Same outputs as
    ``predict(model, images_to_tensor(images, mean, std), device, batch_size, view, with_features)``.

    Args:
        model: the network (put in eval mode for the call).
        images: uint8 ``(N, H, W)`` / ``(N, H, W, 3)``.
        normalisation: ``{"mean": float, "std": float}`` (None = 0.5 / 0.5, as images_to_tensor).
        device: where the model runs.
        batch_size: images per forward pass (and per conversion).
        view: optional batch view applied before the forward pass.
        with_features: also return the features.
    """
    return ImageSource(images, normalisation).predict(model, device, batch_size, view, with_features)


def probabilities(logits: torch.Tensor, task: str) -> torch.Tensor:
    """Softmax for single-label, sigmoid otherwise."""
    return torch.softmax(logits, dim=1) if task == "single-label" else torch.sigmoid(logits)


def state_dict_numpy(model: torch.nn.Module) -> Dict[str, np.ndarray]:
    """Model weights (parameters and buffers) as numpy arrays for the wire."""
    # C order whatever the training layout (channels_last), so the wire format never depends on it
    return {k: np.asarray(v.detach().cpu().numpy(), order="C") for k, v in model.state_dict().items()}


def load_state_numpy(model: torch.nn.Module, weights: Dict[str, np.ndarray]) -> None:
    """Load numpy weights into ``model``; raises naming the first missing / misshapen key."""
    own = model.state_dict()
    missing = [k for k in own if k not in weights]
    if missing:
        raise ValueError(f"global model lacks parameter '{missing[0]}' (and {len(missing) - 1} more)")
    for k, v in own.items():
        if tuple(np.shape(weights[k])) != tuple(v.shape):
            raise ValueError(f"parameter '{k}' has shape {np.shape(weights[k])}, the model expects {tuple(v.shape)}")
    model.load_state_dict({k: torch.as_tensor(np.asarray(weights[k])).to(v.dtype) for k, v in own.items()})
