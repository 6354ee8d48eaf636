"""Certificate operations on a running provisioned one-machine system (mutual TLS):

* a site joins keeping its own private key (provisioning/join_site.sh: nvflare cert request, cert approve
  with the system's root CA, nvflare package) and the server lists it;
* a kit renewed into the same workspace (provision.sh --renew) registers after a restart and expires later;
* a certificate of the right root CA that has expired is refused at the TLS handshake;
* a disabled site is dropped and cannot register again (FLARE's disable_client);
* a job whose min_clients exceeds the connected sites is refused before it is submitted.

One system (server + site-1) is shared by the module; a finalizer kills every process it started.
"""
import datetime
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedpartial_tools.deploy import admin, processes, provision
from helpers import tls_reply

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.filterwarnings("ignore:ssl_context is deprecated:DeprecationWarning"), pytest.mark.slow]
PROJECT = "fedpartial_certs"


class System:
    def __init__(self, root: Path, env: dict):
        self.root, self.env, self.procs = root, env, {}

    def start(self, kit: Path, name: str):
        self.procs[name] = processes.start_kit(str(kit), str(self.root / f"{name}.console.log"), self.env)

    def stop(self, name: str):
        processes.stop_group(self.procs.pop(name), grace=2.0)

    def close(self):
        for proc in reversed(list(self.procs.values())):
            processes.stop_group(proc, grace=2.0)
        processes.kill_workspace_processes(str(self.root))


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    root = tmp_path_factory.mktemp("certops")
    env = provision.kit_env(str(root))
    env["PYTHONPATH"] = str(REPO / "custom")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", env["HOME"])
        mp.setenv("TMPDIR", env["TMPDIR"])
        mp.delenv("NVFLARE_STARTUP_KIT_DIR", raising=False)
        port = provision.free_port()
        project_file = provision.write_project(str(root / "project.yml"),
                                               provision.localhost_project(PROJECT, port, ["site-1"]))
        ws = root / "ws"
        prod = Path(provision.provision(project_file, str(ws), env=env))
        provision.keep_server_storage_in(str(prod / "localhost"), str(root / "storage"))
        sys_ = System(root, env)
        try:
            sys_.start(prod / "localhost", "server")
            admin_kit = {role: kit for kit, role in admin.admin_kits(str(prod)).items()}["project_admin"]
            session = admin.new_admin_session(admin_kit, timeout=60)
            sys_.start(prod / "site-1", "site-1")
            admin.wait_for_clients(session, ["site-1"], timeout=90)
            yield {"root": root, "env": env, "ws": ws, "prod": prod, "project_file": project_file, "port": port,
                   "session": session, "system": sys_}
            session.close()
        finally:
            sys_.close()
            left = processes.live_workspace_processes(str(root))
            assert not left, f"processes left behind: {left}"


