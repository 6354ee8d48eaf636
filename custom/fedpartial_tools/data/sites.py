"""Site-file discovery: the sites of a data root (``<site>.npz`` files and ``<site>/`` site folders)
and the model settings (classes, task, channels, size) their data fixes for a job."""
from __future__ import annotations

import glob
import json
import os
from typing import Dict, List


def site_paths(data_root: str) -> Dict[str, str]:
    """Sites of ``data_root``: each ``<site>.npz`` file and each ``<site>/`` site folder (one holding
    ``meta.json``, the streaming layout); reference copies live in a subfolder and are not sites.

    Args:
        data_root: folder of site files / site folders.
    """
    found = {os.path.basename(p)[:-4]: p for p in glob.glob(os.path.join(data_root, "*.npz"))}
    for meta in glob.glob(os.path.join(data_root, "*", "meta.json")):
        folder = os.path.dirname(meta)
        name = os.path.basename(folder)
        if name in found:
            raise ValueError(f"data root '{data_root}' holds both '{name}.npz' and a site folder '{name}/': "
                             f"keep one")
        found[name] = folder
    if not found:
        raise FileNotFoundError(f"no site files (*.npz) or site folders in data root '{data_root}'; make them with "
                                f"'python -m fedpartial split ... --out {data_root}' or 'python -m fedpartial import'")
    return {name: found[name] for name in sorted(found, key=lambda s: (len(s), s))}


def site_names(data_root: str) -> List[str]:
    """The site names of ``data_root`` (see :func:`site_paths`), in natural order."""
    return list(site_paths(data_root))


def dataset_settings(data_root: str) -> dict:
    """The model keys fitting a job to the site files in ``data_root``: ``class_names``, ``task``,
    ``in_channels`` and ``input_size``, read from the first site file.

    Args:
        data_root: folder of site files / site folders.
    """
    from fedpartial.data.sitefile import load_site_file

    data = load_site_file(next(iter(site_paths(data_root).values())))
    images = data.splits["train"].images
    channels = 1 if images.ndim == 3 else int(images.shape[-1])
    return {"class_names": list(data.class_names), "task": data.task, "in_channels": channels,
            "input_size": [int(images.shape[1]), int(images.shape[2])]}


def dataset_overrides(data_root: str) -> List[str]:
    """:func:`dataset_settings` as ``--set`` items."""
    return [f"model.{key}={json.dumps(value)}" for key, value in dataset_settings(data_root).items()]
