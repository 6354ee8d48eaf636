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
