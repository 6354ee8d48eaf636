"""Site files: what one site really has (see docs/ARCHITECTURE.md, "Site files").

Keys: ``train_images``, ``train_labels``, ``train_label_mask`` (classification), ``val_*``,
``class_names``, ``task``, ``site``, ``info_json``; optional ``train_ids``, ``train_groups``.

Two layouts hold the same keys:

* ``<site>.npz``: one compressed archive, read whole into memory (small sites).
* ``<site>/`` (a *site folder*): ``meta.json`` (format, task, class_names, site, info) and one
  uncompressed ``<key>.npy`` per array (``train_images.npy``, ``train_labels.npy``, ...), opened
  with ``np.load(mmap_mode="r")`` so image bytes are read only when a batch uses them (sites whose
  images do not fit in memory). ``<site>/cache/`` holds resized copies made by
  :func:`cached_resize`; the loader never reads it as data.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from fedpartial.data.arrays import atomic_savez, check_images, info_json, open_npz, plain_array, read_info_json, umask
from fedpartial.data.types import SEGMENTATION, TASKS, DataError, Dataset, Split

SITE_SPLITS = ("train", "val", "test")
FOLDER_FORMAT = "fedpartial-site-folder"
FOLDER_VERSION = 1
META_FILE = "meta.json"
CACHE_DIR = "cache"
LAYOUTS = ("auto", "npz", "folder")
# Rows per chunk when checking / resizing a site folder: ~50 MB of 224 px grey images.
CHUNK_ROWS = 1024
# Array keys that are small per sample (loaded into memory from a folder); every other array
# (images, segmentation masks) stays memory-mapped.
_SMALL_SUFFIXES = ("_label_mask", "_ids", "_groups")


def _site_arrays(dataset: Dataset) -> Dict[str, np.ndarray]:
    """The per-split arrays of a site file, as written (labels and masks as uint8)."""
    arrays = {}
    for name, split in dataset.splits.items():
        arrays[f"{name}_images"] = split.images
        if dataset.is_segmentation:
            arrays[f"{name}_labels"] = split.labels.astype(np.uint8 if split.labels.max(initial=0) < 256 else np.uint16)
        else:
            arrays[f"{name}_labels"] = split.labels.astype(np.uint8)
            mask = split.label_mask if split.label_mask is not None else np.ones_like(split.labels, bool)
            arrays[f"{name}_label_mask"] = mask.astype(np.uint8)
        if split.ids is not None:
            arrays[f"{name}_ids"] = plain_array(split.ids)
        if split.groups is not None:
            arrays[f"{name}_groups"] = plain_array(split.groups)
    return arrays


def _meta(task: str, class_names: Sequence[str], site: str, info: dict) -> dict:
    # info goes through info_json so numpy values become plain JSON exactly as in a .npz
    return {"format": FOLDER_FORMAT, "version": FOLDER_VERSION, "task": task,
            "class_names": [str(c) for c in class_names], "site": site, "info": json.loads(str(info_json(info)))}


def is_site_folder(path: str) -> bool:
    """True when ``path`` is a directory (a site folder, or meant to be one)."""
    return os.path.isdir(path)


def write_site_file(path: str, dataset: Dataset, layout: str = "auto") -> None:
    """Write one site's data atomically.

    Args:
        path: the ``.npz`` to create, or the site folder to create.
        dataset: the site's data; ``dataset.site`` names the site.
        layout: ``auto`` (a path ending in ``.npz`` gives an archive, any other path a site
            folder), ``npz`` or ``folder``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout '{layout}' is not one of {LAYOUTS}")
    if not dataset.site:
        raise DataError(f"cannot write '{path}': the dataset has no site name")
    if layout == "folder" or (layout == "auto" and not path.endswith(".npz")):
        with SiteFolderWriter(path, dataset.task, dataset.class_names, dataset.site,
                              {name: len(split) for name, split in dataset.splits.items()},
                              image_shape=_image_shape(dataset), info=dataset.info) as writer:
            for name, split in dataset.splits.items():
                writer.append(name, split.images, split.labels, split.label_mask, split.ids, split.groups)
        return
    arrays = {"class_names": np.array(dataset.class_names), "task": np.array(dataset.task),
              "site": np.array(dataset.site), "info_json": info_json(dataset.info)}
    arrays.update(_site_arrays(dataset))
    atomic_savez(path, arrays)


