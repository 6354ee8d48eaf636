"""Running fedpartial jobs on a real FLARE system (POC or provisioned startup kits).

Shared by ``poc/*.sh``, ``provisioning/*.sh`` and the end-to-end tests (one implementation of
each action; the scripts are thin wrappers):

* projects: :func:`localhost_project` writes a one-machine ``project.yml``; :func:`provision`
  runs ``nvflare provision`` and returns the newest ``prod_NN`` folder.
* kits: :func:`kit_env` (HOME / TMPDIR / PATH so the kits use this venv and write nowhere else),
  :func:`keep_server_storage_in` (job store out of ``/tmp/nvflare``), :func:`start_kit`.
* admin: :func:`new_admin_session` (``flare_api.new_secure_session`` from an admin kit),
  :func:`wait_for_clients`, :func:`run_job` (submit, wait, download), :func:`find_results`.
* clean-up: :func:`workspace_processes` / :func:`kill_workspace_processes` find and end every
  process whose command line names a state folder (no broad ``pkill``).

Command line (used by the shell scripts)::

    python -m fedpartial_tools.deploy poc-project --sites 3 --port 8102 --out STATE/project.yml
    python -m fedpartial_tools.deploy run-job --admin-kit KIT --job JOBDIR --out DIR [--timeout S] [--json]
    python -m fedpartial_tools.deploy results DIR          # where global_model.pt / metrics.json are
    python -m fedpartial_tools.deploy resource-spec JOBDIR --gpus 1 --gpu-mem 8
    python -m fedpartial_tools.deploy admin-kit PROD_DIR --role project_admin
    python -m fedpartial_tools.deploy job-task JOBDIR | data-overrides DATA_ROOT
    python -m fedpartial_tools.deploy stop-leftovers ROOT  # end processes naming ROOT; rc 1 if any survive
    python -m fedpartial_tools.deploy build-runtime --out DIR   # DIR/fedpartial_runtime-<version>-py3-none-any.whl
    python -m fedpartial_tools.deploy docker-project provisioning/project.yml --out project_docker.yml
    python -m fedpartial_tools.deploy wait-sites PROD_DIR [--timeout S]   # until the server lists every site
    python -m fedpartial_tools.deploy cert-expiry KIT_OR_WORKSPACE [--warn-days 30]  # rc 1 if one is due
    python -m fedpartial_tools.deploy renew-certs WORKSPACE PROJECT_YML NAME... | all
    python -m fedpartial_tools.deploy join-ca WORKSPACE PROJECT_YML   # root CA folder for 'nvflare cert approve'
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

# Admin users of the one-machine projects; roles decide rights (authorization.json.default):
# project_admin = everything; lead = submit / manage own jobs, byoc; org_admin = manage own org's
# sites, may not submit jobs and has no byoc right.
DEFAULT_ADMINS = (("admin@hospital-a.org", "hospital_a", "project_admin"),
                  ("lead@hospital-a.org", "hospital_a", "lead"),
                  ("orgadmin@hospital-b.org", "hospital_b", "org_admin"))
TERMINAL_PREFIX = "FINISHED"
SITE_POLICY_BUILDER = "fedpartial_tools.provision_builders.SitePolicyBuilder"
# the folder holding fedpartial_tools: on PYTHONPATH for `nvflare provision` (it imports the builder)
TOOLS_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Root CA validity of the projects provisioned here (as provisioning/project*.yml); FLARE's default is 360
# days, which also caps every participant's certificate, so renewing a site's kit could not go past it.
ROOT_VALID_DAYS = 3650


def nvflare_cmd() -> List[str]:
    """``nvflare`` of the running interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "nvflare.cli"]