def _sh(args, env, cwd):
    res = subprocess.run(["bash", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{args} failed:\n{res.stdout}\n{res.stderr}"
    return res.stdout


def _wait_log(path: Path, text: str, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(1)
    return False


def test_a_site_joins_with_its_own_private_key_and_is_disabled_again(system):
    root, env = system["root"], dict(system["env"], PYTHON=sys.executable)
    site_dir, admin_dir = root / "site-3-machine", root / "admin-machine"
    site_dir.mkdir()
    admin_dir.mkdir()
    join = str(REPO / "provisioning" / "join_site.sh")
    _sh([join, "request", "site-3", "hospital_c", PROJECT, "req"], env, site_dir)
    request = site_dir / "req" / "site-3.request.zip"
    out = _sh([join, "approve", str(request), str(system["ws"]), system["project_file"]], env, admin_dir)
    fingerprint = out.split("root CA fingerprint: ")[1].split()[0]
    _sh([join, "package", str(admin_dir / "site-3.signed.zip"), "req", "kits", fingerprint], env, site_dir)
    kit = site_dir / "kits" / PROJECT / "prod_00" / "site-3"
    # the kit's key is the one made on the site; the request and the signed zip carry no private key
    assert (kit / "startup" / "client.key").read_bytes() == (site_dir / "req" / "site-3.key").read_bytes()
    for z in (request, admin_dir / "site-3.signed.zip"):
        assert not any(n.endswith(".key") for n in zipfile.ZipFile(z).namelist())
    cert = x509.load_pem_x509_certificate((kit / "startup" / "client.crt").read_bytes())
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == datetime.timedelta(days=360)
    assert (kit / "startup" / "rootCA.pem").read_bytes() == \
        (system["prod"] / "site-1" / "startup" / "rootCA.pem").read_bytes()
    system["system"].start(kit, "site-3")
    assert admin.wait_for_clients(system["session"], ["site-1", "site-3"], timeout=90) == ["site-1", "site-3"]

    # removing it again: disabled, dropped, and refused when it tries to register after a restart.
    # One test with the join: the module's system may be rebuilt between tests (xdist runs the
    # deployment group's tests in its own order), so no test relies on another's site.
    session = system["session"]
    result = session.disable_client("site-3")
    assert result["clients"][0]["state"] == "disabled" and result["clients"][0]["credential_revoked"] is False
    server_log = system["prod"] / "localhost" / "log.txt"
    assert _wait_log(server_log, "Client site-3 disabled", 10)
    assert "site-3" not in [c.name for c in session.get_connected_client_list()]
    system["system"].stop("site-3")
    system["system"].start(kit, "site-3")
    assert _wait_log(server_log, "Reject disabled client registration: site-3", 60)
    assert "site-3" not in [c.name for c in session.get_connected_client_list()]
    assert json.loads((system["prod"] / "localhost" / "disabled_clients.json").read_text()) == \
        {"disabled_clients": ["site-3"]}


def test_a_renewed_kit_registers_after_a_restart_and_expires_later(system):
    env = dict(system["env"], PYTHON=sys.executable)
    time.sleep(1.1)  # certificates carry whole seconds
    out = _sh([str(REPO / "provisioning" / "provision.sh"), system["project_file"], str(system["ws"]),
               "--renew", "site-1"], env, system["root"])
    renewed = system["ws"] / PROJECT / "prod_01" / "site-1"
    assert f"{renewed}  <- RENEWED" in out and "localhost  <- RENEWED" not in out
    crt = "startup/client.crt"
    old = x509.load_pem_x509_certificate((system["prod"] / "site-1" / crt).read_bytes())
    new = x509.load_pem_x509_certificate((renewed / crt).read_bytes())
    assert new.not_valid_after_utc > old.not_valid_after_utc
    system["system"].stop("site-1")
    system["system"].start(renewed, "site-1-renewed")
    assert _wait_log(renewed / "log.txt", "Successfully registered", 90), (renewed / "log.txt").read_text()[-2000:]
    admin.wait_for_clients(system["session"], ["site-1"], timeout=30)


def _tls_reply(cert_pem: bytes, key_pem: bytes, ca: Path, port: int, tmp: Path) -> bytes:
    """What the server answers a plain HTTPS request made with this certificate (b"" = dropped)."""
    (tmp / "c.crt").write_bytes(cert_pem)
    (tmp / "c.key").write_bytes(key_pem)
    return tls_reply(tmp / "c.crt", tmp / "c.key", ca, port)


def test_an_expired_certificate_of_the_right_root_ca_is_refused(system, tmp_path):
    state = json.loads((system["ws"] / PROJECT / "state" / "cert.json").read_text())
    root = x509.load_pem_x509_certificate(state["root_cert"].encode())
    root_key = serialization.load_pem_private_key(state["root_pri_key"].encode(), password=None)
    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(not_after):
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "site-9")]))
                .issuer_name(root.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=10)).not_valid_after(not_after)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(root_key, hashes.SHA256()))
        return (cert.public_bytes(serialization.Encoding.PEM),
                key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))

    ca = system["prod"] / "site-1" / "startup" / "rootCA.pem"
    # control: the same certificate valid for one more day is answered
    assert _tls_reply(*issue(now + datetime.timedelta(days=1)), ca, system["port"], tmp_path).startswith(b"HTTP/1.1")
    assert _tls_reply(*issue(now - datetime.timedelta(minutes=1)), ca, system["port"], tmp_path) == b""


def test_a_job_needing_more_sites_than_connected_is_refused_before_submit(system, tmp_path):
    from fedpartial_tools.jobs.packaging import package_job

    job = package_job(str(REPO / "jobs" / "fedavg"), str(tmp_path / "fedavg"), ["num_rounds=1", "min_clients=3"])
    before = len(system["session"].list_jobs())
    with pytest.raises(ValueError, match=r"needs min_clients=3 but the server lists 1 site\(s\) \(site-1\)"):
        admin.run_job(system["session"], job, str(tmp_path / "out"), timeout=10, log=lambda m: None)
    assert len(system["session"].list_jobs()) == before
