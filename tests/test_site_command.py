"""The site command (fedpartial.site, ``fedpartial-site``) without a running system: job-folder
clean-up, the systemd unit, start / stop guards, preflight's failures, offering a dataset.
A provisioned kit (~1 s) is made once per module."""
import json
import os
import time
from pathlib import Path

import pytest

from fedpartial.flare.site_config import load_site_config, offer_dataset
from fedpartial.site import command as cli, kit as site_kit
from fedpartial_tools.deploy import provision

REPO = Path(__file__).resolve().parents[1]
JOB_A = "11111111-2222-3333-4444-555555555555"
JOB_B = "66666666-7777-8888-9999-000000000000"


@pytest.fixture(scope="module")
def prod(tmp_path_factory):
    root = tmp_path_factory.mktemp("site_cmd")
    project = provision.localhost_project("site_cmd", 18117, ["site-1"], site_policy={
        "privacy_file": str(REPO / "provisioning" / "privacy.json")})
    return Path(provision.provision(provision.write_project(str(root / "p.yml"), project), str(root / "ws"),
                                    env=provision.kit_env(str(root))))


@pytest.fixture
def site(prod, tmp_path):
    """A fresh copy of site-1's kit, in a folder named otherwise (as an operator may)."""
    import shutil

    dest = tmp_path / "kit_copy"
    shutil.copytree(prod / "site-1", dest)
    return dest


def _job(kit: Path, job_id: str, days_old: float, size: int, state: bool = False) -> Path:
    folder = kit / ("fedpartial_state" if state else "") / job_id
    folder.mkdir(parents=True)
    (folder / "log.txt").write_bytes(b"x" * size)
    stamp = time.time() - days_old * 86400
    for path in (folder / "log.txt", folder):
        os.utime(path, (stamp, stamp))
    return folder


def test_clean_removes_old_job_folders_only(site):
    old = _job(site, JOB_A, days_old=40, size=1000)
    old_state = _job(site, JOB_A, days_old=40, size=500, state=True)
    new = _job(site, JOB_B, days_old=2, size=300)
    (site / "not-a-job").mkdir()
    listed = site_kit.job_folders(str(site))
    assert [(j["job_id"], j["bytes"]) for j in listed] == [(JOB_A, 1000), (JOB_A, 500), (JOB_B, 300)]
    dry = site_kit.clean(str(site), older_than_days=30, dry_run=True)
    assert sorted(j["path"] for j in dry) == sorted([str(old), str(old_state)]) and old.exists()
    gone = site_kit.clean(str(site), older_than_days=30)
    assert sum(j["bytes"] for j in gone) == 1500
    assert not old.exists() and not old_state.exists() and new.exists() and (site / "not-a-job").exists()
    with pytest.raises(ValueError, match="older_than_days must be >= 0"):
        site_kit.clean(str(site), -1)


def test_clean_never_removes_a_running_jobs_folder(site, monkeypatch):
    old = _job(site, JOB_A, days_old=40, size=10)
    monkeypatch.setattr(site_kit, "live_workspace_processes",
                        lambda root: {4242: f"python -m nvflare.private.fed.app.client.worker_process -m {site} "
                                            f"-w {site}/{JOB_A} --job_id {JOB_A}"})
    assert site_kit.running_job_ids(str(site)) == {JOB_A}
    assert site_kit.clean(str(site), older_than_days=30) == [] and old.exists()


def test_the_systemd_unit_runs_the_kit_as_an_unprivileged_user():
    unit = site_kit.systemd_unit("/opt/flare/site-1", user="flare", python="/opt/fp/venv/bin/python")
    lines = unit.splitlines()
    assert "User=flare" in lines and "Group=flare" in lines and "Restart=on-failure" in lines
    assert "ExecStart=/opt/fp/venv/bin/fedpartial-site start /opt/flare/site-1 --foreground" in lines
    assert "ExecStop=/opt/fp/venv/bin/fedpartial-site stop /opt/flare/site-1 --wait 60" in lines
    assert "WantedBy=multi-user.target" in lines and "NoNewPrivileges=true" in lines
    server = site_kit.systemd_unit("/opt/flare/server", python="/v/bin/python", storage="/var/lib/fp")
    assert "ExecStart=/v/bin/fedpartial-site start /opt/flare/server --foreground --storage /var/lib/fp" in server


def test_start_and_stop_guards(site, tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a server or site startup kit"):
        site_kit.start(str(tmp_path))
    with pytest.raises(ValueError, match="--storage is for the server kit"):
        site_kit.start(str(site), storage=str(tmp_path / "store"))
    (site / "daemon_pid.fl").write_text(str(os.getpid()))  # a live restart loop
    with pytest.raises(RuntimeError, match=f"already running \\(restart loop pid {os.getpid()}\\)"):
        site_kit.start(str(site))
    (site / "daemon_pid.fl").unlink()
    assert site_kit.stop(str(site), wait=0) == {}  # nothing running: nothing to do, no error
    assert not (site / "shutdown.fl").exists()


def test_preflight_passes_a_kit_as_provisioned_with_data(site, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "site-1.npz").write_bytes(b"")
    offer_dataset(str(site), "study_a", str(data))
    rows = {r["check"]: r for r in site_kit.preflight(str(site))}
    assert all(r["ok"] for r in rows.values()), [r for r in rows.values() if not r["ok"]]
    assert rows["dataset 'study_a'"]["detail"] == str(data / "site-1.npz")  # the name from the certificate
    cli.main(["preflight", str(site)])
    assert "FAIL" not in capsys.readouterr().out


def test_preflight_names_what_fails(site, tmp_path, capsys):
    local = site / "local"
    resources = json.loads((local / "resources.json").read_text())
    resources["class_allow_list"].append("fedpartial.")
    resources["allow_log_streaming"] = True
    (local / "resources.json").write_text(json.dumps(resources))
    authz = json.loads((local / "authorization.json").read_text())
    authz["permissions"]["lead"]["byoc"] = "any"
    (local / "authorization.json").write_text(json.dumps(authz))
    offer_dataset(str(site), "study_a", str(tmp_path))  # no site-1.npz there
    (local / "privacy.json").unlink()
    rows = {r["check"]: r for r in site_kit.preflight(str(site), warn_days=400)}
    failed = sorted(name for name, r in rows.items() if not r["ok"])
    assert failed == ["allow-list", "certificates", "dataset 'study_a'", "logs stay here", "no code with jobs",
                      "privacy policy"], failed
    assert "not the runtime's: ['fedpartial.']" in rows["allow-list"]["detail"]
    assert rows["no code with jobs"]["detail"] == "byoc for ['lead']"
    with pytest.raises(SystemExit) as code:
        cli.main(["preflight", str(site)])
    assert code.value.code == 1 and "check(s) failed" in capsys.readouterr().out


def test_offer_dataset_adds_and_moves_names(site, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert load_site_config(str(site))["datasets"] == {}
    cli.main(["offer-dataset", str(site), "ham_lsm", str(a)])
    cli.main(["offer-dataset", str(site), "ich_mlp", str(b)])
    cli.main(["offer-dataset", str(site), "ham_lsm", str(b)])
    assert load_site_config(str(site))["datasets"] == {"ham_lsm": str(b), "ich_mlp": str(b)}
    for name, folder, words in (("../x", a, "use letters, digits"), ("ok", tmp_path / "none", "does not exist")):
        with pytest.raises(SystemExit) as code:
            cli.main(["offer-dataset", str(site), name, str(folder)])
        assert code.value.code == 2 and words in capsys.readouterr().err
