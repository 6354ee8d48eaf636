"""End-to-end: what a hospital installs, on a wheel-only machine (docs/DEPLOYMENT.md §2.3).

A one-machine consortium is provisioned with ``SitePolicyBuilder`` defaults (no byoc, exact
allow-list, each site offering the dataset ``demo``), and ``site-bundle`` writes each participant's
folder. Exactly as the bundle's INSTALL.md says, a fresh venv (no checkout on its path: the kits
run with no PYTHONPATH, from the venv's own site-packages) gets the hashed lock with
``pip install --require-hashes`` and the wheel with ``--no-deps``; the kits are started and stopped
with that venv's ``fedpartial-site``. Then:

* the bundles hold the kit, the wheel, its .sha256, both locks, the systemd unit and INSTALL.md, and
  the sites' and admins' the tools wheel and its lock (the tools venv: tests/test_tools_wheel.py);
* a job packaged with ``--installed-runtime --dataset demo`` (no ``app/custom``) completes, run by
  the lead, and every participant's log shows fedpartial imported from the venv;
* the same job with its code in ``app/custom`` is refused (no role has the byoc right), even for
  the project admin;
* a job naming another runtime version for the sites fails at its start, with both versions in
  each site's log;
* the site's ``fedpartial-site`` checks its certificate, status and preflight (the server's port
  among its checks), and ``stop`` leaves no process of the kit; the kits keep their temporary files
  in ``KIT/tmp``.

One system is shared by the module; a finalizer stops every kit and kills anything left.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedpartial.flare.common import runtime_identity
from fedpartial_tools.deploy import admin, processes, provision
from fedpartial_tools.deploy.bundle import site_bundle
from fedpartial_tools.jobs.packaging import package_job

from helpers import outer_pip_cache
from test_provisioned import CLASSES, _write_sites

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.filterwarnings("ignore:ssl_context is deprecated:DeprecationWarning")]
SITES = ["site-1", "site-2"]
DATASET = "demo"  # the name each site's kit offers its site files under (local/fedpartial_site.json)
OTHER_VERSION = "0.0.0.dev7"  # any version but the installed one
OVERRIDES = ["num_rounds=1", "server.min_clients=2", f"model.class_names={json.dumps(CLASSES)}",
             "model.input_size=[16,16]", "model.in_channels=3", "model.arch_args.width=8",
             "rule_args.batch_size=4", "device=cpu"]


def _site_cmd(system, *args, check=True):
    """The venv's fedpartial-site, as an operator runs it."""
    res = subprocess.run([str(system["venv"] / "bin" / "fedpartial-site"), *map(str, args)], env=system["env"],
                         capture_output=True, text=True, timeout=180)
    if check and res.returncode != 0:
        raise AssertionError(f"fedpartial-site {' '.join(map(str, args))} exited {res.returncode}:\n"
                             f"{res.stdout}\n{res.stderr}")
    return res


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    root = tmp_path_factory.mktemp("installed_runtime")
    env = provision.kit_env(str(root))
    env.pop("PYTHONPATH", None)  # nothing of the checkout: the venv alone provides fedpartial
    data_root = root / "sites"
    data_root.mkdir()
    _write_sites(data_root, np.random.default_rng(0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", env["HOME"])
        mp.setenv("TMPDIR", env["TMPDIR"])
        mp.delenv("NVFLARE_STARTUP_KIT_DIR", raising=False)
        project = provision.localhost_project("fedpartial_rt", provision.free_port(), SITES,
                                              site_policy={"datasets": {DATASET: str(data_root)},
                                                           "privacy_file": str(REPO / "provisioning" / "privacy.json")})
        prod = Path(provision.provision(provision.write_project(str(root / "project.yml"), project),
                                        str(root / "provision"), env=env))
        bundles = {b["name"]: b for b in site_bundle(str(prod), str(root / "bundles"))}
        # the machine: a fresh venv, the hashed lock, the wheel (as INSTALL.md says)
        venv = root / "venv"
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        bundle = Path(bundles["site-1"]["path"])
        for cmd in (pip + ["--require-hashes", "-r", str(bundle / "requirements-site.lock")],
                    pip + ["--no-deps", str(next(bundle.glob("fedpartial_runtime-*.whl")))]):
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                                 env=dict(env, PIP_NO_INPUT="1", PIP_CACHE_DIR=outer_pip_cache()))
            assert res.returncode == 0, f"{' '.join(cmd)}:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
        # each participant's kit where INSTALL.md puts it (cp -r kit /opt/flare/<name>)
        kits = {}
        (root / "opt_flare").mkdir()
        for name, b in bundles.items():
            kits[name] = root / "opt_flare" / name
            subprocess.run(["cp", "-r", str(Path(b["path"]) / "kit"), str(kits[name])], check=True)
        # The coordinating centre's server keeps FLARE's default (byoc allowed): each hospital's
        # site must refuse code on its own policy, whatever the server permits.
        local = kits["localhost"] / "local"
        (local / "authorization.json").write_text((local / "authorization.json.default").read_text())
        system = {"root": root, "prod": prod, "venv": venv, "env": env, "data_root": data_root,
                  "bundles": bundles, "kits": kits, "site_kits": {s: kits[s] for s in SITES}}
        try:
            _site_cmd(system, "start", kits["localhost"], "--storage", root / "storage")
            admin_kits = {role: kit for kit, role in admin.admin_kits(str(prod)).items()}
            session = admin.new_admin_session(admin_kits["project_admin"], timeout=60)
            for site in SITES:
                _site_cmd(system, "start", kits[site])
            admin.wait_for_clients(session, SITES, timeout=120)
            session.close()
            system["admin_kits"] = admin_kits
            yield system
        finally:
            for kit in [kits[s] for s in SITES] + [kits["localhost"]]:
                _site_cmd(system, "stop", kit, "--wait", "20", check=False)
            processes.kill_workspace_processes(str(root))
            left = processes.live_workspace_processes(str(root))
            assert not left, f"processes left behind: {left}"


def _run(system, kit_role, job, out):
    session = admin.new_admin_session(system["admin_kits"][kit_role])
    try:
        return admin.run_job(session, str(job), str(out), timeout=240, log=lambda m: None)
    finally:
        session.close()


def _site_log(system, site, job_id) -> str:
    path = system["kits"][site] / job_id / "log.txt"
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
    site_packages = next(system["venv"].glob("lib/python3*/site-packages"))
    installed = f"fedpartial {runtime_identity()} from {site_packages / 'fedpartial'}"
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
    refusal = [line for line in (system["kits"]["localhost"] / "log.txt").read_text().splitlines()
               if result["job_id"] in line and "deploy failure" in line]
    assert refusal, f"no deploy failure logged by the server for job {result['job_id']}"
    assert "'server: OK'" in refusal[0]
    for site in SITES:
        assert f"'{site}: NVFLARE_ERROR: BYOC not permitted'" in refusal[0], refusal[0]


@pytest.mark.slow
def test_sites_refuse_a_job_for_another_runtime_version(system, tmp_path):
    """The sites' check (the server's, same message, is tested in test_flare_components): the job
    names another version for the sites only, so their refusal is what stops it."""
    from fedpartial_tools.jobs.packaging import set_runtime_version

    job = Path(package_job(str(REPO / "jobs" / "fedavg"), str(tmp_path / "fedavg_other"), OVERRIDES,
                           dataset=DATASET, with_code=False))
    client_file = job / "app" / "config" / "config_fed_client.json"
    client = json.loads(client_file.read_text())
    assert set_runtime_version({"client": client}, OTHER_VERSION) == 1
    client_file.write_text(json.dumps(client))
    result = _run(system, "lead", job, tmp_path / "download")
    assert result["status"] == "FINISHED:EXECUTION_EXCEPTION" and not result["global_model"], result["status"]
    # the first site's refusal ends the job; a loaded site may be stopped before its own set-up
    refused = [site for site in SITES
               if (f"site set-up failed: the job needs fedpartial runtime {OTHER_VERSION} but site '{site}' has "
                   f"fedpartial {runtime_identity()} installed") in _site_log(system, site, result["job_id"])]
    assert refused, {site: _site_log(system, site, result["job_id"])[-2000:] for site in SITES}
    # the server stopped the job on the first site's failed train task
    assert "peer_rc=EXECUTION_EXCEPTION, task_name=train" in Path(result["server_log"]).read_text()


@pytest.mark.slow
def test_the_bundle_and_the_site_command_work_from_the_wheel_alone(system):
    from fedpartial.flare.allowed import CLASS_ALLOW_LIST

    runtime = ["fedpartial_runtime-0.1.0-py3-none-any.whl", "fedpartial_runtime-0.1.0-py3-none-any.whl.sha256",
               "requirements-site-cuda.lock", "requirements-site.lock"]
    tools = ["fedpartial_tools-0.1.0-py3-none-any.whl", "fedpartial_tools-0.1.0-py3-none-any.whl.sha256",
             "requirements-tools.lock"]
    assert sorted(b["kind"] for b in system["bundles"].values()) == ["admin"] * 3 + ["server"] + ["site"] * 2
    for name, bundle in system["bundles"].items():
        top = sorted(f for f in bundle["files"] if not f.startswith("kit" + os.sep))
        unit = [f"fedpartial-{name}.service"] if bundle["kind"] != "admin" else []
        assert top == sorted(["INSTALL.md", *unit, *runtime, *(tools if bundle["kind"] != "server" else [])]), top
        # sha256sum -c, as INSTALL.md's first step
        sums = [f for f in top if f.endswith(".sha256")]
        res = subprocess.run(["sha256sum", "-c", *sums], cwd=bundle["path"], capture_output=True, text=True)
        assert res.returncode == 0 and res.stdout.count(": OK") == 3 + 2 * (len(sums) - 1), res.stdout + res.stderr
        install = (Path(bundle["path"]) / "INSTALL.md").read_text()
        numbers = [int(n) for n in re.findall(r"^## (\d+)\.", install, re.M)]
        assert numbers == list(range(1, len(numbers) + 1)), (name, numbers)  # no section skipped
    site = system["kits"]["site-1"]
    # the venv has the runtime and its command, and no tooling
    probe = subprocess.run([str(system["venv"] / "bin" / "python"), "-c", "import fedpartial_tools"],
                           capture_output=True, text=True, env=system["env"])
    assert probe.returncode != 0 and "No module named 'fedpartial_tools'" in probe.stderr
    expiry = _site_cmd(system, "cert-expiry", site)
    assert "site-1" in expiry.stdout and "root CA" in expiry.stdout and "ok" in expiry.stdout
    assert _site_cmd(system, "cert-expiry", site, "--warn-days", "400", check=False).returncode == 1
    status = json.loads(_site_cmd(system, "status", site, "--json").stdout)
    assert status["running"] and status["runtime"] == runtime_identity()
    assert status["datasets"] == {DATASET: str(system["data_root"])}
    preflight = _site_cmd(system, "preflight", site)
    for check in ("python", "certificates", "allow-list", "logs stay here", "no code with jobs",
                  f"dataset '{DATASET}'", "privacy policy", "server"):
        assert any(line.startswith("ok") and check in line for line in preflight.stdout.splitlines()), \
            (check, preflight.stdout)
    resources = json.loads((site / "local" / "resources.json").read_text())
    assert resources["class_allow_list"] == list(CLASS_ALLOW_LIST)
    unit = (Path(system["bundles"]["site-1"]["path"]) / "fedpartial-site-1.service").read_text()
    assert "User=flare" in unit and "ExecStart=/opt/fedpartial/venv/bin/fedpartial-site start /opt/flare/site-1 " \
        "--foreground" in unit and "ReadWritePaths=/opt/flare/site-1\n" in unit
    server_unit = (Path(system["bundles"]["localhost"]["path"]) / "fedpartial-localhost.service").read_text()
    assert "ReadWritePaths=/opt/flare/localhost /var/lib/fedpartial\n" in server_unit
    # the kits' temporary files and torch's caches stay in the kits, none in the machine's TMPDIR
    for kit in system["kits"].values():
        if (kit / "startup" / "sub_start.sh").is_file():
            assert (kit / "tmp").is_dir(), kit
    assert not list(Path(system["env"]["TMPDIR"]).glob("torchinductor_*"))
    # started in the background, each kit's output goes to its console.log through the rotating writer
    assert (site / "console.log").stat().st_size > 0
    assert any("fedpartial.site.console_log" in cmd for cmd in processes.live_workspace_processes(str(site)).values())
