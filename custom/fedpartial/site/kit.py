"""What a site's operator does with its startup kit, from the runtime wheel alone (no checkout):
start and stop the kit, see its state, check it before going live, clean up old job folders, and
write the systemd unit that runs it. The command line is :mod:`fedpartial.site.command`
(``fedpartial-site``); these are plain functions so that tests and the tooling use the same code.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

from fedpartial.site.kit_processes import kill_workspace_processes, live_workspace_processes

#: a job folder of a kit is named by its job id (FLARE's uuid4)
_JOB_ID_LENGTH = 36
#: the kit's own temporary folder: TMPDIR and torch's caches point here, so a kit writes inside its folder only
KIT_TMP = "tmp"
#: KIT/console.log (what the FLARE process prints when started in the background) rotates at this size
CONSOLE_LOG_BYTES = 20 << 20
CONSOLE_LOG_BACKUPS = 3


def kit_kind(kit: str) -> str:
    """``server`` or ``site`` for a provisioned kit; a clear error for anything else.

    Args:
        kit: the kit's folder (holding ``startup/`` and ``local/``).
    """
    startup = os.path.join(kit, "startup")
    if os.path.isfile(os.path.join(startup, "fed_server.json")):
        return "server"
    if os.path.isfile(os.path.join(startup, "fed_client.json")):
        return "site"
    raise FileNotFoundError(f"'{kit}' is not a server or site startup kit (no startup/fed_server.json or "
                            f"startup/fed_client.json)")


def kit_name(kit: str) -> str:
    """The participant's name: the common name of its certificate (the kit's folder may be named
    otherwise)."""
    from fedpartial.site.certificates import _cn, _load

    startup = os.path.join(kit, "startup")
    for cert in ("client.crt", "server.crt"):
        if os.path.isfile(os.path.join(startup, cert)):
            return _cn(_load(os.path.join(startup, cert)))
    return os.path.basename(os.path.abspath(kit))


def kit_env(python: Optional[str] = None, base: Optional[dict] = None, kit: Optional[str] = None) -> Dict[str, str]:
    """The environment a kit runs in: ``python``'s folder first on PATH, since FLARE's
    ``sub_start.sh`` runs ``python3`` from PATH (default: this interpreter, the venv the runtime
    wheel is installed in); with ``kit``, temporary files and torch's caches in ``KIT/tmp``
    (``TMPDIR``, ``TORCHINDUCTOR_CACHE_DIR``, ``XDG_CACHE_HOME``) instead of ``/tmp/torchinductor_<user>``
    and the user's home, so that the kit's folder is all it writes (the systemd unit allows no more)."""
    env = dict(os.environ if base is None else base)
    folder = os.path.dirname(os.path.abspath(python or sys.executable))
    env["PATH"] = folder + os.pathsep + env.get("PATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if kit:
        tmp = os.path.join(os.path.abspath(kit), KIT_TMP)
        os.makedirs(tmp, mode=0o700, exist_ok=True)
        env.update(TMPDIR=tmp, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "torchinductor"),
                   XDG_CACHE_HOME=os.path.join(tmp, "cache"))
    return env


def daemon_pid(kit: str) -> Optional[int]:
    """The pid of the kit's restart loop (``daemon_pid.fl``) when it is alive."""
    try:
        with open(os.path.join(kit, "daemon_pid.fl")) as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def server_job_store(kit: str) -> Optional[str]:
    """The server's job store (``job_manager``'s ``uri_root`` in ``local/resources.json``, else its
    ``.default``); None for a site kit or a file without one."""
    local = os.path.join(kit, "local")
    for name in ("resources.json", "resources.json.default"):
        path = os.path.join(local, name)
        if os.path.isfile(path):
            with open(path) as f:
                try:
                    resources = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"'{path}' is not JSON: {e}") from None
            for component in resources.get("components", []):
                if component.get("id") == "job_manager":
                    return (component.get("args") or {}).get("uri_root")
            return None
    return None


