"""End-to-end: the installed-runtime production path on a provisioned one-machine system (mutual TLS).

The runtime wheel is built (``build-runtime``) and installed with ``pip install --no-deps --target``
into a folder on the kits' PYTHONPATH; a ``sitecustomize`` hides every source checkout (the
editable install's ``custom/``), so the kits cannot import ``fedpartial_tools`` and the site and
server logs show ``fedpartial`` imported from the installed folder. Kits are provisioned with
``SitePolicyBuilder(allow_byoc=False)``. Then:

* a job packaged with ``--installed-runtime`` (no ``app/custom``) completes, run by the lead;
* the same job with its code in ``app/custom`` is refused (no role has the byoc right), even for
  the project admin;
* a job naming another runtime version for the sites fails at its start, with both versions in
  each site's log.

One system is shared by the module; a finalizer kills every process it started.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fedpartial
from fedpartial.flare.common import runtime_identity
from fedpartial_tools import admin, processes, provision
from fedpartial_tools.jobtools import package_job

from test_provisioned import CLASSES, _write_sites

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.filterwarnings("ignore:ssl_context is deprecated:DeprecationWarning"),
              pytest.mark.xdist_group("deployment")]
SITES = ["site-1", "site-2"]
DATASET = "demo"  # the name each site's kit offers its site files under (local/fedpartial_site.json)
OTHER_VERSION = "0.0.0.dev7"  # any version but the installed one
# Loaded by every kit process: drops each source checkout (a folder holding fedpartial_tools, such as
# the custom/ an editable install puts on sys.path) so only the installed wheel can provide fedpartial.
HIDE_CHECKOUTS = """
import os, sys
sys.path[:] = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "fedpartial_tools"))]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
"""
OVERRIDES = ["num_rounds=1", "server.min_clients=2", f"model.class_names={json.dumps(CLASSES)}",
             "model.input_size=[16,16]", "model.in_channels=3", "model.arch_args.width=8",
             "rule_args.batch_size=16", "device=cpu"]


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    from test_provisioned import System

    root = tmp_path_factory.mktemp("installed_runtime")
    wheel = provision.build_runtime(str(root / "wheel"))
    runtime = root / "runtime"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                    str(runtime), wheel], check=True, capture_output=True, timeout=120)
    hook = root / "hide_checkouts"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HIDE_CHECKOUTS)
    env = provision.kit_env(str(root))
    env["PYTHONPATH"] = os.pathsep.join([str(hook), str(runtime)])  # the installed runtime, no checkout
    data_root = root / "sites"
    data_root.mkdir()
    _write_sites(data_root, np.random.default_rng(0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", env["HOME"])
        mp.setenv("TMPDIR", env["TMPDIR"])
        mp.delenv("NVFLARE_STARTUP_KIT_DIR", raising=False)
        project = provision.localhost_project("fedpartial_rt", provision.free_port(), SITES,
                                              site_policy={"allow_byoc": False,
                                                           "datasets": {DATASET: str(data_root)}})
        prod = Path(provision.provision(provision.write_project(str(root / "project.yml"), project),
                                        str(root / "provision"), env=provision.kit_env(str(root))))
        server = prod / "localhost"
        # The coordinating centre's server keeps FLARE's default (byoc allowed): each hospital's
        # site must refuse code on its own policy, whatever the server permits.
        (server / "local" / "authorization.json").write_text(
            (server / "local" / "authorization.json.default").read_text())
        provision.keep_server_storage_in(str(server), str(root / "storage"))
        sys_ = System(root, env)
        try:
            sys_.start(server, "server")
            kits = {role: kit for kit, role in admin.admin_kits(str(prod)).items()}
            session = admin.new_admin_session(kits["project_admin"], timeout=60)
            for site in SITES:
                sys_.start(prod / site, site)
            admin.wait_for_clients(session, SITES, timeout=90)
            session.close()
            yield {"root": root, "prod": prod, "kits": kits, "runtime": runtime, "data_root": data_root,
                   "wheel": wheel}
        finally:
            sys_.close()
            left = processes.live_workspace_processes(str(root))
            assert not left, f"processes left behind: {left}"


def _run(system, kit_role, job, out):
    session = admin.new_admin_session(system["kits"][kit_role])
    try:
        return admin.run_job(session, str(job), str(out), timeout=240, log=lambda m: None)
    finally:
        session.close()


def _site_log(system, site, job_id) -> str:
    path = system["prod"] / site / job_id / "log.txt"
    return path.read_text() if path.is_file() else ""


@pytest.mark.slow
def test_job_without_code_runs_on_the_installed_runtime(system, tmp_path):
    from fedpartial.models.io import load_model_file

    job = Path(package_job(str(REPO / "jobs" / "fedavg"), str(tmp_path / "fedavg"), OVERRIDES,
                           dataset=DATASET, with_code=False))
    assert not list(job.glob("*/custom")), "an installed-runtime job carries no code"
    client = json.loads((job / "app" / "config" / "config_fed_client.json").read_text())
    assert client["executors"][0]["executor"]["args"]["runtime_version"] == runtime_identity()
    result = _run(system, "lead", job, tmp_path / "download")
    assert result["status"] == "FINISHED:COMPLETED", f"job ended {result['status']}; log {result['server_log']}"
    _, meta = load_model_file(result["global_model"])
    assert list(meta["class_names"]) == CLASSES
    assert [r["round"] for r in json.loads(Path(result["metrics"]).read_text())["rounds"]] == [0]
    # every participant ran the wheel's code from the installed folder, not the repository's custom/
    installed = f"fedpartial {runtime_identity()} from {system['runtime'] / 'fedpartial'}"
    assert installed in Path(result["server_log"]).read_text()
    for site in SITES:
        assert installed in _site_log(system, site, result["job_id"]), f"{site} did not run the installed runtime"


@pytest.mark.slow
def test_job_carrying_code_is_refused_by_the_sites(system, tmp_path):
    job = Path(package_job(str(REPO / "jobs" / "fedavg"), str(tmp_path / "fedavg_code"), OVERRIDES,
                           dataset=DATASET, with_code=True))
    assert (job / "app" / "custom" / "fedpartial").is_dir()
    result = _run(system, "project_admin", job, tmp_path / "download")
    assert result["status"] == "FINISHED:FAILED_TO_RUN" and not result["global_model"]
    # the server deployed it (its policy allows code); each site refused it on its own policy
    refusal = [line for line in (system["prod"] / "localhost" / "log.txt").read_text().splitlines()
               if result["job_id"] in line and "deploy failure" in line]
    assert refusal, f"no deploy failure logged by the server for job {result['job_id']}"
    assert "'server: OK'" in refusal[0]
    for site in SITES:
        assert f"'{site}: NVFLARE_ERROR: BYOC not permitted'" in refusal[0], refusal[0]


@pytest.mark.slow
def test_sites_refuse_a_job_for_another_runtime_version(system, tmp_path):
    """The sites' check (the server's, same message, is tested in test_flare_components): the job
    names another version for the sites only, so their refusal is what stops it."""
    from fedpartial_tools.jobtools import set_runtime_version

    job = Path(package_job(str(REPO / "jobs" / "fedavg"), str(tmp_path / "fedavg_other"), OVERRIDES,
                           dataset=DATASET, with_code=False))
    client_file = job / "app" / "config" / "config_fed_client.json"
    client = json.loads(client_file.read_text())
    assert set_runtime_version({"client": client}, OTHER_VERSION) == 1
    client_file.write_text(json.dumps(client))
    result = _run(system, "lead", job, tmp_path / "download")
    assert result["status"] == "FINISHED:EXECUTION_EXCEPTION" and not result["global_model"], result["status"]
    for site in SITES:
        assert (f"site set-up failed: the job needs fedpartial runtime {OTHER_VERSION} but site '{site}' has "
                f"fedpartial {runtime_identity()} installed") in _site_log(system, site, result["job_id"])
    # the server stopped the job on the first site's failed train task
    assert "peer_rc=EXECUTION_EXCEPTION, task_name=train" in Path(result["server_log"]).read_text()
