"""End-to-end on a provisioned one-machine system (mutual TLS, startup kits, roles):

* a lead submits the real jobs/fedlsm job (bring-your-own-code, 2 rounds, tiny synthetic data) through
  the admin API; it finishes, the result downloads, the global model loads and metrics.json has 2 rounds;
* an org_admin may not submit (no submit / byoc right);
* re-provisioning with a site added keeps the root CA (fast, no system started);
* a kit from another provisioning of the same names (other root CA) cannot register, its certificate
  is refused at the TLS handshake, and its admin cannot log in.

One system (server + site-1 + site-2) is shared by the tests of this module; a finalizer kills every
process group it started and then every FLARE process naming the module's folder, even on failure.
"""
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from fedpartial_tools.deploy import admin, processes, provision
from helpers import tls_reply

REPO = Path(__file__).resolve().parents[1]
# aiohttp (inside nvflare's TLS connector) warns about its own API
pytestmark = [pytest.mark.filterwarnings("ignore:ssl_context is deprecated:DeprecationWarning")]
SITES = ["site-1", "site-2"]
SPARE = "site-3"  # provisioned in both projects, never started from the real one: the foreign kit's name
CLASSES = ["c0", "c1", "c2", "c3"]


def _write_sites(out: Path, rng) -> None:
    """Two tiny single-label sites; class c brightens its own 4x4 tile of a 16x16 RGB image."""
    from fedpartial.data import sitefile
    from fedpartial.data.types import SINGLE_LABEL, Dataset, Split

    def learnable(n):
        labels = np.eye(len(CLASSES), dtype=np.float32)[rng.integers(0, len(CLASSES), n)]
        images = rng.normal(60, 20, size=(n, 16, 16, 3))
        for c in range(len(CLASSES)):
            images[labels[:, c] > 0, 4 * c:4 * c + 4, 4 * c:4 * c + 4] += 150
        return np.clip(images, 0, 255).astype(np.uint8), labels

    for k, site in enumerate(SITES):
        images, labels = learnable(32)
        val_images, val_labels = learnable(40)  # every class >= 5 times: its scores may leave the site
        # label-set mismatch: site-1 annotates the first half of the classes, site-2 the rest
        annotated = np.zeros(len(CLASSES), bool)
        annotated[k * len(CLASSES) // 2:(k + 1) * len(CLASSES) // 2] = True
        mask = np.repeat(annotated[None], len(labels), axis=0)
        labels = labels * mask
        data = Dataset(SINGLE_LABEL, CLASSES, {"train": Split(images, labels, mask),
                                               "val": Split(val_images, val_labels,
                                                            np.ones_like(val_labels, dtype=bool))},
                       source="synthetic", site=site, info={"scenario": "label-set-mismatch"})
        sitefile.write_site_file(str(out / f"{site}.npz"), data)


class System:
    """Processes of one module: every kit started in its own session, killed by group at the end."""

    def __init__(self, root: Path, env: dict):
        self.root, self.env, self.procs = root, env, []

    def start(self, kit: Path, name: str):
        proc = processes.start_kit(str(kit), str(self.root / f"{name}.console.log"), self.env)
        self.procs.append(proc)
        return proc

    def close(self):
        for proc in reversed(self.procs):
            processes.stop_group(proc, grace=2.0)
        processes.kill_workspace_processes(str(self.root))


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    root = tmp_path_factory.mktemp("provisioned")
    env = provision.kit_env(str(root))
    with pytest.MonkeyPatch.context() as mp:
        # this process too (admin API sessions): HOME / TMPDIR inside the test folder
        mp.setenv("HOME", env["HOME"])
        mp.setenv("TMPDIR", env["TMPDIR"])
        mp.delenv("NVFLARE_STARTUP_KIT_DIR", raising=False)
        port = provision.free_port()
        project = provision.localhost_project("fedpartial_test", port, SITES + [SPARE])
        project_file = provision.write_project(str(root / "project.yml"), project)
        prod = Path(provision.provision(project_file, str(root / "provision"), env=env))
        # the same project provisioned again elsewhere: same names, its own root CA
        foreign = Path(provision.provision(project_file, str(root / "provision_foreign"), env=env))
        server = prod / "localhost"
        provision.keep_server_storage_in(str(server), str(root / "storage"))
        sys_ = System(root, env)
        try:
            sys_.start(server, "server")
            kit_roles = admin.admin_kits(str(prod))
            kits = {role: kit for kit, role in kit_roles.items()}
            session = _session(kits["project_admin"], timeout=60)
            for site in SITES:
                sys_.start(prod / site, site)
            admin.wait_for_clients(session, SITES, timeout=90)
            session.close()
            yield {"root": root, "prod": prod, "foreign": foreign, "port": port, "kits": kits, "system": sys_}
        finally:
            sys_.close()
            left = processes.live_workspace_processes(str(root))
            assert not left, f"processes left behind: {left}"


def _session(kit: str, timeout: float = 30):
    return admin.new_admin_session(kit, timeout=timeout)


@pytest.mark.slow
def test_lead_runs_fedlsm_over_mtls_and_downloads_the_model(system, tmp_path):
    from fedpartial_tools.jobs.packaging import package_job
    from fedpartial.models.io import load_model_file

    data_root = tmp_path / "sites"
    data_root.mkdir()
    _write_sites(data_root, np.random.default_rng(0))
    overrides = ["num_rounds=2", "server.min_clients=2", f"model.class_names={json.dumps(CLASSES)}",
                 "model.input_size=[16,16]", "model.in_channels=3", "model.arch_args.width=8",
                 "rule_args.batch_size=16", "device=cpu"]
    job = package_job(str(REPO / "jobs" / "fedlsm"), str(tmp_path / "fedlsm"), overrides, data_root=str(data_root))
    assert os.path.isdir(os.path.join(job, "app", "custom", "fedpartial")), "code must travel with the job (byoc)"

    session = _session(system["kits"]["lead"])
    try:
        result = admin.run_job(session, job, str(tmp_path / "download"), timeout=240, log=lambda m: None)
        meta = session.get_job_meta(result["job_id"])
    finally:
        session.close()
    assert result["status"] == "FINISHED:COMPLETED", f"job ended {result['status']}; log {result['server_log']}"
    assert meta["submitter_name"] == "lead@hospital-a.org" and meta["submitter_role"] == "lead"
    assert result["global_model"], f"no global_model.pt in {result['result_dir']}"
    model, model_meta = load_model_file(result["global_model"])
    assert list(model_meta["class_names"]) == CLASSES
    rounds = json.loads(Path(result["metrics"]).read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1]  # num_rounds=2
    for r in rounds:
        # both sites' updates reached the server, with FedLSM's class counts
        assert sorted(r["sites"]) == SITES
        assert all(r["sites"][s]["num_samples"] > 0 and r["sites"][s]["bytes_stats"] > 0 for s in SITES)
    # cross-site evaluation: each site validated the global model; the sites' local models stay at the
    # sites (the jobs' CrossSiteModelEval asks for none)
    cross = json.loads(Path(result["cross_site_val"]).read_text())
    assert sorted(cross) == SITES
    for site in SITES:
        assert "SRV_SRV_global_model" in cross[site] and not set(SITES) & set(cross[site])
        assert 0.0 <= cross[site]["SRV_SRV_global_model"]["auc"] <= 1.0
    # TensorBoard curves stay on each site, in its workspace under the job id
    for site in SITES:
        assert list((system["prod"] / site / result["job_id"] / "tb" / site).glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_org_admin_may_not_submit(system, tmp_path):
    from nvflare.fuel.flare_api.api_spec import AuthorizationError

    from fedpartial_tools.jobs.packaging import package_job

    job = package_job(str(REPO / "jobs" / "fedavg"), str(tmp_path / "fedavg"), ["num_rounds=1"])
    session = _session(system["kits"]["org_admin"])
    try:
        assert sorted(c.name for c in session.get_connected_client_list()) == SITES  # may view
        with pytest.raises(AuthorizationError, match="not authorized"):
            session.submit_job(job)
    finally:
        session.close()


def _tls_reply(startup: Path, ca: Path, port: int) -> bytes:
    """What the server answers a plain HTTPS request made with a kit's certificate (b"" = dropped)."""
    return tls_reply(startup / "client.crt", startup / "client.key", ca, port)


@pytest.mark.slow
def test_kits_of_another_provisioning_are_rejected(system):
    prod, foreign, port = system["prod"], system["foreign"], system["port"]
    assert (foreign / SPARE / "startup" / "rootCA.pem").read_bytes() != (prod / SPARE / "startup" /
                                                                         "rootCA.pem").read_bytes()
    # TLS level: the server answers a request made with its own project's certificate (control) and drops
    # one made with the other project's certificate, even when the client trusts the server's CA.
    own_ca = prod / SPARE / "startup" / "rootCA.pem"
    assert _tls_reply(prod / SPARE / "startup", own_ca, port).startswith(b"HTTP/1.1")
    assert _tls_reply(foreign / SPARE / "startup", own_ca, port) == b""

    # FLARE level: the foreign kit of the spare site runs but never registers.
    foreign_kit = foreign / SPARE
    proc = system["system"].start(foreign_kit, "foreign-" + SPARE)
    log = foreign_kit / "log.txt"
    try:
        deadline = time.time() + 40
        while time.time() < deadline and "CERTIFICATE_VERIFY_FAILED" not in (log.read_text() if log.exists() else ""):
            time.sleep(1)
    finally:
        processes.stop_group(proc, grace=2.0)
    text = log.read_text() if log.exists() else ""
    assert "CERTIFICATE_VERIFY_FAILED" in text, f"foreign client log:\n{text[-2000:]}"
    assert "Successfully registered" not in text
    session = _session(system["kits"]["project_admin"])
    try:
        assert SPARE not in [c.name for c in session.get_connected_client_list()]
    finally:
        session.close()

    # admin level: the foreign project admin cannot open a session; the error says what to check
    with pytest.raises(RuntimeError, match=r"could not log in .*same provisioning as the server"):
        admin.new_admin_session(str(foreign / "admin@hospital-a.org"), timeout=5)


def test_reprovisioning_with_a_new_site_keeps_the_root_ca(tmp_path):
    """Adding a site = add it to project.yml and provision the same workspace again: prod_01 holds the new
    site's kit, signed by the same root CA as prod_00 (running kits keep working)."""
    env = provision.kit_env(str(tmp_path))
    project = provision.localhost_project("grow", 18002, ["site-1", "site-2"])
    first = Path(provision.provision(provision.write_project(str(tmp_path / "p.yml"), project), str(tmp_path / "ws"), env))
    project["participants"].insert(3, {"name": "site-3", "type": "client", "org": "hospital_c"})
    second = Path(provision.provision(provision.write_project(str(tmp_path / "p.yml"), project), str(tmp_path / "ws"), env))
    assert (first.name, second.name) == ("prod_00", "prod_01")
    assert not (first / "site-3").exists() and (second / "site-3" / "startup" / "client.crt").is_file()
    ca = (first / "site-1" / "startup" / "rootCA.pem").read_bytes()
    assert (second / "site-3" / "startup" / "rootCA.pem").read_bytes() == ca
    roles = {Path(k).name: r for k, r in admin.admin_kits(str(second)).items()}
    assert roles == {"admin@hospital-a.org": "project_admin", "lead@hospital-a.org": "lead",
                     "orgadmin@hospital-b.org": "org_admin"}
