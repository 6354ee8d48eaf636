"""Certificates of startup kits: the expiry report (certificates made here with chosen lifetimes), renewal
into the same provisioning workspace, and the operator-facing checks of package-job / admin sessions.
No system is started (tests/test_cert_ops.py does that)."""
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from fedpartial_tools.deploy import admin, certs, cli as deploy, provision

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:ssl_context is deprecated:DeprecationWarning")
NOW = datetime.datetime(2030, 1, 1, tzinfo=datetime.timezone.utc)


def _key():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _cert(cn, key, issuer_cn, issuer_key, not_after, ca=False):
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
         .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_cn)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(NOW - datetime.timedelta(days=400)).not_valid_after(not_after))
    if ca:
        b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    return b.sign(issuer_key, hashes.SHA256())


def _kit(folder: Path, cert, root, config: str):
    startup = folder / "startup"
    startup.mkdir(parents=True)
    (startup / "client.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (startup / "rootCA.pem").write_bytes(root.public_bytes(serialization.Encoding.PEM))
    (startup / config).write_text("{}")


@pytest.fixture(scope="module")
def kits(tmp_path_factory):
    """prod_00 and prod_01 of project p: root CA 100 days left; site-1 10 days (prod_01; its prod_00 kit
    expired 5 days ago), site-2 40 days, the admin expired 1 day ago."""
    root_key = _key()
    root = _cert("p", root_key, "p", root_key, NOW + datetime.timedelta(days=100), ca=True)
    ws = tmp_path_factory.mktemp("certs") / "ws"

    def issue(name, days):
        return _cert(name, _key(), "p", root_key, NOW + datetime.timedelta(days=days))

    _kit(ws / "p" / "prod_00" / "site-1", issue("site-1", -5), root, "fed_client.json")
    _kit(ws / "p" / "prod_01" / "site-1", issue("site-1", 10), root, "fed_client.json")
    _kit(ws / "p" / "prod_01" / "site-2", issue("site-2", 40), root, "fed_client.json")
    _kit(ws / "p" / "prod_01" / "admin@x.org", issue("admin@x.org", -1), root, "fed_admin.json")
    return ws


def test_expiry_report_days_left_and_status(kits):
    rows = certs.expiry_report(str(kits), warn_days=30, now=NOW)
    got = {r["name"]: (r["kind"], round(r["days_left"], 6), r["status"]) for r in rows}
    # the renewed site-1 counts with its prod_01 kit (10 days), not the expired prod_00 one; one root CA row
    assert got == {"root CA": ("root CA", 100.0, "ok"), "site-1": ("site", 10.0, "WARN"),
                   "site-2": ("site", 40.0, "ok"), "admin@x.org": ("admin", -1.0, "EXPIRED")}
    assert [r["name"] for r in rows].count("root CA") == 1
    # threshold 5 days: site-1 (10 days) is fine; 50 days: site-2 (40) warns too
    assert {r["name"]: r["status"] for r in certs.expiry_report(str(kits), 5, NOW)}["site-1"] == "ok"
    assert {r["name"]: r["status"] for r in certs.expiry_report(str(kits), 50, NOW)}["site-2"] == "WARN"
    # one kit on its own
    one = certs.expiry_report(str(kits / "p" / "prod_01" / "site-2"), 30, NOW)
    assert [(r["name"], round(r["days_left"], 6)) for r in one] == [("root CA", 100.0), ("site-2", 40.0)]


def test_cert_expiry_command_exit_code(kits):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "fedpartial_tools.deploy", "cert-expiry", *args],
                              capture_output=True, text=True)

    # real clock (2026+): every certificate above is dated around 2030, so nothing is below 30 days
    ok = run(str(kits / "p" / "prod_01" / "site-2"), "--warn-days", "30")
    assert ok.returncode == 0, ok.stderr
    assert "site-2" in ok.stdout and "WARN" not in ok.stdout
    # a threshold beyond the site's lifetime: exit 1 and the renewal hint
    days = (datetime.datetime(2030, 2, 10, tzinfo=datetime.timezone.utc)
            - datetime.datetime.now(datetime.timezone.utc)).days + 10
    warn = run(str(kits / "p" / "prod_01" / "site-2"), "--warn-days", str(days))
    assert warn.returncode == 1 and "WARN" in warn.stdout and "renew them" in warn.stdout
    missing = run(str(kits / "nowhere"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_renewal_reissues_only_the_named_kit_with_the_same_root_ca(tmp_path):
    env = provision.kit_env(str(tmp_path))
    project_file = provision.write_project(str(tmp_path / "p.yml"),
                                           provision.localhost_project("renew", 18003, ["site-1", "site-2"]))
    first = Path(provision.provision(project_file, str(tmp_path / "ws"), env))
    time.sleep(1.1)  # certificates carry whole seconds
    # re-provisioning alone keeps the stored certificate (same expiry)
    same = Path(provision.provision(project_file, str(tmp_path / "ws"), env))
    crt = "startup/client.crt"
    assert (same / "site-1" / crt).read_bytes() == (first / "site-1" / crt).read_bytes()
    assert certs.renew(str(tmp_path / "ws"), "renew", ["site-1"]) == ["site-1"]
    renewed = Path(provision.provision(project_file, str(tmp_path / "ws"), env))
    assert renewed.name == "prod_02"

    def load(p):
        return x509.load_pem_x509_certificate(p.read_bytes())

    old, new = load(first / "site-1" / crt), load(renewed / "site-1" / crt)
    assert new.serial_number != old.serial_number
    assert new.not_valid_after_utc > old.not_valid_after_utc
    # 360 days (FLARE's participant lifetime); the root CA is 3650 days (provision.ROOT_VALID_DAYS)
    assert new.not_valid_after_utc - new.not_valid_before_utc == datetime.timedelta(days=360)
    root = load(renewed / "site-1" / "startup" / "rootCA.pem")
    assert root.not_valid_after_utc - root.not_valid_before_utc == datetime.timedelta(days=3650)
    assert (renewed / "site-1" / "startup" / "rootCA.pem").read_bytes() == \
        (first / "site-1" / "startup" / "rootCA.pem").read_bytes()
    new.verify_directly_issued_by(root)
    # the other kits keep their certificates; the old state file is kept
    assert (renewed / "site-2" / crt).read_bytes() == (first / "site-2" / crt).read_bytes()
    assert len(list((tmp_path / "ws" / "renew" / "state").glob("cert.json.*"))) == 1
    with pytest.raises(ValueError, match="site-9"):
        certs.renew(str(tmp_path / "ws"), "renew", ["site-9"])


def _site_files(folder: Path):
    from fedpartial.data import sitefile
    from fedpartial.data.types import SINGLE_LABEL, Dataset, Split

    folder.mkdir()
    rng = np.random.default_rng(0)
    for site in ("site-1", "site-2"):
        images = rng.integers(0, 255, size=(8, 12, 10, 3), dtype=np.uint8)
        labels = np.eye(3, dtype=np.float32)[rng.integers(0, 3, 8)]
        split = Split(images, labels, np.ones_like(labels, dtype=bool))
        sitefile.write_site_file(str(folder / f"{site}.npz"),
                                 Dataset(SINGLE_LABEL, ["a", "b", "c"], {"train": split, "val": split},
                                         source="synthetic", site=site))


def test_package_job_refuses_more_min_clients_than_sites_and_fits_the_model_to_the_data(tmp_path):
    def package(*args):
        return subprocess.run([sys.executable, "-m", "fedpartial", "package-job", str(REPO / "jobs" / "fedlsm"),
                               "--out", str(tmp_path / "job"), *args], capture_output=True, text=True)

    refused = package("--sites", "4")  # fedlsm ships min_clients=5
    assert refused.returncode == 2
    assert "min_clients=5" in refused.stderr and "--set min_clients=4" in refused.stderr
    assert not (tmp_path / "job").exists()
    _site_files(tmp_path / "sites")
    ok = package("--sites", "2", "--set", "min_clients=2", "--data-root", str(tmp_path / "sites"), "--fit-data")
    assert ok.returncode == 0, ok.stderr
    meta = json.loads((tmp_path / "job" / "meta.json").read_text())
    assert meta["min_clients"] == 2
    # the job describes what it was packaged with, not the shipped data setting ("5 sites x 3 annotated classes")
    assert meta["description"].startswith("FedLSM (MICCAI 2023), single-label label-set mismatch. Packaged with: "
                                          "min_clients 2; 50 rounds; single-label, 3 classes (a, b, c)")
    assert "5 sites" not in meta["description"]
    model = deploy.job_model(str(tmp_path / "job"))
    assert (model["class_names"], model["task"], model["in_channels"], model["input_size"]) == \
        (["a", "b", "c"], "single-label", 3, [12, 10])
    no_data = package("--fit-data")
    assert no_data.returncode == 2 and "--data-root" in no_data.stderr


def test_admin_session_names_the_kit_user_on_a_wrong_user_name(tmp_path):
    env = provision.kit_env(str(tmp_path))
    project_file = provision.write_project(str(tmp_path / "p.yml"), provision.localhost_project("u", 18004, ["site-1"]))
    kit = Path(provision.provision(project_file, str(tmp_path / "ws"), env)) / "lead@hospital-a.org"
    with pytest.raises(ValueError, match=r"its user name is 'lead@hospital-a.org' \(the kit's folder name"):
        admin.new_admin_session(str(kit), username="lead")
    # right user name, no server: the error says what to check
    with pytest.raises(RuntimeError, match=r"could not log in to localhost:18004 .*is the server running"):
        admin.new_admin_session(str(kit), timeout=2, username="lead@hospital-a.org")
