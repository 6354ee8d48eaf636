"""The processes of a FLARE system started from startup kits: start a kit in its own session, stop
its process group, and find / end every process whose command line names a state folder (no broad
``pkill``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Dict, Optional


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
        # only FLARE processes (python -m nvflare..., startup/sub_start.sh) and the kit's console-log writer:
        # never a user's editor or tail
        if "nvflare" not in cmd and "/startup/" not in cmd and "fedpartial.site.console_log" not in cmd:
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
