"""A site's own say over what a job reads and writes: ``<kit>/local/fedpartial_site.json``.

Provisioning writes this file into every kit (``SitePolicyBuilder``); the site edits it. It names
the data folders the site offers, one per federation or study::

    {"format_version": 1,
     "datasets": {"ham_lsm": "/data/fedpartial/ham", "ich_mlp": "/data/fedpartial/ich"}}

A kit that holds the file is a *provisioned site*: a job names a dataset (the executor's
``dataset``) and never a path; a job that sets ``data_root`` or ``reference_file``, names a
dataset the site does not offer, or names no runtime version is refused at its start. A kit
without the file (the simulator, ``nvflare poc`` kits) is a *development site*: the job's
``data_root`` or ``$FEDPARTIAL_DATA_ROOT`` is used, and the log says it is a development path.

Every path a job may set (``data_file``, ``state_dir``) is relative, and may not climb out of
the folder it is resolved in, at every kind of site. A provisioned site also accepts only its own
site file (``{site}.npz`` or ``{site}``) as ``data_file``, refuses a complete-label reference copy
whatever its name, caps ``model.input_size`` (``max_input_size``, default 1024 px), and keeps the
resized copy of a large site folder in its own workspace (``KIT/fedpartial_cache/``), never in the
data folder it offers.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional

SITE_CONFIG = "fedpartial_site.json"
FORMAT_VERSION = 1


def site_config_path(workspace_root: str) -> str:
    """``<workspace_root>/local/fedpartial_site.json``."""
    return os.path.join(workspace_root, "local", SITE_CONFIG)


def load_site_config(workspace_root: str) -> Optional[dict]:
    """The site's configuration, checked; ``None`` when the kit has none (a development site).

    Dataset folders are returned absolute (``~`` expanded; a relative folder is taken from the
    kit's root).

    Args:
        workspace_root: the site's kit / workspace root (FLARE's ``workspace.get_root_dir()``).

    Raises:
        ValueError: the file is not valid JSON or lacks / misnames a key (naming the file and key).
    """
    path = site_config_path(workspace_root)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"site configuration '{path}' cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"site configuration '{path}' must hold a JSON object")
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"site configuration '{path}': format_version must be {FORMAT_VERSION}, got {version!r}")
    datasets = config.get("datasets", {})
    if not isinstance(datasets, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                 for k, v in datasets.items()):
        raise ValueError(f"site configuration '{path}': 'datasets' must map names to folders, got {datasets!r}")
    root = os.path.abspath(workspace_root)
    out = dict(config)
    out["datasets"] = {name: os.path.normpath(os.path.join(root, os.path.expanduser(folder)))
                       for name, folder in datasets.items()}
    out["path"] = path
    return out


def confined(base: str, relative: str, field: str, where: str) -> str:
    """``base``/``relative``, refused when ``relative`` is absolute or climbs out with ``..``.

    Args:
        base: the folder the job's value is resolved in.
        relative: the job's value.
        field: the job's setting, for the message (e.g. ``state_dir``).
        where: who refuses (e.g. ``site 'site-1'``).

    Raises:
        ValueError: naming the field, the value and the folder it must stay in.
    """
    value = str(relative)
    parts = value.replace("\\", "/").split("/")
    if os.path.isabs(value) or value.startswith("~") or ".." in parts:
        raise ValueError(f"{where} refuses the job: its '{field}' ({value!r}) must be a path relative to "
                         f"{base}, without '..'")
    return os.path.normpath(os.path.join(base, value))


#: the file name patterns a job may give a provisioned site: its own site file or site folder
SITE_FILE_PATTERNS = ("{site}.npz", "{site}")
#: the fewest images behind a curve a provisioned site streams to the server ("min_count" in its
#: file); the site's privacy.json applies its own min_count to task results
MIN_COUNT = 5
#: the largest image side a job may ask a provisioned site to resize to (``max_input_size`` in the
#: site's file changes it): a huge size would fill the site's memory or disk
MAX_INPUT_SIZE = 1024


def check_provisioned_job(config: dict, data_file: str, model: dict, where: str) -> None:
    """What else a provisioned site refuses: another file name than its own site file, and an
    input size beyond its limit.

    Args:
        config: from :func:`load_site_config`.
        data_file: the job's ``data_file``.
        model: the job's model block (``input_size``).
        where: who refuses (e.g. ``site 'site-1'``).

    Raises:
        ValueError: naming the field and what the site accepts.
    """
    if data_file not in SITE_FILE_PATTERNS:
        raise ValueError(f"{where} refuses the job: its 'data_file' ({data_file!r}) is not one of "
                         f"{list(SITE_FILE_PATTERNS)}: a job reads the site's own file in the dataset it names")
    limit = config.get("max_input_size", MAX_INPUT_SIZE)
    size = [int(v) for v in (model.get("input_size") or [0, 0])]
    if any(v < 0 or v > int(limit) for v in size):
        raise ValueError(f"{where} refuses the job: model.input_size {size} is beyond this site's limit of "
                         f"{limit} px a side ('max_input_size' in {config['path']})")


def offered_data_root(config: dict, dataset: str, data_root: str, reference_file: str, where: str) -> str:
    """The folder of the dataset a job names at a provisioned site, or a refusal.

    Args:
        config: from :func:`load_site_config`.
        dataset: the job's ``dataset``.
        data_root: the job's ``data_root`` (must be empty here).
        reference_file: the job's ``reference_file`` (must be empty here: complete-label copies
            exist only in the simulator and the bench).
        where: who refuses (e.g. ``site 'site-1'``).

    Raises:
        ValueError: naming the field that was refused and the datasets the site offers.
    """
    offered: Dict[str, str] = config["datasets"]
    names = ", ".join(sorted(offered)) or "none (add one to its 'datasets')"
    hint = f"{where} offers the datasets: {names} ({config['path']})"
    if data_root:
        raise ValueError(f"{where} refuses the job: it sets 'data_root' ({data_root!r}); a job names a dataset "
                         f"in 'dataset', never a path. {hint}")
    if reference_file:
        raise ValueError(f"{where} refuses the job: it sets 'reference_file' ({reference_file!r}); complete-label "
                         f"copies are read only in the simulator and the bench")
    if not dataset:
        raise ValueError(f"{where} refuses the job: it names no 'dataset'. {hint}")
    if dataset not in offered:
        raise ValueError(f"{where} refuses the job: 'dataset' {dataset!r} is not offered here. {hint}")
    return offered[dataset]


def offer_dataset(workspace_root: str, name: str, folder: str) -> str:
    """Add (or move) the dataset ``name`` -> ``folder`` in the kit's site configuration, creating
    the file when the kit has none. Returns the file's path.

    Args:
        workspace_root: the site's kit.
        name: the name jobs give in ``dataset`` (letters, digits, ``_``, ``-``, ``.``).
        folder: the folder holding ``<site>.npz`` (or site folders); made absolute.

    Raises:
        ValueError: a bad name, a folder that does not exist, or a broken existing file.
    """
    import re

    if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(name or "")):
        raise ValueError(f"dataset name {name!r}: use letters, digits, '_', '-' and '.' only")
    folder = os.path.abspath(os.path.expanduser(folder))
    if not os.path.isdir(folder):
        raise ValueError(f"dataset '{name}': folder '{folder}' does not exist")
    path = site_config_path(workspace_root)
    config = {"format_version": FORMAT_VERSION, "datasets": {}}
    if os.path.isfile(path):
        load_site_config(workspace_root)  # refuse to rewrite a file that does not check
        with open(path) as f:
            config = json.load(f)
    config.setdefault("datasets", {})[name] = folder
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, path)
    return path
