"""The site command (fedpartial.site, ``fedpartial-site``) without a running system: job-folder
clean-up (the server's job store too), the confined systemd unit and its score, start / stop guards,
the kit's environment, console-log rotation, preflight's failures (the server's port among them),
offering a dataset. A provisioned kit (~1 s) is made once per module."""
import io
import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from fedpartial.flare.site_config import load_site_config, offer_dataset
from fedpartial.site import command as cli, kit as site_kit
from fedpartial_tools.deploy import provision

REPO = Path(__file__).resolve().parents[1]
JOB_A = "11111111-2222-3333-4444-555555555555"
JOB_B = "66666666-7777-8888-9999-000000000000"
PORT = 18117  # the server port of the module's project (its kits' fed_client.json)


@pytest.fixture(scope="module")
def prod(tmp_path_factory):
    root = tmp_path_factory.mktemp("site_cmd")
    project = provision.localhost_project("site_cmd", PORT, ["site-1"], site_policy={
        "privacy_file": str(REPO / "provisioning" / "privacy.json")})
    return Path(provision.provision(provision.write_project(str(root / "p.yml"), project), str(root / "ws"),
                                    env=provision.kit_env(str(root))))


@pytest.fixture
def site(prod, tmp_path):
    """A fresh copy of site-1's kit, in a folder named otherwise (as an operator may)."""
    dest = tmp_path / "kit_copy"
    shutil.copytree(prod / "site-1", dest)
    return dest


@pytest.fixture
def server(prod, tmp_path):
    """A fresh copy of the server's kit whose job store is ``tmp_path/store/jobs-storage``."""
    dest = tmp_path / "server_copy"
    shutil.copytree(prod / "localhost", dest)
    site_kit.keep_server_storage_in(str(dest), str(tmp_path / "store"))
    return dest


@pytest.fixture
def listening():
    """Something listening on the kits' server port, as a running server would."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("localhost", PORT))
        except OSError:  # taken: then something answers there already
            yield None
            return
        s.listen(4)
        yield s


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
    assert "WantedBy=multi-user.target" in lines and "NoNewPrivileges=yes" in lines
    server = site_kit.systemd_unit("/opt/flare/server", python="/v/bin/python", storage="/var/lib/fp")
    assert "ExecStart=/v/bin/fedpartial-site start /opt/flare/server --foreground --storage /var/lib/fp" in server


def test_the_unit_confines_the_kit_to_its_folder():
    site = site_kit.systemd_unit("/opt/flare/site-1", python="/v/bin/python").splitlines()
    # the kit is all it writes; the server's job store besides
    assert [line for line in site if line.startswith("ReadWritePaths=")] == ["ReadWritePaths=/opt/flare/site-1"]
    server = site_kit.systemd_unit("/opt/flare/server", python="/v/bin/python", storage="/var/lib/fp").splitlines()
    assert "ReadWritePaths=/opt/flare/server /var/lib/fp" in server
    for line in ("ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "PrivateDevices=yes",
                 "CapabilityBoundingSet=", "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
                 "SystemCallFilter=@system-service", "MemoryMax=80%"):
        assert line in site, line
    gpu = site_kit.systemd_unit("/opt/flare/site-1", python="/v/bin/python", gpu=True, memory_max="",
                                cpu_quota="400%").splitlines()
    assert "PrivateDevices=no" in gpu and "PrivateDevices=yes" not in gpu  # /dev/nvidia* stays visible
    assert "CPUQuota=400%" in gpu and not [line for line in gpu if line.startswith("MemoryMax")]
    with pytest.raises(ValueError, match="memory_max '80 percent' is not a systemd value"):
        site_kit.systemd_unit("/opt/flare/site-1", memory_max="80 percent")


def _exposure(unit_file: Path) -> float:
    res = subprocess.run(["systemd-analyze", "security", "--offline=true", unit_file.name], cwd=unit_file.parent,
                         capture_output=True, text=True, timeout=60)
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", res.stdout + res.stderr)
    assert found, res.stdout + res.stderr
    return float(found.group(1))


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed here")
@pytest.mark.parametrize("kind", ["site", "gpu site", "server"])
def test_every_participants_unit_passes_a_security_review(tmp_path, kind):
    """systemd's own rating: at most 4.5 ('OK' ends at 4.9); the unit FLARE ran in before scored 8.8."""
    unit = site_kit.systemd_unit("/opt/flare/site-1", python="/opt/fedpartial/venv/bin/python", gpu=kind == "gpu site",
                                 storage="/var/lib/fedpartial" if kind == "server" else None)
    path = tmp_path / "fedpartial-site-1.service"
    path.write_text(unit)
    assert _exposure(path) <= 4.5
    # the rating sees what is there: the old unit (no confinement) is rated EXPOSED
    plain = unit[:unit.index("# Confinement")] + "NoNewPrivileges=yes\n\n[Install]\nWantedBy=multi-user.target\n"
    path.write_text(plain)
    assert _exposure(path) > 8


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


