"""For tests and audits only (never on the allow-list): :class:`MessageRecorder` pickles every
message passing through it, so a test sees exactly what a site puts on the wire; and
:func:`add_result_filter` puts a filter into a client config's result chains."""
from __future__ import annotations

import itertools
import os
import pickle
import threading
from typing import List

from nvflare.apis.dxo import from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey, ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.app_constant import AppConstants


class MessageRecorder(Filter):
    """Pickles every message passing through it to ``folder`` (one file per message): the site,
    task, direction, round, return code, shareable header keys, and the DXO kind, data and meta.
    Put it LAST in a result chain to audit what a site really sends. For tests and audits only:
    the files hold model weights.

    Args:
        folder: where to write ``<site>_<task>_<n>.pkl`` (created).
    """

    _counter = itertools.count()
    _lock = threading.Lock()

    def __init__(self, folder: str):
        super().__init__()
        if not folder:
            raise ValueError("MessageRecorder needs a folder")
        self.folder = folder

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        site = fl_ctx.get_identity_name() or shareable.get_peer_prop(ReservedKey.IDENTITY_NAME, "?")
        task = fl_ctx.get_prop(FLContextKey.TASK_NAME, "?")
        record = {"site": site, "task": task, "direction": fl_ctx.get_prop(FLContextKey.FILTER_DIRECTION, "?"),
                  "round": shareable.get_header(AppConstants.CURRENT_ROUND),
                  "return_code": shareable.get_return_code(), "headers": sorted(map(str, shareable.keys())),
                  "dxo": None}
        try:
            dxo = from_shareable(shareable)
            record["dxo"] = {"kind": dxo.data_kind, "data": dxo.data, "meta": dict(dxo.meta or {})}
        except Exception as e:  # error replies carry no DXO: record that, never fail the task
            record["error"] = str(e)
        os.makedirs(self.folder, exist_ok=True)
        with self._lock:
            n = next(self._counter)
        path = os.path.join(self.folder, f"{site}_{task}_{os.getpid()}_{n:05d}.pkl")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(record, f)
        os.replace(path + ".tmp", path)
        return shareable


def load_recorded(folder: str) -> List[dict]:
    """All messages a :class:`MessageRecorder` wrote to ``folder``, in file-name order."""
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".pkl"):
            with open(os.path.join(folder, name), "rb") as f:
                out.append(pickle.load(f))
    return out


def add_result_filter(client_config: dict, filter_spec: dict, tasks=("train", "submit_model", "validate"),
                      last: bool = True) -> dict:
    """Put ``filter_spec`` ({"path", "args"}) in the client's result chain of each task, appended
    to the chain that already covers the task (FLARE allows one chain per task) or in a new one.

    Args:
        client_config: a loaded ``config_fed_client.json`` (edited in place and returned).
        filter_spec: ``{"path": ..., "args": {...}}``.
        tasks: task names.
        last: append (True) or prepend to an existing chain.
    """
    chains = client_config.setdefault("task_result_filters", [])
    left = list(tasks)
    for chain in chains:
        if chain.get("direction", "out").lower() not in ("out", "inout"):
            continue
        covered = [t for t in chain.get("tasks", []) if t in left]
        if covered:
            filters = chain.setdefault("filters", [])
            filters.append(dict(filter_spec)) if last else filters.insert(0, dict(filter_spec))
            left = [t for t in left if t not in covered]
    if left:
        chains.append({"tasks": left, "filters": [dict(filter_spec)]})
    return client_config
