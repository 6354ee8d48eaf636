"""Helpers shared by several test modules (not tests themselves)."""
import socket
import ssl
from pathlib import Path
from unittest import mock

from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants


def aggregator_fl_ctx(run_dir, round_num=0, global_weights=None) -> FLContext:
    """An FLContext as the server aggregator sees it: round, number of rounds, the global model and
    an engine whose run folder is ``run_dir`` (where metrics.json goes)."""
    fl_ctx = FLContext()
    fl_ctx.set_prop(AppConstants.CURRENT_ROUND, round_num, private=True, sticky=False)
    fl_ctx.set_prop(AppConstants.NUM_ROUNDS, 3, private=True, sticky=False)
    fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(global_weights or {}, {}), private=True,
                    sticky=False)
    engine = mock.MagicMock()
    engine.get_workspace.return_value.get_run_dir.return_value = str(run_dir)
    engine.get_component.return_value = None
    fl_ctx.set_prop("__engine__", engine, private=True, sticky=False)
    return fl_ctx


def tls_reply(cert_file: Path, key_file: Path, ca: Path, port: int) -> bytes:
    """What a server on localhost answers a plain HTTPS request made with this client certificate
    (b"" = dropped at the handshake)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    ctx.check_hostname = False
    ctx.load_cert_chain(str(cert_file), str(key_file))
    with socket.create_connection(("localhost", port), timeout=10) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                s.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
                return s.recv(64)
        except (ssl.SSLError, ConnectionError):
            return b""


def running_system(root: Path, name: str, sites, site_policy: dict):
    """Provision a one-machine project into ``root`` with ``site_policy`` (SitePolicyBuilder's
    arguments), start the server and ``sites`` (each kit in its own session), and yield
    ``{"root", "prod", "kits", "env"}`` once the server lists every site; afterwards every process
    naming ``root`` is gone (asserted). Use it from a module-scoped fixture."""
    import contextlib

    import pytest

    from fedpartial_tools.deploy import admin, processes, provision

    @contextlib.contextmanager
    def system():
        env = provision.kit_env(str(root))
        procs = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("HOME", env["HOME"])
            mp.setenv("TMPDIR", env["TMPDIR"])
            mp.delenv("NVFLARE_STARTUP_KIT_DIR", raising=False)
            project = provision.localhost_project(name, provision.free_port(), list(sites), site_policy=site_policy)
            prod = Path(provision.provision(provision.write_project(str(root / "project.yml"), project),
                                            str(root / "provision"), env=env))
            provision.keep_server_storage_in(str(prod / "localhost"), str(root / "storage"))
            try:
                procs.append(processes.start_kit(str(prod / "localhost"), str(root / "server.console.log"), env))
                kits = {role: kit for kit, role in admin.admin_kits(str(prod)).items()}
                session = admin.new_admin_session(kits["project_admin"], timeout=60)
                for site in sites:
                    procs.append(processes.start_kit(str(prod / site), str(root / f"{site}.console.log"), env))
                admin.wait_for_clients(session, list(sites), timeout=90)
                session.close()
                yield {"root": root, "prod": prod, "kits": kits, "env": env}
            finally:
                for proc in reversed(procs):
                    processes.stop_group(proc, grace=2.0)
                processes.kill_workspace_processes(str(root))
                left = processes.live_workspace_processes(str(root))
                assert not left, f"processes left behind: {left}"

    return system()


def package_modules(root: Path) -> dict:
    """``{dotted name: file}`` of every module of the package at ``root`` (a package by its ``__init__``)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def import_cycles(graph: dict) -> list:
    """The import cycles of ``graph`` (``{module: modules it imports}``): every back edge of a
    depth-first search, as the cycle it closes."""
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def outer_pip_cache() -> str:
    """pip's cache of the user running the tests (as setup.sh filled it), for the venvs the tests make
    with another HOME: packages already fetched are not fetched again."""
    import os

    if os.environ.get("PIP_CACHE_DIR"):
        return os.environ["PIP_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pip")