def test_preflight_passes_a_kit_as_provisioned_with_data(site, tmp_path, capsys, listening):
    data = tmp_path / "data"
    data.mkdir()
    (data / "site-1.npz").write_bytes(b"")
    offer_dataset(str(site), "study_a", str(data))
    rows = {r["check"]: r for r in site_kit.preflight(str(site))}
    assert all(r["ok"] for r in rows.values()), [r for r in rows.values() if not r["ok"]]
    assert rows["dataset 'study_a'"]["detail"] == str(data / "site-1.npz")  # the name from the certificate
    assert rows["weighting"]["detail"].startswith("jobs run with fedavg.weight_by labelled_rows")
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
    config = json.loads((local / "fedpartial_site.json").read_text())
    (local / "fedpartial_site.json").write_text(json.dumps({**config, "weighting": {"weight_rule": "median"}}))
    assert "'weighting' holds ['weight_rule']; a client decides" in \
        {r["check"]: r for r in site_kit.preflight(str(site))}["site configuration"]["detail"]
    (local / "fedpartial_site.json").write_text(json.dumps(config))
    failed = sorted(name for name, r in rows.items() if not r["ok"])
    assert failed == ["allow-list", "certificates", "dataset 'study_a'", "logs stay here", "no code with jobs",
                      "privacy policy", "server"], failed
    assert rows["server"]["detail"].startswith(f"cannot connect to the server localhost:{PORT} "
                                               f"(startup/fed_client.json servers[0].service.target) within 5 s")
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


def test_offer_dataset_warns_when_the_sites_file_is_not_there_and_refuses_the_server(site, server, tmp_path, capsys):
    empty, full = tmp_path / "empty", tmp_path / "full"
    empty.mkdir()
    full.mkdir()
    (full / "site-1.npz").write_bytes(b"")
    cli.main(["offer-dataset", str(site), "a", str(empty)])
    warning = f"warning: no site-1.npz or site-1/ in {empty}: a job naming 'a' fails at this site"
    assert warning in capsys.readouterr().err
    cli.main(["offer-dataset", str(site), "b", str(full)])
    assert "warning" not in capsys.readouterr().err
    with pytest.raises(SystemExit) as code:
        cli.main(["offer-dataset", str(server), "a", str(full)])
    assert code.value.code == 2 and "is the server's kit: datasets are offered by site kits" in capsys.readouterr().err


def test_preflight_of_the_server_checks_its_port(server):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            taken.bind(("", PORT))
        except OSError:
            pytest.skip(f"port {PORT} is in use here")
        taken.listen(1)
        row = next(r for r in site_kit.preflight(str(server)) if r["check"] == "server")
        assert not row["ok"] and row["detail"].startswith(f"port {PORT} (startup/fed_server.json servers[0].service."
                                                          f"target) is taken by another process")
    row = next(r for r in site_kit.preflight(str(server)) if r["check"] == "server")
    assert row["ok"] and row["detail"] == f"port {PORT} is free for the server (startup/fed_server.json " \
                                          f"servers[0].service.target)"


def test_the_kit_writes_temporary_files_and_torch_caches_inside_itself(site):
    env = site_kit.kit_env("/v/bin/python", base={"PATH": "/usr/bin", "TMPDIR": "/tmp"}, kit=str(site))
    assert env["TMPDIR"] == str(site / "tmp") and (site / "tmp").is_dir()
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(site / "tmp" / "torchinductor")
    assert env["XDG_CACHE_HOME"] == str(site / "tmp" / "cache") and env["PATH"] == "/v/bin:/usr/bin"


def test_the_console_log_rotates_by_size(tmp_path):
    from fedpartial.site.console_log import copy

    log = tmp_path / "console.log"
    copy(io.BytesIO(b"".join(b"line %02d\n" % i for i in range(10))), str(log), max_bytes=24, backups=2)
    # 8 bytes a line, 3 lines a file: the newest lines stay, the two files before them, older ones dropped
    assert log.read_bytes() == b"line 09\n"
    assert (tmp_path / "console.log.1").read_bytes() == b"line 06\nline 07\nline 08\n"
    assert (tmp_path / "console.log.2").read_bytes() == b"line 03\nline 04\nline 05\n"
    assert not (tmp_path / "console.log.3").exists()