def free_port() -> int:
    """A TCP port nobody listens on right now (for parallel one-machine systems)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def site_list(num_sites: int) -> List[str]:
    if num_sites < 1:
        raise ValueError(f"number of sites must be >= 1, got {num_sites}")
    return [f"site-{i}" for i in range(1, num_sites + 1)]


def localhost_project(name: str, port: int, sites: Sequence[str], server_name: str = "localhost",
                      admins: Sequence[Sequence[str]] = DEFAULT_ADMINS, site_org: str = "hospital",
                      site_policy: Optional[dict] = None, root_valid_days: int = ROOT_VALID_DAYS) -> dict:
    """A one-machine project (same layout as ``provisioning/project_localhost.yml``).

    Args:
        name: project name (also the CN of the root CA).
        port: the server's single port (FL + admin traffic).
        sites: client names, e.g. ``["site-1", "site-2"]``; site i gets org ``{site_org}_{letter}``.
        server_name: ``localhost`` for provisioned kits (clients connect to this name). POC
            projects use ``server`` with ``default_host: localhost``.
        admins: ``(email, org, role)`` triples.
        site_org: prefix of the sites' organisation names.
        site_policy: args of :class:`fedpartial_tools.provision_builders.SitePolicyBuilder` (e.g.
            ``{"allow_byoc": False}``: installed runtime, no code with jobs); ``None`` = FLARE's default
            policy (byoc jobs allowed, as in POC).
        root_valid_days: validity of the root CA (only when first created; participants' certificates
            are valid 360 days, never beyond the root CA).
    """
    server = {"name": server_name, "type": "server", "org": "hospital_a", "fed_learn_port": int(port)}
    if server_name != "localhost":
        server["default_host"] = "localhost"
    participants = [server]
    for i, site in enumerate(sites):
        participants.append({"name": site, "type": "client", "org": f"{site_org}_{chr(ord('a') + i % 26)}"})
    for email, org, role in admins:
        participants.append({"name": email, "type": "admin", "org": org, "role": role})
    builders = [
        {"path": "nvflare.lighter.impl.workspace.WorkspaceBuilder", "args": {"template_file": ["master_template.yml"]}},
        {"path": "nvflare.lighter.impl.static_file.StaticFileBuilder", "args": {"config_folder": "config"}},
        {"path": "nvflare.lighter.impl.cert.CertBuilder", "args": {"root_valid_days": int(root_valid_days)}},
        {"path": "nvflare.lighter.impl.signature.SignatureBuilder"},
    ]
    if site_policy is not None:
        builders.insert(2, {"path": SITE_POLICY_BUILDER, "args": dict(site_policy)})
    return {
        "api_version": 3,
        "name": name,
        "description": "fedpartial one-machine project",
        "participants": participants,
        "builders": builders,
    }


def write_project(path: str, project: dict) -> str:
    """Write a project dict as YAML (``nvflare`` depends on PyYAML)."""
    import yaml

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(project, f, sort_keys=False)
    return path


def kit_env(state_dir: str, base: Optional[dict] = None) -> Dict[str, str]:
    """Environment for nvflare commands and kits: HOME and TMPDIR inside ``state_dir`` (nvflare keeps
    ``~/.nvflare/config.conf``, torch its caches there) and this interpreter's folder first on PATH
    (``sub_start.sh`` runs ``python3`` from PATH)."""
    env = dict(os.environ if base is None else base)
    home, tmp = os.path.join(state_dir, "home"), os.path.join(state_dir, "tmp")
    os.makedirs(home, exist_ok=True)
    os.makedirs(tmp, exist_ok=True)
    env.update(HOME=home, TMPDIR=tmp, PYTHONUNBUFFERED="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("NVFLARE_STARTUP_KIT_DIR", None)
    return env


def provision(project_file: str, workspace: str, env: Optional[dict] = None, timeout: float = 120) -> str:
    """``nvflare provision -p project_file -w workspace``; returns the new ``prod_NN`` folder.

    Re-running it on the same workspace keeps ``<workspace>/<project>/state/cert.json`` (root CA and
    key), so kits of a later run (e.g. a site added) trust and are trusted by the earlier ones.
    """
    cmd = nvflare_cmd() + ["provision", "-p", os.path.abspath(project_file), "-w", os.path.abspath(workspace),
                           "--force"]
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TOOLS_ROOT, env.get("PYTHONPATH", "")) if p)
    # from the project file's folder, as provisioning/provision.sh: relative paths in it are read from there
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                         cwd=os.path.dirname(os.path.abspath(project_file)))
    if res.returncode != 0:
        raise RuntimeError(f"'{' '.join(cmd)}' failed (exit {res.returncode}):\n{res.stdout}\n{res.stderr}")
    import yaml

    name = yaml.safe_load(open(project_file))["name"]
    return latest_prod_dir(workspace, name)


def latest_prod_dir(workspace: str, project_name: str) -> str:
    prods = sorted(glob.glob(os.path.join(workspace, project_name, "prod_*")))
    if not prods:
        raise FileNotFoundError(f"no {workspace}/{project_name}/prod_* folder: provisioning produced no kits")
    return prods[-1]


def keep_server_storage_in(server_kit: str, root: str) -> str:
    """Point the server's job store and snapshot store (default ``/tmp/nvflare/...``) into ``root``:
    writes ``local/resources.json`` from ``local/resources.json.default``. Returns the file written."""
    local = os.path.join(server_kit, "local")
    src = os.path.join(local, "resources.json")
    if not os.path.isfile(src):
        src += ".default"
    text = open(src).read().replace("/tmp/nvflare", os.path.abspath(root))
    out = os.path.join(local, "resources.json")
    with open(out, "w") as f:
        f.write(text)
    return out


def start_kit(kit_dir: str, log_path: str, env: Optional[dict] = None) -> subprocess.Popen:
    """Start a server / client kit with ``startup/sub_start.sh --once`` (no restart loop) in its own
    session, so ``os.killpg(proc.pid, ...)`` ends it and every child."""
    script = os.path.join(kit_dir, "startup", "sub_start.sh")
    if not os.path.isfile(script):
        raise FileNotFoundError(f"'{kit_dir}' is not a server/client startup kit (no startup/sub_start.sh)")
    out = open(log_path, "ab")
    try:
        return subprocess.Popen(["bash", script, "--once"], cwd=kit_dir, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        out.close()


def stop_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, the process group of ``proc`` (started with start_new_session)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            # the leader is gone; children of the group may still be there: kill them too
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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

    from fedpartial_tools.jobtools import check_min_clients

    started = time.time()
    if check_sites:
        check_min_clients(job_dir, sorted(c.name for c in session.get_connected_client_list()),
                          what="the server lists")
    job_id = session.submit_job(os.path.abspath(job_dir))
    log(f"submitted {os.path.basename(job_dir.rstrip('/'))} as job {job_id}; waiting"
        + (f" (timeout {timeout:.0f} s)" if timeout else ""))
    on_poll = None
    if server_dir:
        from fedpartial_tools.jobtools import RoundProgress, _config_paths

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


def set_resource_spec(job_dir: str, sites: Sequence[str], gpus: int, gpu_mem_gib: float = 0) -> dict:
    """Write ``resource_spec`` of a job's meta.json: each site needs ``gpus`` GPUs with
    ``gpu_mem_gib`` GiB. ``gpus=0`` clears it (``{}``: runs on CPU-only sites).

    A site whose resource manager has fewer GPUs (every kit defaults to ``num_of_gpus: 0``; set
    ``capacity`` in project.yml) makes the scheduler hold the job as SUBMITTED and retry with
    back-off (10 tries, ~30 min) before it ends FINISHED_CANT_SCHEDULE.
    """
    path = os.path.join(job_dir, "meta.json")
    meta = json.load(open(path))
    meta["resource_spec"] = ({} if gpus <= 0 else
                             {s: {"num_of_gpus": int(gpus), "mem_per_gpu_in_GiB": gpu_mem_gib} for s in sites})
    with open(path, "w") as f:
        json.dump(meta, f, indent=2)
    return meta["resource_spec"]


def job_model(job_dir: str) -> dict:
    """The ``model`` block of a job's server config (arch, task, class_names, in_channels...)."""
    found = glob.glob(os.path.join(job_dir, "*", "config", "config_fed_server.json"))
    if not found:
        raise FileNotFoundError(f"job '{job_dir}' has no */config/config_fed_server.json")
    model = json.load(open(found[0])).get("model")
    if not isinstance(model, dict):
        raise ValueError(f"'{found[0]}' has no 'model' block")
    return model