def write_log_config(kit: str) -> Optional[str]:
    """Write the kit's ``local/log_config.json`` from FLARE's ``log_config.json.default`` with the
    filter that writes two known, harmless FLARE races as WARNING (:mod:`fedpartial.site.log_filter`).
    A kit that has its own ``log_config.json`` keeps it. Returns the file written, or None."""
    from fedpartial.site.log_filter import with_known_races

    local = os.path.join(kit, "local")
    out, default = os.path.join(local, "log_config.json"), os.path.join(local, "log_config.json.default")
    if os.path.exists(out) or not os.path.isfile(default):
        return None
    with open(default) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"'{default}' is not JSON: {e}") from None
    with open(out + ".tmp", "w") as f:
        f.write(json.dumps(with_known_races(config), indent=4) + "\n")
    os.replace(out + ".tmp", out)
    return out


def keep_server_storage_in(server_kit: str, root: str) -> str:
    """Point the server's job store and snapshot store (default ``/tmp/nvflare/...``, lost on a
    reboot) into ``root``: writes ``local/resources.json`` from itself or its ``.default``. Returns
    the file written."""
    local = os.path.join(server_kit, "local")
    src = os.path.join(local, "resources.json")
    if not os.path.isfile(src):
        src += ".default"
    with open(src) as f:
        text = f.read().replace("/tmp/nvflare", os.path.abspath(root))
    out = os.path.join(local, "resources.json")
    with open(out, "w") as f:
        f.write(text)
    return out


