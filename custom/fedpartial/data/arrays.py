"""Array-file helpers shared by the ``.npz`` layouts (:mod:`fedpartial.data.npz`) and site
folders (:mod:`fedpartial.data.sitefile`): reading an archive with errors that name the file,
atomic writes, and the checks both apply to images."""
from __future__ import annotations

import json
import os
import tempfile
import zipfile
from typing import Dict

import numpy as np

from fedpartial.data.types import DataError


def open_npz(path: str) -> Dict[str, np.ndarray]:
    """Read every array of an ``.npz`` into memory; corrupt or truncated files raise DataError
    naming the file (and the key, when one array is damaged)."""
    if not os.path.isfile(path):
        raise DataError(f"data file '{path}' not found")
    try:
        with np.load(path, allow_pickle=False) as z:
            out = {}
            for key in z.files:
                try:
                    out[key] = z[key]
                except Exception as e:
                    raise DataError(f"'{path}': array '{key}' is unreadable ({type(e).__name__}: {e})") from e
            return out
    except DataError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError) as e:
        raise DataError(f"'{path}' is not a readable .npz file ({type(e).__name__}: {e}); "
                        f"it may be truncated or corrupt") from e


def check_images(images: np.ndarray, path: str, key: str) -> None:
    if images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[-1] not in (1, 3)):
        raise DataError(f"'{path}': '{key}' has shape {images.shape}; expected (N,H,W) or (N,H,W,3)")
    if images.dtype != np.uint8:
        raise DataError(f"'{path}': '{key}' has dtype {images.dtype}; expected uint8")


def atomic_savez(path: str, arrays: Dict[str, np.ndarray]) -> None:
    """``np.savez_compressed`` to a temporary file in the same folder, then rename."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".npz.tmp", dir=folder)
    os.close(fd)
    try:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600; give the file normal permissions
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def plain_array(values) -> np.ndarray:
    """ids / groups as a numeric or unicode array (object arrays would need pickle to load)."""
    values = np.asarray(values)
    return values.astype(str) if values.dtype == object else values


def read_info_json(arrays: Dict[str, np.ndarray], where: str) -> dict:
    """The ``info_json`` key of a file's arrays as a dict (``{}`` when absent).

    Args:
        arrays: the file's arrays.
        where: the file, as error messages name it (e.g. ``site file 'x.npz'``).

    Raises:
        DataError: naming ``where`` when the key is not JSON or not a JSON object.
    """
    from fedpartial.data.types import DataError

    if "info_json" not in arrays:
        return {}
    try:
        info = json.loads(str(arrays["info_json"]))
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: 'info_json' is not JSON ({e})") from e
    if not isinstance(info, dict):
        raise DataError(f"{where}: 'info_json' holds {type(info).__name__}, not a JSON object")
    return info


def info_json(info: dict) -> np.ndarray:
    """``info`` as a 0-d unicode array (numpy numbers and arrays become plain JSON)."""
    def plain(value):
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
        raise TypeError(f"info value {value!r} ({type(value).__name__}) is not JSON-able")

    return np.array(json.dumps(info, sort_keys=True, default=plain))


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
