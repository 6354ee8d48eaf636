"""Admin-API work on a running FLARE system: admin kits and sessions, waiting for the sites,
submitting a job and waiting for it (:func:`run_job`), and finding its results.
"""
from __future__ import annotations

import glob
import json
import os
import time
from typing import Callable, Dict, List, Optional, Sequence

TERMINAL_PREFIX = "FINISHED"


def admin_kits(prod_dir: str) -> Dict[str, str]:
    """Admin kits of a ``prod_NN`` folder: kit folder -> role (read from the kit's certificate)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    kits = {}
    for cfg in sorted(glob.glob(os.path.join(prod_dir, "*", "startup", "fed_admin.json"))):
        kit = os.path.dirname(os.path.dirname(cfg))
        with open(os.path.join(kit, "startup", "client.crt"), "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        roles = cert.subject.get_attributes_for_oid(NameOID.UNSTRUCTURED_NAME)
        kits[kit] = roles[0].value if roles else ""
    return kits


def admin_username(admin_kit: str) -> str:
    """The user name of an admin startup kit (the CN of its certificate)."""
    from nvflare.tool.kit.kit_config import resolve_admin_user_and_dir_from_startup_kit

    return resolve_admin_user_and_dir_from_startup_kit(admin_kit)[0]


def new_admin_session(admin_kit: str, timeout: float = 30.0, username: Optional[str] = None):
    """``flare_api.new_secure_session`` for an admin kit folder (``.../prod_00/admin@x.org``).

    Args:
        admin_kit: the admin's startup kit folder.
        timeout: seconds to wait for the login.
        username: the admin's user name; it must be the kit's (its folder name, the CN of its certificate),
            which is the default. Another name is refused here with that explanation (FLARE itself only
            answers "no registration session").
    """
    from nvflare.fuel.flare_api.api_spec import NoConnection
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    if not os.path.isfile(os.path.join(admin_kit, "startup", "fed_admin.json")):
        raise FileNotFoundError(f"'{admin_kit}' is not an admin startup kit (no startup/fed_admin.json)")
    kit_user = admin_username(admin_kit)
    if username and username != kit_user:
        raise ValueError(f"user name '{username}' does not match the admin kit '{admin_kit}': its user name is "
                         f"'{kit_user}' (the kit's folder name and the CN of its certificate)")
    try:
        return new_secure_session(username=kit_user, startup_kit_location=os.path.abspath(admin_kit), timeout=timeout)
    except NoConnection as e:
        cfg = json.load(open(os.path.join(admin_kit, "startup", "fed_admin.json"))).get("admin", {})
        raise RuntimeError(f"admin '{kit_user}' could not log in to {cfg.get('host')}:{cfg.get('port')} within "
                           f"{timeout:.0f} s ({e}): is the server running, and is this kit from the same "
                           f"provisioning as the server (same startup/rootCA.pem) and not expired "
                           f"('python -m fedpartial_tools.deploy cert-expiry {admin_kit}')?") from e


def wait_for_clients(session, names: Sequence[str], timeout: float = 60.0, poll: float = 1.0) -> List[str]:
    """Block until every client in ``names`` is connected; returns the connected names."""
    deadline = time.time() + timeout
    connected: List[str] = []
    while time.time() < deadline:
        connected = sorted(c.name for c in session.get_connected_client_list())
        if set(names) <= set(connected):
            return connected
        time.sleep(poll)
    raise TimeoutError(f"clients {sorted(set(names) - set(connected))} did not connect within {timeout:.0f} s "
                       f"(connected: {connected}); see their log.txt")


def kit_sites(prod_dir: str) -> List[str]:
    """Site names of a ``prod_NN`` folder (kits with ``startup/fed_client.json``), in natural order."""
    names = [os.path.basename(os.path.dirname(os.path.dirname(p)))
             for p in glob.glob(os.path.join(prod_dir, "*", "startup", "fed_client.json"))]
    return sorted(names, key=lambda n: (len(n), n))


def run_job(session, job_dir: str, out_dir: str, timeout: float = 0.0, poll: float = 2.0,
            log: Callable[[str], None] = print, server_dir: Optional[str] = None, check_sites: bool = True) -> dict:
    """Submit a job folder, wait until it ends, download the server's result into ``out_dir``.

    The one implementation of submit / wait / abort / download: ``poc/run_job.sh`` and the tests
    both come here.

    Args:
        session: an admin session (:func:`new_admin_session`).
        job_dir: a submit-ready job (``python -m fedpartial package-job``).
        out_dir: download destination; the result lands in ``out_dir/<job_id>``.
        timeout: seconds to wait for the job (0 = forever); on timeout the job is aborted.
        poll: seconds between status polls.
        log: progress printer.
        server_dir: the server's workspace when it is on this machine (POC: ``prod_NN/server``);
            then round k/N, the key metric and time left are logged from its ``<job_id>/metrics.json``.
        check_sites: refuse (``ValueError``) a job whose ``min_clients`` exceeds the sites the server lists
            now; it would wait in SUBMITTED without a word.

    Returns:
        ``{"job_id", "status", "seconds", "result_dir", **find_results(result_dir)}``.
    """
    from nvflare.fuel.flare_api.api_spec import MonitorReturnCode

    from fedpartial_tools.jobs.packaging import check_min_clients

    started = time.time()
    if check_sites:
        check_min_clients(job_dir, sorted(c.name for c in session.get_connected_client_list()),
                          what="the server lists")
    job_id = session.submit_job(os.path.abspath(job_dir))
    log(f"submitted {os.path.basename(job_dir.rstrip('/'))} as job {job_id}; waiting"
        + (f" (timeout {timeout:.0f} s)" if timeout else ""))
    on_poll = None
    if server_dir:
        from fedpartial_tools.jobs.settings import _config_paths
        from fedpartial_tools.run.progress import RoundProgress

        config = json.load(open(_config_paths(job_dir)["server"]))
        progress = RoundProgress(int(config.get("num_rounds", 0)), str(config.get("key_metric", "")), log, started)
        metrics = os.path.join(server_dir, job_id, "metrics.json")

        def on_poll(*_):
            progress.update(metrics if os.path.isfile(metrics) else None)
            return True
    rc, meta = session.monitor_job_and_return_job_meta(job_id, timeout=timeout, poll_interval=poll, cb=on_poll)
    if rc == MonitorReturnCode.TIMEOUT:
        session.abort_job(job_id)
        raise TimeoutError(f"job {job_id} did not finish within {timeout:.0f} s; aborted it")
    status = meta.get("status", "?")
    log(f"job {job_id} ended: {status} after {time.time() - started:.0f} s")
    os.makedirs(out_dir, exist_ok=True)
    result_dir = session.download_job_result(job_id, destination=os.path.abspath(out_dir))
    out = {"job_id": job_id, "status": status, "seconds": round(time.time() - started, 1),
           "result_dir": result_dir}
    out.update(find_results(result_dir))
    return out


def find_results(result_dir: str) -> Dict[str, Optional[str]]:
    """Paths of the fedpartial outputs inside a downloaded job (``None`` where absent): the
    server's ``global_model.pt``, ``best_global_model.pt``, ``metrics.json``, cross-site
    evaluation ``cross_val_results.json``, the TensorBoard folder (``tb_events``: every site's
    curves as streamed to the server) and the server log."""

    def first(pattern):
        hits = sorted(glob.glob(os.path.join(result_dir, "**", pattern), recursive=True), key=len)
        return hits[0] if hits else None

    tb = sorted({os.path.dirname(p) for p in glob.glob(os.path.join(result_dir, "**", "events.out.tfevents.*"),
                                                          recursive=True)})
    streamed = sorted(glob.glob(os.path.join(result_dir, "**", "tb_events"), recursive=True), key=len)
    out = {"global_model": first("global_model.pt"), "best_global_model": first("best_global_model.pt"),
           "metrics": first("metrics.json"), "cross_site_val": first("cross_val_results.json"),
           "tensorboard": streamed[0] if streamed else (tb[0] if tb else None), "server_log": first("log.txt")}
    out["result_model"] = result_model(out["global_model"], out["best_global_model"])
    return out


def result_model(global_model: Optional[str], best_global_model: Optional[str]) -> Optional[str]:
    """The model that is a job's result: for segmentation ``best_global_model.pt`` (the global
    model with the best Dice pooled over every site's val pixels, the score the progress lines
    showed; a sparse-lesion run can fall back to predicting nothing in its last rounds), for
    classification ``global_model.pt`` (the last aggregate, what the README's tables score).

    Args:
        global_model: path of ``global_model.pt`` (or None).
        best_global_model: path of ``best_global_model.pt`` (or None).
    """
    from fedpartial.data.types import SEGMENTATION
    from fedpartial.models.io import read_model_file

    if best_global_model and global_model:
        try:
            task = read_model_file(global_model)["meta"].get("task")
        except Exception:  # an unreadable file: fall back to the last aggregate, which evaluate will check
            return global_model
        return best_global_model if task == SEGMENTATION else global_model
    return global_model