def demo_data(job_dir: str, out_dir: str, sites: int, shared_data: str = "") -> str:
    """Site files for the demo of ``job_dir``: HAM10000 from ``../shared/data`` for single-label
    jobs when it is there, else the built-in synthetic data; the scenario follows the method.
    Returns the source ``.npz`` (its test split is what the demo evaluates on)."""
    from fedpartial_tools import synthetic
    from fedpartial.data.npz import save_npz
    from fedpartial_tools.partition import split_file

    task = job_model(job_dir).get("task", "multi-label")
    name = os.path.basename(os.path.abspath(job_dir))
    shared_data = shared_data or os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "..", "shared", "data")
    ham = os.path.abspath(os.path.join(shared_data, "ham10000_28.npz"))
    os.makedirs(out_dir, exist_ok=True)
    if task == "single-label" and os.path.isfile(ham) and sites >= 3:
        source, num_classes, per_site = ham, 7, 3
    else:
        source, num_classes, per_site = os.path.join(out_dir, "source.npz"), 5, 2
        data = (synthetic.make_segmentation(seed=0) if task == "segmentation"
                else synthetic.make_classification(task=task, num_classes=num_classes, seed=0))
        save_npz(data, source)
    if task == "segmentation":
        options = {"scenario": "incomplete-masks", "completeness": [(0.4, 0.7, 1.0)[k % 3] for k in range(sites)]}
    elif name.startswith("fedirm"):
        options = {"scenario": "semi-supervised", "labelled_sites": max(1, sites // 3)}
    elif name.startswith("fedmlp"):
        options = {"scenario": "missing-classes", "missing_per_site": 2}
    else:
        options = {"scenario": "label-set-mismatch", "classes_per_site": max(per_site, -(-num_classes // sites))}
    scenario = options.pop("scenario")
    split_file(source, scenario, sites=sites, seed=0, out=os.path.join(out_dir, "sites"), **options)
    return source


# ---------------------------------------------------------------- installed runtime

RUNTIME_DIST = "fedpartial_runtime"


def build_runtime(out_dir: str, timeout: float = 300) -> str:
    """Build the runtime wheel: the package ``fedpartial`` alone (what sites and the server execute;
    not ``fedpartial_tools``, not the ``python -m fedpartial`` shim), version ``fedpartial.__version__``,
    the runtime dependencies of ``pyproject.toml``. Returns the wheel's path.

    Uses ``pip wheel --no-build-isolation`` with this interpreter's setuptools (no download).

    Args:
        out_dir: folder for the wheel (created).
        timeout: seconds for the build.
    """
    import tempfile

    import fedpartial
    from fedpartial_tools.jobtools import NOT_SHIPPED

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(repo, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    version = fedpartial.__version__
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as stage:
        shutil.copytree(os.path.dirname(os.path.abspath(fedpartial.__file__)), os.path.join(stage, "fedpartial"),
                        ignore=shutil.ignore_patterns(*NOT_SHIPPED))
        deps = ", ".join(json.dumps(d) for d in project.get("dependencies", []))
        with open(os.path.join(stage, "pyproject.toml"), "w") as f:
            f.write(f"""[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{RUNTIME_DIST}"
version = "{version}"
description = "fedpartial runtime (executors, aggregators, persistor, methods) for FLARE sites and server"
requires-python = {json.dumps(project.get("requires-python", ">=3.10"))}
dependencies = [{deps}]

[tool.setuptools.packages.find]
include = ["fedpartial", "fedpartial.*"]
""")
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
               "-w", os.path.abspath(out_dir), stage]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=stage)
        if res.returncode != 0:
            raise RuntimeError(f"building the runtime wheel failed (exit {res.returncode}):\n{res.stdout}\n{res.stderr}")
    wheel = os.path.join(os.path.abspath(out_dir), f"{RUNTIME_DIST}-{version}-py3-none-any.whl")
    if not os.path.isfile(wheel):
        raise RuntimeError(f"pip wheel succeeded but wrote no '{wheel}'; found {os.listdir(out_dir)}")
    return wheel


DOCKER_BUILDER = "nvflare.lighter.impl.docker.DockerBuilder"
STATIC_FILE_BUILDER = "nvflare.lighter.impl.static_file.StaticFileBuilder"


def docker_project(project: dict, image: str, requirements_file: str = "", project_dir: str = "") -> dict:
    """``project`` (a project.yml dict) with NVFlare's container outputs switched on for ``image``
    (built by ``docker/build.sh``):

    * ``StaticFileBuilder`` ``docker_image``: every server / site / admin kit gets
      ``startup/docker.sh`` (``docker run`` of the image with the kit mounted at /workspace,
      a site's data at /data read-only);
    * ``DockerBuilder`` with ``base_image`` = ``image``: ``prod_NN/compose.yaml`` (one service per
      server and site, each kit mounted as a volume), ``prod_NN/.env`` and
      ``prod_NN/nvflare_compose/Dockerfile`` (``FROM image``).

    Args:
        project: the project dict (not changed).
        image: the fedpartial image, e.g. ``fedpartial:0.1.0``.
        requirements_file: extra packages for ``nvflare_compose/`` ("" = none: the image has the stack).
        project_dir: the folder of the project file, against which its relative ``privacy_file`` is
            made absolute (the derived file may be written elsewhere); "" = leave paths as they are.
    """
    import copy

    out = copy.deepcopy(project)
    builders = out.get("builders") or []
    for b in builders:
        privacy = (b.get("args") or {}).get("privacy_file") if b.get("path") == SITE_POLICY_BUILDER else None
        if privacy and project_dir and not os.path.isabs(privacy):
            b["args"]["privacy_file"] = os.path.abspath(os.path.join(project_dir, privacy))
    static = [b for b in builders if b.get("path") == STATIC_FILE_BUILDER]
    if not static:
        raise ValueError(f"project '{out.get('name')}' has no {STATIC_FILE_BUILDER} among its builders")
    static[0].setdefault("args", {})["docker_image"] = image
    builders[:] = [b for b in builders if b.get("path") != DOCKER_BUILDER]
    builders.insert(builders.index(static[0]) + 1,
                    {"path": DOCKER_BUILDER, "args": {"base_image": image, "requirements_file": requirements_file}})
    return out


# ---------------------------------------------------------------- processes

def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _own_lineage() -> set:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        pid = _ppid(pid)
    return pids


def workspace_processes(root: str) -> Dict[int, str]:
    """FLARE processes (pid -> command line) whose command line names a path under ``root``, plus their
    descendants (e.g. the ``sleep`` of a ``sub_start.sh`` loop). Never this process or its parents."""
    root = os.path.abspath(root).rstrip("/")
    mine = _own_lineage()
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    parents = {p: _ppid(p) for p in pids}

    def names_root(cmd: str) -> bool:
        # only FLARE processes (python -m nvflare..., startup/sub_start.sh): never a user's editor or tail
        if "nvflare" not in cmd and "/startup/" not in cmd:
            return False
        cmd += " "
        return (root + "/") in cmd or (root + " ") in cmd

    found = {p: _cmdline(p) for p in pids if p not in mine and names_root(_cmdline(p))}
    grew = True
    while grew:
        grew = False
        for p, pp in parents.items():
            if pp in found and p not in found and p not in mine:
                found[p] = _cmdline(p)
                grew = True
    return {p: c for p, c in found.items() if c or os.path.exists(f"/proc/{p}")}


def kill_workspace_processes(root: str, wait: float = 0.0, grace: float = 3.0) -> Dict[int, str]:
    """Wait up to ``wait`` s for the processes of ``root`` to end by themselves, then SIGKILL what is
    left (all at once, so a ``sub_start.sh`` loop cannot restart its child). Returns the processes
    that had to be killed."""
    deadline = time.time() + wait
    left = workspace_processes(root)
    while left and time.time() < deadline:
        time.sleep(0.5)
        left = workspace_processes(root)
    killed = dict(left)
    for _ in range(3):
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.time() + grace
        while time.time() < end:
            left = {p: c for p, c in workspace_processes(root).items() if not _is_zombie(p)}
            if not left:
                break
            time.sleep(0.2)
    return killed


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def live_workspace_processes(root: str) -> Dict[int, str]:
    return {p: c for p, c in workspace_processes(root).items() if not _is_zombie(p)}


# ---------------------------------------------------------------- command line

def _cmd_poc_project(args):
    sites = args.site_names.split(",") if args.site_names else site_list(args.sites)
    project = localhost_project(args.name, args.port or free_port(), sites, server_name="server")
    write_project(args.out, project)
    print(args.out)


def _cmd_localhost_project(args):
    sites = args.site_names.split(",") if args.site_names else site_list(args.sites)
    write_project(args.out, localhost_project(args.name, args.port or free_port(), sites))
    print(args.out)


def _cmd_run_job(args):
    import contextlib

    # with --json stdout is the JSON alone: nvflare's "Connecting to FLARE ..." and progress go to stderr
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    with contextlib.redirect_stdout(sys.stderr):
        session = new_admin_session(args.admin_kit, timeout=args.connect_timeout)
    try:
        result = run_job(session, args.job, args.out, timeout=args.timeout, log=say,
                         server_dir=args.server_dir or None, check_sites=not args.allow_waiting)
    finally:
        session.close()
    if args.latest_link:  # OUT/latest -> the newest result of this job
        link = os.path.join(args.out, "latest")
        if os.path.islink(link):
            os.remove(link)
        os.symlink(result["job_id"], link)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        say(f"job {result['job_id']}: {result['status']}; result in {result['result_dir']}")
        for key in ("result_model", "global_model", "best_global_model", "metrics", "cross_site_val", "tensorboard",
                    "server_log"):
            say(f"  {key + ':':18s} {result.get(key) or '-'}")
    if not str(result["status"]).endswith("COMPLETED") or not result["global_model"]:
        print(f"error: job {result['job_id']} ended {result['status']}; server log: {result['server_log']}",
              file=sys.stderr)
        raise SystemExit(1)


def _cmd_results(args):
    print(json.dumps(find_results(args.dir), indent=1))


def _cmd_resource_spec(args):
    meta = json.load(open(os.path.join(args.job, "meta.json")))
    sites = args.site_names.split(",") if args.site_names else None
    if not sites:
        sites = site_list(int(meta.get("min_clients", 2)))
    print(json.dumps(set_resource_spec(args.job, sites, args.gpus, args.gpu_mem)))


def _cmd_admin_kit(args):
    kits = [k for k, role in admin_kits(args.prod_dir).items() if role == args.role]
    if not kits:
        raise FileNotFoundError(f"no admin kit with role '{args.role}' in '{args.prod_dir}'")
    print(kits[0])


def _cmd_job_task(args):
    print(job_model(args.job).get("task", ""))


def _cmd_demo_data(args):
    print(demo_data(args.job, args.out, args.sites))


def _cmd_data_overrides(args):
    from fedpartial_tools.jobtools import dataset_overrides

    print("\n".join(dataset_overrides(args.data_root)))


def _cmd_progress(args):
    from fedpartial_tools.jobtools import RoundProgress, _config_paths

    config = json.load(open(_config_paths(args.job)["server"]))
    progress = RoundProgress(int(config.get("num_rounds", 0)), str(config.get("key_metric", "")),
                             log=lambda m: print(m, flush=True))
    while True:
        progress.update(args.metrics if os.path.isfile(args.metrics) else None)
        if args.while_pid and not os.path.exists(f"/proc/{args.while_pid}") or \
                progress.rounds_done >= progress.num_rounds:
            break
        time.sleep(args.every)


def _cmd_stop_leftovers(args):
    killed = kill_workspace_processes(args.root, wait=args.wait)
    for pid, cmd in sorted(killed.items()):
        print(f"killed leftover {pid}: {cmd[:160]}", file=sys.stderr)
    left = live_workspace_processes(args.root)
    if left:
        for pid, cmd in sorted(left.items()):
            print(f"error: still running {pid}: {cmd[:160]}", file=sys.stderr)
        raise SystemExit(1)
    print(f"no process of {os.path.abspath(args.root)} is running")


def _cmd_docker_project(args):
    import yaml

    import fedpartial

    with open(args.project) as f:
        project = yaml.safe_load(f)
    write_project(args.out, docker_project(project, args.image or f"fedpartial:{fedpartial.__version__}",
                                           project_dir=os.path.dirname(os.path.abspath(args.project))))
    print(args.out)


def _cmd_build_runtime(args):
    print(build_runtime(args.out))
def _cmd_wait_sites(args):
    sites = args.site_names.split(",") if args.site_names else kit_sites(args.prod_dir)
    if not sites:
        raise FileNotFoundError(f"no site kit (startup/fed_client.json) in '{args.prod_dir}'")
    kit = args.admin_kit or next((k for k, r in admin_kits(args.prod_dir).items() if r == "project_admin"), None)
    if not kit:
        raise FileNotFoundError(f"no project_admin kit in '{args.prod_dir}'; pass --admin-kit")
    import contextlib

    started = time.time()
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # nvflare's "Connecting to FLARE ..."
        session = new_admin_session(kit, timeout=args.timeout)
    try:
        connected = wait_for_clients(session, sites, timeout=max(1.0, args.timeout - (time.time() - started)))
    finally:
        session.close()
    print(f"server lists all {len(sites)} site(s) after {time.time() - started:.0f} s: {', '.join(connected)}")


def _cmd_cert_expiry(args):
    from fedpartial_tools.certs import expiry_report, format_report

    rows = expiry_report(args.path, args.warn_days)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_report(rows, args.warn_days))
    if any(r["status"] != "ok" for r in rows):
        raise SystemExit(1)


def _project_name(project_yml: str) -> str:
    import yaml

    return yaml.safe_load(open(project_yml))["name"]


def _cmd_renew_certs(args):
    from fedpartial_tools.certs import renew

    names = renew(args.workspace, _project_name(args.project), args.names)
    print(f"new keys and certificates for {', '.join(names)} at the next provisioning of {args.workspace} "
          f"(same root CA)")


def _cmd_join_ca(args):
    from fedpartial_tools.certs import export_ca_dir

    project = _project_name(args.project)
    prod = latest_prod_dir(args.workspace, project)
    servers = glob.glob(os.path.join(prod, "*", "startup", "fed_server.json"))
    if not servers:
        raise FileNotFoundError(f"no server kit in '{prod}'")
    out = export_ca_dir(os.path.abspath(args.workspace), project, os.path.dirname(os.path.dirname(servers[0])))
    print(json.dumps(out, indent=1))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedpartial_tools.deploy", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for cmd, fn, what in (("poc-project", _cmd_poc_project, "project.yml for 'nvflare poc prepare -i'"),
                          ("localhost-project", _cmd_localhost_project, "one-machine project.yml to provision")):
        s = sub.add_parser(cmd, help=what)
        s.add_argument("--sites", type=int, default=2)
        s.add_argument("--site-names", default="", help="comma-separated names (instead of --sites)")
        s.add_argument("--port", type=int, default=0, help="server port (0 = a free one)")
        s.add_argument("--name", default="fedpartial")
        s.add_argument("--out", required=True)
        s.set_defaults(func=fn)
    s = sub.add_parser("run-job", help="submit a job folder, wait, download the result (admin API)")
    s.add_argument("--admin-kit", required=True, help="admin startup kit folder (project_admin or lead)")
    s.add_argument("--job", required=True, help="submit-ready job folder")
    s.add_argument("--out", required=True, help="download folder")
    s.add_argument("--timeout", type=float, default=0, help="seconds (0 = no limit); the job is aborted after")
    s.add_argument("--connect-timeout", type=float, default=30)
    s.add_argument("--server-dir", default="", help="the server's workspace if on this machine (POC): "
                                                    "progress lines from its metrics.json")
    s.add_argument("--latest-link", action="store_true", help="point OUT/latest at this result")
    s.add_argument("--allow-waiting", action="store_true",
                   help="submit even when the job's min_clients exceeds the sites connected now (it waits in "
                        "SUBMITTED until they connect); refused by default")
    s.add_argument("--json", action="store_true", help="print the result as JSON (progress on stderr)")
    s.set_defaults(func=_cmd_run_job)
    s = sub.add_parser("results", help="where the outputs of a downloaded job are")
    s.add_argument("dir")
    s.set_defaults(func=_cmd_results)
    s = sub.add_parser("resource-spec", help="set the GPU resource_spec of a packaged job's meta.json")
    s.add_argument("job")
    s.add_argument("--gpus", type=int, required=True, help="GPUs per site (0 = none: CPU sites accept the job)")
    s.add_argument("--gpu-mem", type=float, default=0, help="GiB per GPU")
    s.add_argument("--site-names", default="", help="comma-separated (default site-1..site-<min_clients>)")
    s.set_defaults(func=_cmd_resource_spec)
    s = sub.add_parser("job-task", help="print the task (single-label | multi-label | segmentation) of a job")
    s.add_argument("job")
    s.set_defaults(func=_cmd_job_task)
    s = sub.add_parser("demo-data", help="make the demo's site files in OUT/sites; print the source .npz")
    s.add_argument("job")
    s.add_argument("--out", required=True)
    s.add_argument("--sites", type=int, default=3)
    s.set_defaults(func=_cmd_demo_data)
    s = sub.add_parser("data-overrides", help="print key=value settings fitting a job's model to site files")
    s.add_argument("data_root")
    s.set_defaults(func=_cmd_data_overrides)
    s = sub.add_parser("admin-kit", help="print the first admin kit of a prod_NN folder with a role")
    s.add_argument("prod_dir")
    s.add_argument("--role", default="project_admin", help="project_admin | lead | org_admin | member")
    s.set_defaults(func=_cmd_admin_kit)
    s = sub.add_parser("progress", help="print round k/N, the key metric and time left from a server's "
                                        "metrics.json until the job's rounds are done or PID ends")
    s.add_argument("--job", required=True, help="the packaged job folder (for num_rounds and key_metric)")
    s.add_argument("--metrics", required=True, help="the server's <job id>/metrics.json (may not exist yet)")
    s.add_argument("--while-pid", type=int, default=0, help="stop when this process has ended")
    s.add_argument("--every", type=float, default=3.0, help="seconds between looks")
    s.set_defaults(func=_cmd_progress)
    s = sub.add_parser("build-runtime", help="build the versioned runtime wheel (package fedpartial only) that "
                                             "every site and the server install")
    s.add_argument("--out", required=True, help="folder for fedpartial_runtime-<version>-py3-none-any.whl")
    s.set_defaults(func=_cmd_build_runtime)
    s = sub.add_parser("docker-project", help="a project.yml whose kits get docker.sh and the provisioning "
                                              "compose.yaml for the fedpartial image")
    s.add_argument("project", help="e.g. provisioning/project.yml")
    s.add_argument("--image", default="", help="default fedpartial:<fedpartial.__version__> (docker/build.sh)")
    s.add_argument("--out", required=True, help="the project file to write (provision it like the original)")
    s.set_defaults(func=_cmd_docker_project)
    s = sub.add_parser("stop-leftovers", help="end every process naming ROOT; exit 1 if one survives")
    s.add_argument("root")
    s.add_argument("--wait", type=float, default=0, help="seconds to let them exit by themselves first")
    s.set_defaults(func=_cmd_stop_leftovers)
    s = sub.add_parser("wait-sites", help="wait until the server lists every site kit of PROD_DIR (admin API)")
    s.add_argument("prod_dir")
    s.add_argument("--site-names", default="", help="comma-separated (default: every site kit of PROD_DIR)")
    s.add_argument("--admin-kit", default="", help="default: the project_admin kit of PROD_DIR")
    s.add_argument("--timeout", type=float, default=120, help="seconds; exit 2 when a site is still missing")
    s.set_defaults(func=_cmd_wait_sites)
    s = sub.add_parser("cert-expiry", help="expiry of every kit's certificate and the root CA; exit 1 when one "
                                           "is expired or has fewer than --warn-days left")
    s.add_argument("path", help="a startup kit, a prod_NN folder or a provisioning workspace")
    s.add_argument("--warn-days", type=float, default=30)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_cert_expiry)
    s = sub.add_parser("renew-certs", help="make the next provisioning of WORKSPACE issue new certificates for "
                                           "NAMES (same root CA); then run provisioning/provision.sh")
    s.add_argument("workspace")
    s.add_argument("project", help="the project.yml provisioned into WORKSPACE")
    s.add_argument("names", nargs="+", help="participant names, or 'all'")
    s.set_defaults(func=_cmd_renew_certs)
    s = sub.add_parser("join-ca", help="write WORKSPACE's root CA as 'nvflare cert approve' reads it (-c DIR, "
                                       "--profile FILE); print both and the root CA fingerprint")
    s.add_argument("workspace")
    s.add_argument("project", help="the project.yml provisioned into WORKSPACE")
    s.set_defaults(func=_cmd_join_ca)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