def _stored_job(store: Path, job_id: str, status: str, days_old: float) -> Path:
    folder = store / job_id
    folder.mkdir(parents=True)
    (folder / "meta").write_text(json.dumps({"job_id": job_id, "status": status}))
    (folder / "data").write_bytes(b"x" * 100)
    stamp = time.time() - days_old * 86400
    for path in (folder / "meta", folder / "data", folder):
        os.utime(path, (stamp, stamp))
    return folder


def test_status_and_clean_of_the_server_cover_its_job_store(server, tmp_path, capsys):
    store = tmp_path / "store" / "jobs-storage"
    assert site_kit.server_job_store(str(server)) == str(store)
    done = _stored_job(store, JOB_A, "FINISHED:COMPLETED", days_old=40)
    running = _stored_job(store, JOB_B, "RUNNING", days_old=40)  # a long job: old, never removed
    info = site_kit.status(str(server))
    size = sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
    assert (info["job_store"], info["job_store_jobs"], info["job_store_bytes"]) == (str(store), 2, size)
    cli.main(["status", str(server)])
    assert f"job store   {store}: 2 job(s)" in capsys.readouterr().out
    gone = site_kit.clean(str(server), older_than_days=30)
    assert [j["path"] for j in gone] == [str(done)] and not done.exists() and running.exists()


def test_the_kits_log_config_lowers_the_two_known_flare_races_only(site, tmp_path):
    import logging
    import logging.config

    from fedpartial.site.log_filter import LOGGERS, NOTE

    written = site_kit.write_log_config(str(site))
    assert written == str(site / "local" / "log_config.json")
    config = json.loads(Path(written).read_text())
    default = json.loads((site / "local" / "log_config.json.default").read_text())
    assert config["handlers"] == default["handlers"] and config["loggers"]["root"] == default["loggers"]["root"]
    assert site_kit.write_log_config(str(site)) is None  # a kit's own file is kept
    # FLARE's error file as the kit writes it: what reaches it at ERROR
    errors, everything = tmp_path / "error_log.txt", tmp_path / "log.txt"
    config["handlers"] = {"errors": {"class": "logging.FileHandler", "level": "ERROR", "filename": str(errors)},
                          "all": {"class": "logging.FileHandler", "level": "INFO", "filename": str(everything),
                                  "formatter": "plain"}}
    config["formatters"] = {"plain": {"format": "%(levelname)s %(message)s"}}
    config["loggers"]["root"] = {"level": "INFO", "handlers": ["errors", "all"]}
    logging.config.dictConfig(config)
    try:
        blob, receiver, cell = (logging.getLogger(n) for n in LOGGERS)
        blob.error("blob_cb threw: 'NoneType' object has no attribute 'get_widget'\nTraceback (most recent call "
                   "last):\n  File \".../nvflare/private/fed/server/server_commands.py\", line 306, in process")
        receiver.error("Stream error: blob_cb threw AttributeError: 'NoneType' object has no attribute 'get_widget'")
        cell.error("[ME=server O=server D=server.:847b6b4 CH=sm__STREAM TP=sm__DATA SCH=server_command "
                   "STP=get_run_info SEQ=0] cannot send to 'server.dbb67c7a-fda9': target_unreachable")
        assert errors.read_text() == ""
        lines = everything.read_text().splitlines()  # kept in log.txt as WARNING, the note on the first line
        assert lines[0] == f"WARNING blob_cb threw: 'NoneType' object has no attribute 'get_widget'{NOTE}"
        assert [line.split()[0] for line in lines if NOTE in line] == ["WARNING"] * 3
        # the same loggers' other errors keep their level
        blob.error("blob_cb threw: 'NoneType' object has no attribute 'get_widget'\n  File \"x/aggregator.py\"")
        cell.error("[ME=server SCH=task STP=train] cannot send to 'site-1.job': target_unreachable")
        receiver.error("Stream error: blob_cb threw ValueError: bad model")
        assert len(errors.read_text().splitlines()) == 4
    finally:
        for name in LOGGERS:
            logging.getLogger(name).filters.clear()
        logging.getLogger().handlers.clear()