def _image_shape(dataset: Dataset) -> Tuple[int, ...]:
    for split in dataset.splits.values():
        return tuple(int(s) for s in split.images.shape[1:])
    raise DataError(f"cannot write {dataset.where()}: it has no split")


class SiteFolderWriter:
    """Writes a site folder chunk by chunk, never holding a whole split in memory.

    Images (and segmentation masks) go straight into ``np.lib.format.open_memmap`` files sized
    from ``counts``; labels / masks / ids are small and kept in memory until :meth:`close`. All
    files are written into ``<site>.tmp-XXXX/`` beside the target and renamed into place at the
    end, so a crash never leaves a half-written site folder (an existing folder is replaced).

    Usage::

        with SiteFolderWriter("data/site-1", "multi-label", names, "site-1", {"train": 20000, "val": 2000},
                              image_shape=(224, 224)) as w:
            for images, labels, mask in chunks:
                w.append("train", images, labels, mask)

    Args:
        path: the site folder to create.
        task: ``single-label``, ``multi-label`` or ``segmentation``.
        class_names: the class names (segmentation: foreground classes).
        site: the site name.
        counts: images per split, e.g. ``{"train": 20000, "val": 2000}``; each split must get
            exactly this many rows before :meth:`close`.
        image_shape: ``(H, W)`` grey or ``(H, W, 3)`` RGB.
        info: extra JSON-able facts (as ``Dataset.info``).
    """

    def __init__(self, path: str, task: str, class_names: Sequence[str], site: str, counts: Dict[str, int],
                 image_shape: Sequence[int], info: Optional[dict] = None):
        if task not in TASKS:
            raise DataError(f"cannot write '{path}': task '{task}' is not one of {TASKS}")
        if not site:
            raise DataError(f"cannot write '{path}': no site name")
        unknown = [s for s in counts if s not in SITE_SPLITS]
        if unknown:
            raise DataError(f"cannot write '{path}': split '{unknown[0]}' is not one of {SITE_SPLITS}")
        self.image_shape = tuple(int(s) for s in image_shape)
        if len(self.image_shape) not in (2, 3) or (len(self.image_shape) == 3 and self.image_shape[2] not in (1, 3)):
            raise DataError(f"cannot write '{path}': image shape {self.image_shape}; expected (H, W) or (H, W, 3)")
        self.path = os.path.abspath(path.rstrip(os.sep))
        self.task, self.class_names, self.site = task, [str(c) for c in class_names], site
        self.counts = {name: int(n) for name, n in counts.items()}
        self.info = dict(info or {})
        parent = os.path.dirname(self.path)
        os.makedirs(parent, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=os.path.basename(self.path) + ".tmp-", dir=parent)
        self.filled = {name: 0 for name in self.counts}
        self._images, self._labels = {}, {}
        self._small: Dict[str, Dict[str, List[np.ndarray]]] = {name: {} for name in self.counts}
        c = len(self.class_names)
        for name, n in self.counts.items():
            self._images[name] = np.lib.format.open_memmap(os.path.join(self.tmp, f"{name}_images.npy"), mode="w+",
                                                           dtype=np.uint8, shape=(n, *self.image_shape))
            label_shape = (n, *self.image_shape[:2]) if task == SEGMENTATION else (n, c)
            self._labels[name] = np.lib.format.open_memmap(os.path.join(self.tmp, f"{name}_labels.npy"), mode="w+",
                                                           dtype=np.uint8, shape=label_shape)
        self.closed = False

    def __enter__(self) -> "SiteFolderWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def append(self, split: str, images: np.ndarray, labels: np.ndarray, label_mask: Optional[np.ndarray] = None,
               ids: Optional[Iterable] = None, groups: Optional[Iterable] = None) -> None:
        """Append the next rows of ``split``.

        Args:
            split: ``train``, ``val`` or ``test`` (one of ``counts``).
            images: uint8 ``(n, *image_shape)``.
            labels: classification ``(n, C)`` 0/1; segmentation ``(n, H, W)`` 0/1 masks.
            label_mask: classification ``(n, C)`` 0/1, 1 where annotated (None = all annotated).
            ids / groups: optional per-row ids / patient ids; give them for every chunk of a
                split or for none.
        """
        if self.closed:
            raise DataError(f"site folder writer for '{self.path}' is closed")
        if split not in self.counts:
            raise DataError(f"'{self.path}': split '{split}' was not declared (counts: {self.counts})")
        images = np.asarray(images)
        n = len(images)
        start = self.filled[split]
        if start + n > self.counts[split]:
            raise DataError(f"'{self.path}': {start + n} rows appended to '{split}', {self.counts[split]} declared")
        if images.dtype != np.uint8 or tuple(images.shape[1:]) != self.image_shape:
            raise DataError(f"'{self.path}': '{split}_images' chunk has shape {images.shape} {images.dtype}; "
                            f"expected (n, {', '.join(map(str, self.image_shape))}) uint8")
        labels = np.asarray(labels)
        target = self._labels[split]
        if tuple(labels.shape) != (n, *target.shape[1:]):
            raise DataError(f"'{self.path}': '{split}_labels' chunk has shape {labels.shape}; "
                            f"expected {(n, *target.shape[1:])}")
        if not np.isin(labels, (0, 1)).all():
            raise DataError(f"'{self.path}': '{split}_labels' chunk at row {start} holds values other than 0/1")
        if self.task != SEGMENTATION:
            mask = np.ones(labels.shape, np.uint8) if label_mask is None else np.asarray(label_mask)
            if mask.shape != labels.shape:
                raise DataError(f"'{self.path}': '{split}_label_mask' chunk has shape {mask.shape}, "
                                f"labels {labels.shape}")
            self._small[split].setdefault("label_mask", []).append(mask.astype(np.uint8))
        self._images[split][start:start + n] = images
        target[start:start + n] = labels
        for key, values in (("ids", ids), ("groups", groups)):
            if values is not None:
                self._small[split].setdefault(key, []).append(plain_array(values))
        self.filled[split] = start + n

    def close(self) -> None:
        """Check every split is full, write the small arrays and ``meta.json``, rename into place."""
        if self.closed:
            return
        try:
            short = {s: (self.filled[s], n) for s, n in self.counts.items() if self.filled[s] != n}
            if short:
                s, (got, n) = next(iter(short.items()))
                raise DataError(f"'{self.path}': split '{s}' got {got} rows, {n} declared")
            for arrays in (self._images, self._labels):
                for a in arrays.values():
                    a.flush()
            self._images, self._labels = {}, {}  # drop the memmaps before the rename
            for split, parts in self._small.items():
                for key, chunks in parts.items():
                    values = np.concatenate(chunks) if chunks else np.zeros(0)
                    if len(values) != self.counts[split]:
                        raise DataError(f"'{self.path}': '{split}_{key}' given for {len(values)} of "
                                        f"{self.counts[split]} rows (give it with every chunk or never)")
                    np.save(os.path.join(self.tmp, f"{split}_{key}.npy"), values, allow_pickle=False)
            with open(os.path.join(self.tmp, META_FILE), "w") as f:
                json.dump(_meta(self.task, self.class_names, self.site, self.info), f, indent=1, sort_keys=True)
            os.chmod(self.tmp, 0o777 & ~umask())  # mkdtemp makes 0700; give the folder normal permissions
            _replace_folder(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        self.closed = True

    def abort(self) -> None:
        """Drop everything written so far (the target folder is left as it was)."""
        self._images, self._labels = {}, {}
        self.closed = True
        shutil.rmtree(self.tmp, ignore_errors=True)


def _replace_folder(tmp: str, path: str) -> None:
    """Rename ``tmp`` to ``path``; an existing ``path`` is moved aside first, then removed."""
    old = None
    if os.path.lexists(path):
        old = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old-", dir=os.path.dirname(path))
        os.rmdir(old)
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if old is not None:
            os.rename(old, path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.remove(old)


def open_site_folder(path: str) -> Dict[str, np.ndarray]:
    """The arrays of a site folder under the ``.npz`` key names: ``task``, ``site``,
    ``class_names``, ``info_json`` from ``meta.json``; each ``<key>.npy`` memory-mapped (images,
    segmentation masks) or read (labels, label masks, ids, groups: small).

    Args:
        path: the site folder.

    Raises:
        DataError: naming the folder and file for a missing / unreadable ``meta.json`` or ``.npy``.
    """
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise DataError(f"site folder '{path}' lacks '{META_FILE}'")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"site folder '{path}': '{META_FILE}' is unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(meta, dict) or meta.get("format", FOLDER_FORMAT) != FOLDER_FORMAT:
        raise DataError(f"site folder '{path}': '{META_FILE}' is not a {FOLDER_FORMAT} description")
    for key in ("task", "site", "class_names"):
        if key not in meta:
            raise DataError(f"site folder '{path}': '{META_FILE}' lacks '{key}'")
    arrays: Dict[str, np.ndarray] = {"task": np.array(str(meta["task"])), "site": np.array(str(meta["site"])),
                                     "class_names": np.array([str(c) for c in meta["class_names"]]),
                                     "info_json": info_json(meta.get("info") or {})}
    for entry in sorted(os.listdir(path)):
        file = os.path.join(path, entry)
        if not entry.endswith(".npy") or not os.path.isfile(file):
            continue  # cache/, meta.json, stray files
        key = entry[:-4]
        small = key.endswith(_SMALL_SUFFIXES) or (key.endswith("_labels") and meta["task"] != SEGMENTATION)
        try:
            arrays[key] = np.load(file, mmap_mode=None if small else "r", allow_pickle=False)
        except Exception as e:  # truncated file, bad header, pickled objects
            raise DataError(f"site folder '{path}': array '{key}' ({entry}) is unreadable "
                            f"({type(e).__name__}: {e})") from e
    return arrays


def _check_binary(labels: np.ndarray, path: str, key: str) -> None:
    """Segmentation masks must be integer 0/1; a memory-mapped array is checked in chunks."""
    if labels.dtype.kind not in "biu":
        ok = False
    elif isinstance(labels, np.memmap):
        ok = all(np.isin(labels[s:s + CHUNK_ROWS], (0, 1)).all() for s in range(0, len(labels), CHUNK_ROWS))
    else:
        ok = bool(np.isin(labels, (0, 1)).all())
    if not ok:
        if isinstance(labels, np.memmap):  # never np.unique over a whole memory-mapped split
            values = sorted({int(v) for s in range(0, len(labels), CHUNK_ROWS)
                             for v in np.unique(labels[s:s + CHUNK_ROWS])[:5]})[:5]
        else:
            values = np.unique(labels)[:5].tolist()
        raise DataError(f"site file '{path}': '{key}' must be a binary 0/1 lesion mask "
                        f"(dtype {labels.dtype}, values {values}...)")


def dataset_from_site_arrays(arrays: Dict[str, np.ndarray], path: str, expected_site: Optional[str] = None) -> Dataset:
    """Check and wrap the arrays of a site file (an ``.npz``'s, or a site folder's memory maps:
    images are checked by dtype / shape only, never read)."""
    for key in ("task", "site", "class_names", "train_images", "train_labels"):
        if key not in arrays:
            raise DataError(f"site file '{path}' lacks '{key}'")
    task, site = str(arrays["task"]), str(arrays["site"])
    if task not in TASKS:
        raise DataError(f"site file '{path}': task '{task}' is not one of {TASKS}")
    if expected_site is not None and site != expected_site:
        raise DataError(f"site file '{path}' belongs to site '{site}', not '{expected_site}'")
    class_names = [str(c) for c in arrays["class_names"].tolist()]
    info = read_info_json(arrays, f"site file '{path}'")
    splits = {}
    for name in SITE_SPLITS:
        if f"{name}_images" not in arrays:
            continue
        images, labels = arrays[f"{name}_images"], arrays.get(f"{name}_labels")
        check_images(images, path, f"{name}_images")
        if labels is None:
            raise DataError(f"site file '{path}' has '{name}_images' but no '{name}_labels'")
        if len(labels) != len(images):
            raise DataError(f"site file '{path}': {len(images)} images but {len(labels)} rows in '{name}_labels'")
        mask = None
        if task == SEGMENTATION:
            if labels.shape != images.shape[:3]:
                raise DataError(f"site file '{path}': '{name}_labels' has shape {labels.shape}, "
                                f"images are {images.shape[:3]}")
            _check_binary(labels, path, f"{name}_labels")
        else:
            if labels.ndim != 2 or labels.shape[1] != len(class_names):
                raise DataError(f"site file '{path}': '{name}_labels' has shape {labels.shape}; expected "
                                f"(N, {len(class_names)}) for classes {class_names}")
            if not np.isin(labels, (0, 1)).all():
                bad = tuple(int(i) for i in np.argwhere(~np.isin(labels, (0, 1)))[0])
                raise DataError(f"site file '{path}': '{name}_labels' entry {bad} is {labels[bad]}; labels must be 0/1")
            mask_key = f"{name}_label_mask"
            mask = arrays.get(mask_key)
            if mask is None:
                raise DataError(f"site file '{path}' lacks '{mask_key}'")
            if mask.shape != labels.shape:
                raise DataError(f"site file '{path}': '{mask_key}' has shape {mask.shape}, labels {labels.shape}")
            mask = mask.astype(bool)
            bad = np.argwhere((labels > 0) & ~mask)
            if len(bad):
                raise DataError(f"site file '{path}': '{mask_key}' marks entry {tuple(int(i) for i in bad[0])} (class "
                                f"'{class_names[bad[0][1]]}') unannotated but its label is 1")
            labels = labels.astype(np.float32)
        splits[name] = Split(images, labels, mask, arrays.get(f"{name}_ids"), arrays.get(f"{name}_groups"))
    if len(splits.get("train", [])) == 0:
        raise DataError(f"site '{site}' has no training images in '{path}'")
    return Dataset(task, class_names, splits, source=path, site=site, info=info)


def load_site_file(path: str, expected_site: Optional[str] = None) -> Dataset:
    """Load and check one site file.

    Args:
        path: the site's ``.npz``, or its site folder (images stay memory-mapped: nothing of
            them is read until a batch uses it).
        expected_site: when given, the file must belong to this site.

    Raises:
        DataError: naming the file / key / class for any inconsistency.
    """
    if is_site_folder(path):
        return dataset_from_site_arrays(open_site_folder(path), path, expected_site)
    return dataset_from_site_arrays(open_npz(path), path, expected_site)


# ---- resized copies of a site folder, cached beside it ------------------------------------------
def _stamp_of(file: str) -> dict:
    st = os.stat(file)
    return {"file": os.path.basename(file), "mtime_ns": int(st.st_mtime_ns), "size": int(st.st_size)}


def _cached_array(source_file: str, cache_file: str, build, shape: Tuple[int, ...], dtype) -> np.ndarray:
    """A memory map of ``cache_file``, (re)built by ``build(out)`` unless its json stamp says it
    was made from the current ``source_file`` (same mtime and size) with this shape."""
    stamp_file = cache_file[:-4] + ".json"
    want = {"source": _stamp_of(source_file), "shape": list(shape), "dtype": np.dtype(dtype).str}
    if os.path.isfile(cache_file) and os.path.isfile(stamp_file):
        try:
            with open(stamp_file) as f:
                have = json.load(f)
            if have == want:
                cached = np.load(cache_file, mmap_mode="r", allow_pickle=False)
                if cached.shape == tuple(shape) and cached.dtype == np.dtype(dtype):
                    return cached
        except (OSError, ValueError):
            pass  # unreadable stamp or cache: rebuild it
    folder = os.path.dirname(cache_file)
    os.makedirs(folder, exist_ok=True)
    # unique temporary names, renamed at the end: two processes building the same cache never
    # see each other's half-written file; the stamp goes last so a crash leaves no valid stamp
    fd, tmp = tempfile.mkstemp(suffix=".npy.tmp", dir=folder)
    os.close(fd)
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=tuple(shape))
        build(out)
        out.flush()
        del out
        os.replace(tmp, cache_file)
        fd, tmp_stamp = tempfile.mkstemp(suffix=".json.tmp", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(want, f)
        os.replace(tmp_stamp, stamp_file)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return np.load(cache_file, mmap_mode="r", allow_pickle=False)


def cached_resize(dataset: Dataset, size: Sequence[int], folder: Optional[str] = None,
                  chunk_rows: int = CHUNK_ROWS, cache_dir: Optional[str] = None,
                  keep_one_size: bool = False) -> Dataset:
    """Resize a site folder's images (bilinear, antialiased) and segmentation masks (nearest) to
    ``size`` chunk by chunk into ``<folder>/cache/<split>_images_<H>x<W>.npy`` (and
    ``<split>_labels_<H>x<W>.npy``), each with a json stamp of its source's mtime and size: the
    copy is made once, reused by later rounds and runs, and rebuilt when the source changes.
    Splits already at ``size`` are returned as they are. Pixels equal ``resize_dataset``'s.

    Args:
        dataset: loaded from a site folder (``dataset.source`` is the folder).
        size: target (H, W).
        folder: the site folder; default ``dataset.source``.
        chunk_rows: images resized at a time (bounds the memory used).
        cache_dir: where the copies go (default ``<folder>/cache``); a provisioned site keeps them
            in its own workspace, so a job writes nothing into the data folder it reads.
        keep_one_size: remove the copies of other sizes from ``cache_dir`` (a provisioned site: a
            job per input size would otherwise add a copy of the folder each; a job still reading
            a removed copy keeps its memory map, the file goes when it closes).
    """
    from fedpartial.data.transforms import resize_dataset

    folder = folder or dataset.source
    if not is_site_folder(folder):
        raise DataError(f"cached_resize needs a site folder; '{folder}' is not one")
    size = tuple(int(s) for s in size)
    cache = cache_dir or os.path.join(folder, CACHE_DIR)
    tag = f"{size[0]}x{size[1]}"
    splits = {}
    for name, split in dataset.splits.items():
        images = split.images
        if tuple(images.shape[1:3]) == size:
            splits[name] = split
            continue

        def chunks(out, source=split, pick_labels=False):
            for s in range(0, len(source), chunk_rows):  # resize_dataset on one chunk at a time
                # np.array: a writable in-memory copy of the chunk (torch warns on read-only memory maps)
                part = Split(np.array(source.images[s:s + chunk_rows]), np.array(source.labels[s:s + chunk_rows]))
                small = resize_dataset(Dataset(dataset.task, list(dataset.class_names), {"x": part}), size)
                out[s:s + chunk_rows] = small.splits["x"].labels if pick_labels else small.splits["x"].images

        shape = (len(images), *size, *images.shape[3:])
        resized = _cached_array(os.path.join(folder, f"{name}_images.npy"),
                                os.path.join(cache, f"{name}_images_{tag}.npy"), chunks, shape, np.uint8)
        labels = split.labels
        if dataset.is_segmentation:
            labels = _cached_array(os.path.join(folder, f"{name}_labels.npy"),
                                   os.path.join(cache, f"{name}_labels_{tag}.npy"),
                                   lambda out, s=split: chunks(out, s, pick_labels=True),
                                   (len(images), *size), split.labels.dtype)
        splits[name] = Split(resized, labels, split.label_mask, split.ids, split.groups)
    if keep_one_size and os.path.isdir(cache):
        for entry in os.listdir(cache):
            match = re.fullmatch(r"\w+_(?:images|labels)_(\d+x\d+)\.(?:npy|json)", entry)
            if match and match.group(1) != tag:
                os.remove(os.path.join(cache, entry))
    return Dataset(dataset.task, list(dataset.class_names), splits, dataset.source, dataset.site, dict(dataset.info))