def start(kit: str, storage: Optional[str] = None, foreground: bool = False, python: Optional[str] = None) -> int:
    """Start the kit's restart loop (FLARE's ``startup/sub_start.sh``), which restarts the FLARE
    process if it dies. Temporary files and torch's caches go to ``KIT/tmp`` (:func:`kit_env`); a kit
    without ``local/log_config.json`` gets FLARE's default with two known races lowered to WARNING
    (:func:`write_log_config`).

    Args:
        kit: the kit's folder.
        storage: server only: keep the job store and snapshots here instead of ``/tmp/nvflare``.
        foreground: run the loop in this process (``exec``; what the systemd unit does) instead of
            in the background in its own session.
        python: the interpreter the kit runs (default: this one).

    Returns:
        the loop's pid (background), or never returns (foreground).

    Raises:
        RuntimeError: the kit is already running.
    """
    kit = os.path.abspath(kit)
    kind = kit_kind(kit)
    if storage:
        if kind != "server":
            raise ValueError(f"--storage is for the server kit; '{kit}' is a site kit")
        os.makedirs(storage, exist_ok=True)
        keep_server_storage_in(kit, storage)
    running = daemon_pid(kit)
    if running:
        raise RuntimeError(f"'{kit}' is already running (restart loop pid {running})")
    for flag in ("shutdown.fl", "daemon_pid.fl"):
        if os.path.exists(os.path.join(kit, flag)):
            os.remove(os.path.join(kit, flag))
    write_log_config(kit)
    env = kit_env(python, kit=kit)
    cmd = ["bash", os.path.join(kit, "startup", "sub_start.sh")]
    if foreground:  # systemd keeps the output in its journal
        os.chdir(kit)
        os.execvpe("bash", cmd, env)
    # the output goes through a size-rotating writer (it ends when the kit's last process closes the pipe)
    writer = subprocess.Popen([os.path.abspath(python or sys.executable), "-m", "fedpartial.site.console_log",
                               os.path.join(kit, "console.log"), "--max-bytes", str(CONSOLE_LOG_BYTES),
                               "--backups", str(CONSOLE_LOG_BACKUPS)],
                              cwd=kit, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc = subprocess.Popen(cmd, cwd=kit, env=env, stdout=writer.stdin, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        writer.stdin.close()
    return proc.pid


def stop(kit: str, wait: float = 60.0) -> Dict[int, str]:
    """Stop the kit and wait until every process it started is gone.

    Asks the restart loop to stop (``shutdown.fl``: it ends the FLARE process and exits within about
    10 s), waits up to ``wait`` s, then kills whatever of the kit is still running (its job
    processes included). For a site, prefer the admin console's ``shutdown client`` when the server is
    up: the server then knows the site left.

    Args:
        kit: the kit's folder.
        wait: seconds to wait for a clean stop before killing.

    Returns:
        the processes that had to be killed (pid -> command line).

    Raises:
        RuntimeError: naming the processes that survived.
    """
    kit = os.path.abspath(kit)
    kit_kind(kit)
    if daemon_pid(kit) or live_workspace_processes(kit):
        open(os.path.join(kit, "shutdown.fl"), "w").close()
    killed = kill_workspace_processes(kit, wait=wait)
    left = live_workspace_processes(kit)
    if left:
        raise RuntimeError(f"'{kit}': still running after stop: " +
                           "; ".join(f"{pid} {cmd[:100]}" for pid, cmd in sorted(left.items())))
    for flag in ("shutdown.fl", "daemon_pid.fl", "pid.fl"):
        if os.path.exists(os.path.join(kit, flag)):
            os.remove(os.path.join(kit, flag))
    return killed


def _store_status(folder: str) -> str:
    """A job's status in the server's job store (its ``meta`` file), "" when unreadable."""
    try:
        with open(os.path.join(folder, "meta")) as f:
            return str(json.load(f).get("status", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def job_folders(kit: str) -> List[dict]:
    """The job folders a kit holds: ``KIT/<job_id>/`` (FLARE's run folder: logs, TensorBoard, the
    app), ``KIT/fedpartial_state/<job_id>/`` (per-image state of the methods) and, for the server,
    each job of its job store (``start --storage``: the job, its status and its downloadable result).

    Returns:
        ``[{"job_id", "path", "bytes", "modified", "in_store", "status"}]``, oldest first; ``status``
        is the job store's (e.g. ``FINISHED:COMPLETED``, ``RUNNING``), "" for the kit's own folders.
    """
    out = []
    store = server_job_store(kit) if os.path.isfile(os.path.join(kit, "startup", "fed_server.json")) else None
    for base in (kit, os.path.join(kit, "fedpartial_state"), store):
        if not base or not os.path.isdir(base):
            continue
        for name in os.listdir(base):
            path = os.path.join(base, name)
            if len(name) != _JOB_ID_LENGTH or name.count("-") != 4 or not os.path.isdir(path):
                continue
            size, newest = 0, os.path.getmtime(path)
            for folder, _, files in os.walk(path):
                for f in files:
                    try:
                        st = os.stat(os.path.join(folder, f))
                    except OSError:
                        continue
                    size, newest = size + st.st_size, max(newest, st.st_mtime)
            out.append({"job_id": name, "path": path, "bytes": size, "modified": newest,
                        "in_store": base == store, "status": _store_status(path) if base == store else ""})
    return sorted(out, key=lambda j: j["modified"])


def running_job_ids(kit: str) -> set:
    """Job ids whose processes run now (their command line names the job's folder)."""
    ids = set()
    for cmd in live_workspace_processes(kit).values():
        for word in cmd.replace("/", " ").split():
            if len(word) == _JOB_ID_LENGTH and word.count("-") == 4:
                ids.add(word)
    return ids


def clean(kit: str, older_than_days: float, dry_run: bool = False, now: Optional[float] = None) -> List[dict]:
    """Remove job folders not touched for ``older_than_days`` days; never a running job's, and of the
    server's job store only finished jobs (a submitted or running one stays, whatever its age).

    Args:
        kit: the kit's folder.
        older_than_days: age (last modification of any file in the folder) above which a folder goes.
        dry_run: list what would go, remove nothing.
        now: the time to compare with (default: now).

    Returns:
        the folders removed (or that would be), as :func:`job_folders` rows.
    """
    if older_than_days < 0:
        raise ValueError(f"older_than_days must be >= 0, got {older_than_days}")
    kit_kind(kit)
    limit = (now or time.time()) - older_than_days * 86400
    running = running_job_ids(kit)
    gone = [j for j in job_folders(kit) if j["modified"] < limit and j["job_id"] not in running
            and (not j["in_store"] or j["status"].startswith("FINISHED"))]
    if not dry_run:
        for job in gone:
            shutil.rmtree(job["path"])
    return gone


def status(kit: str) -> dict:
    """What an operator checks first: running or not, the runtime, the datasets offered, the
    certificate's days left, the job folders and their disk use, the last line of the log."""
    from fedpartial.flare.common import runtime_identity
    from fedpartial.flare.job_gate import gate_error
    from fedpartial.flare.site_config import load_site_config, site_rules
    from fedpartial.site.certificates import expiry_report

    kit = os.path.abspath(kit)
    kind = kit_kind(kit)
    jobs = job_folders(kit)
    own, stored = [j for j in jobs if not j["in_store"]], [j for j in jobs if j["in_store"]]
    cert = [r for r in expiry_report(kit) if r["kind"] != "root CA"]
    last = ""
    log = os.path.join(kit, "log.txt")
    if os.path.isfile(log):
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
            last = lines[-1] if lines else ""
    config = load_site_config(kit)
    return {"kit": kit, "name": kit_name(kit), "kind": kind, "running": daemon_pid(kit) is not None,
            "processes": len(live_workspace_processes(kit)), "runtime": runtime_identity(),
            "datasets": None if config is None else config["datasets"],
            "certificate_days_left": round(cert[0]["days_left"], 1) if cert else None,
            "job_folders": len(own), "job_bytes": sum(j["bytes"] for j in own),
            "job_store": server_job_store(kit) if kind == "server" else None,
            "job_store_jobs": len(stored), "job_store_bytes": sum(j["bytes"] for j in stored), "last_log_line": last}


def preflight(kit: str, warn_days: float = 30, timeout: float = 5.0) -> List[dict]:
    """Checks to run before a kit goes live (and after every change): each
    ``{"check", "ok", "detail"}``. Nothing is changed.

    Args:
        kit: the kit's folder.
        warn_days: a certificate with fewer days left fails the check.
        timeout: seconds to wait for the server's port to answer.
    """
    from fedpartial.flare.allowed import CLASS_ALLOW_LIST
    from fedpartial.flare.common import runtime_identity
    from fedpartial.flare.job_gate import gate_error
    from fedpartial.flare.site_config import PARTICIPANT_TABLES, load_site_config, participant_table, site_rules
    from fedpartial.site.certificates import expiry_report

    kit = os.path.abspath(kit)
    kind = kit_kind(kit)
    local = os.path.join(kit, "local")
    out = []

    def check(name, ok, detail):
        out.append({"check": name, "ok": bool(ok), "detail": detail})

    try:
        import monai  # noqa: F401
        import nvflare
        import torch
        check("python", True, f"{sys.executable}: nvflare {nvflare.__version__}, torch {torch.__version__}, "
                              f"fedpartial {runtime_identity()}")
    except ImportError as e:
        check("python", False, f"{sys.executable} cannot import {e.name}: install the lock and the wheel")
    rows = expiry_report(kit, warn_days=warn_days)
    bad = [r for r in rows if r["status"] != "ok"]
    check("certificates", not bad, "; ".join(f"{r['name']} ({r['kind']}): {r['days_left']:.0f} days left, "
                                             f"{r['status']}" for r in rows))

    def read(name):
        path = os.path.join(local, name)
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            return e

    resources = read("resources.json")
    if isinstance(resources, Exception):
        check("allow-list", False, f"local/resources.json: {resources}")
    else:
        allowed = resources.get("class_allow_list", [])
        extra = sorted(set(allowed) - set(CLASS_ALLOW_LIST))
        check("allow-list", not extra and resources.get("class_list_enforcement_mode", "enforce") == "enforce",
              f"{len(allowed)} exact classes" + (f"; not the runtime's: {extra}" if extra else ""))
        gate = gate_error(kit, "this kit")
        check("job gate", not gate, gate or "every job is checked against the schema and this kit's limits when "
                                          "it is deployed (app_validator JobGate)")
        if kind == "site":
            streaming = resources.get("allow_log_streaming", True)
            check("logs stay here", streaming is False, "allow_log_streaming: false" if streaming is False else
                  "allow_log_streaming is on: job logs go to the server")
    authz = read("authorization.json")
    if isinstance(authz, Exception):
        check("no code with jobs", False, f"local/authorization.json: {authz}")
    else:
        roles = authz.get("permissions", {})
        byoc = sorted(r for r, rights in roles.items() if not isinstance(rights, dict) or rights.get("byoc") != "none")
        check("no code with jobs", not byoc, "no role has the byoc right" if not byoc else f"byoc for {byoc}")
    try:
        config = load_site_config(kit)
        check("site configuration", config is not None, config["path"] if config else
              "no local/fedpartial_site.json: this kit would run as a development site (job paths accepted)")
        if config is not None:
            rules = site_rules(config)
            check("floors and limits", True, ", ".join(f"{k} {v}" for k, v in rules.items()))
            for table in PARTICIPANT_TABLES:
                own = participant_table(config, "client" if kind == "site" else "server", table)
                check(table, True, "jobs run with " + ", ".join(f"{k} {v}" for k, v in own.items()))
    except ValueError as e:
        check("site configuration", False, str(e))
        config = None
    if config is not None and kind == "site":
        name = kit_name(kit)
        for dataset, folder in sorted(config["datasets"].items()):
            problem, found = dataset_problem(kit, folder)
            check(f"dataset '{dataset}'", not problem, problem or found)
        if not config["datasets"]:
            check("datasets", False, "the site offers no dataset yet: fedpartial-site offer-dataset KIT NAME FOLDER")
    if kind == "site":
        privacy = read("privacy.json")
        check("privacy policy", not isinstance(privacy, Exception),
              "local/privacy.json" if not isinstance(privacy, Exception) else f"local/privacy.json: {privacy}")
    free = shutil.disk_usage(kit).free
    check("disk", free > 2 << 30, f"{free / 2 ** 30:.1f} GiB free in {kit}")
    check("server", *server_reachable(kit, kind, timeout))
    return out


def dataset_problem(kit: str, folder: str) -> tuple:
    """``(problem, file)``: whether ``folder`` holds this site's file (``<site>.npz`` or a site folder
    ``<site>/``, the site named by its certificate) readable by this user; ``problem`` is "" when it does."""
    name = kit_name(kit)
    found = [p for p in (os.path.join(folder, f"{name}.npz"), os.path.join(folder, name)) if os.path.exists(p)]
    if not found:
        return f"no {name}.npz or {name}/ in {folder}", ""
    if not os.access(found[0], os.R_OK) or (os.path.isdir(found[0]) and not os.access(found[0], os.X_OK)):
        return f"{found[0]} is not readable by this user (uid {os.getuid()}): grant the kit's user read access", ""
    return "", found[0]


def server_address(kit: str) -> tuple:
    """``(host, port, where)`` of the server a kit connects to (a site) or listens as (the server):
    ``servers[0].service.target`` of ``startup/fed_client.json`` / ``fed_server.json``."""
    config = "fed_server.json" if kit_kind(kit) == "server" else "fed_client.json"
    path = os.path.join(kit, "startup", config)
    try:
        with open(path) as f:
            target = json.load(f)["servers"][0]["service"]["target"]
        host, _, port = str(target).rpartition(":")
        return host, int(port), f"startup/{config} servers[0].service.target"
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"'{path}': no server address 'host:port' in servers[0].service.target ({e})") from None


def server_reachable(kit: str, kind: str, timeout: float = 5.0) -> tuple:
    """``(ok, detail)``. A site: a TCP connection to the server's address within ``timeout`` s. The
    server: its port answers (the kit runs) or is free to listen on (it does not run yet)."""
    import socket

    try:
        host, port, where = server_address(kit)
    except ValueError as e:
        return False, str(e)
    running = kind == "server" and daemon_pid(kit) is not None
    if kind == "server" and not running:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError as e:
                return False, f"port {port} ({where}) is taken by another process, so the server cannot listen: {e}"
        return True, f"port {port} is free for the server ({where})"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        if kind == "server":
            return False, f"the server runs but {host}:{port} ({where}) does not answer: {e}"
        return False, (f"cannot connect to the server {host}:{port} ({where}) within {timeout:g} s: {e}; is the "
                       f"server running, does '{host}' resolve here, may this machine reach port {port} "
                       f"(firewall)?")
    return True, f"{host}:{port} answers ({where})"


def systemd_unit(kit: str, user: str = "flare", python: Optional[str] = None, storage: Optional[str] = None,
                 gpu: bool = False, memory_max: str = "80%", cpu_quota: str = "") -> str:
    """A systemd unit that runs the kit as the unprivileged ``user``, brings it back after a reboot
    or a crash, and confines it: the kit's folder (and the server's job store) are the only paths it
    may write, no capabilities, no device but the GPUs of a GPU site, Internet and local sockets
    only, system calls of a plain service. ``systemd-analyze security --offline=true`` scores it
    under 2 (GPU sites a little more).

    Args:
        kit: the kit's folder on the machine it runs on (absolute).
        user: the OS user that owns the kit (never root: the kit holds the site's private key and
            its jobs read the site's data).
        python: the venv's interpreter holding the runtime (default: this one).
        storage: server only: its job store (as ``start --storage``), writable besides the kit.
        gpu: the site trains on NVIDIA GPUs: its devices stay visible (``PrivateDevices`` off).
        memory_max: ``MemoryMax=`` of the kit and every job it runs (bytes with K/M/G/T, or a share of
            the machine's memory such as ``80%``); "" = no limit.
        cpu_quota: ``CPUQuota=`` (``100%`` = one core, ``400%`` = four); "" = no limit.
    """
    import re

    kit = os.path.abspath(kit)
    name = os.path.basename(kit)
    python = os.path.abspath(python or sys.executable)
    site_cmd = os.path.join(os.path.dirname(python), "fedpartial-site")
    extra = f" --storage {os.path.abspath(storage)}" if storage else ""
    for value, key, pattern in ((memory_max, "memory_max", r"\d+(\.\d+)?[KMGT]?|\d+(\.\d+)?%|infinity"),
                                (cpu_quota, "cpu_quota", r"\d+(\.\d+)?%")):
        if value and not re.fullmatch(pattern, str(value)):
            raise ValueError(f"systemd unit of '{kit}': {key} {value!r} is not a systemd value ({pattern})")
    writable = " ".join([kit] + ([os.path.abspath(storage)] if storage else []))
    limits = "".join(f"{k}={v}\n" for k, v in (("MemoryMax", memory_max), ("CPUQuota", cpu_quota)) if v)
    # GPU sites: /dev/nvidia* must stay visible; everything else is the same
    devices = ("# GPU site: the host's devices stay visible (/dev/nvidia*)\nPrivateDevices=no\n" if gpu else
               "PrivateDevices=yes\n")
    return f"""[Unit]
Description=NVIDIA FLARE kit {name} (fedpartial)
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
User={user}
Group={user}
WorkingDirectory={kit}
ExecStart={site_cmd} start {kit} --foreground{extra}
ExecStop={site_cmd} stop {kit} --wait 60
Restart=on-failure
RestartSec=30
TimeoutStopSec=90
UMask=0077
{limits}# Confinement: the kit's folder{" and the job store" if storage else ""} are all it writes (temporary files and
# torch's caches go to {kit}/{KIT_TMP}, set by fedpartial-site start); data folders are read-only
ProtectSystem=strict
ReadWritePaths={writable}
ProtectHome=yes
PrivateTmp=yes
{devices}PrivateMounts=yes
NoNewPrivileges=yes
CapabilityBoundingSet=
AmbientCapabilities=
RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
ProtectClock=yes
ProtectHostname=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectProc=invisible
RemoveIPC=yes
KeyringMode=private
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged
# a call outside the filter fails (EPERM) instead of killing the process
SystemCallErrorNumber=EPERM

[Install]
WantedBy=multi-user.target
"""
