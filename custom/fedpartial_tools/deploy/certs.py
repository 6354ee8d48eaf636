"""Certificates of provisioned startup kits: expiry report, renewal, and the root-CA folder that
``nvflare cert approve`` signs with (a site joining with its own private key).

NVFlare 2.9 facts this module relies on (``nvflare/lighter/impl/cert.py``, ``nvflare/tool/cert``):

* ``nvflare provision`` keeps the root CA and every participant's key and certificate in
  ``<workspace>/<project>/state/cert.json`` (``root_cert``, ``root_pri_key``, one entry per participant
  name). Re-provisioning the same workspace *reuses* a participant's stored certificate, so its expiry
  does not move; :func:`renew` drops the entries of the named participants so the next provisioning
  issues them new keys and certificates, signed by the same root CA.
* Participant certificates are valid 360 days (fixed in ``CertBuilder``), never beyond the root CA.
* ``nvflare cert approve -c CA_DIR`` wants ``CA_DIR/{rootCA.pem, rootCA.key, ca.json}``;
  :func:`export_ca_dir` writes them from ``state/cert.json`` so the provisioned system's own root CA
  signs a site's certificate request.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
from typing import Dict, List, Sequence

from fedpartial.site.certificates import ROOT, _cn, _kits, _load, expiry_report, format_report  # noqa: F401


def state_file(workspace: str, project: str) -> str:
    path = os.path.join(workspace, project, "state", "cert.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"'{path}' does not exist: '{workspace}' is not the provisioning workspace of "
                                f"project '{project}' (provision into it first)")
    return path


def renew(workspace: str, project: str, names: Sequence[str]) -> List[str]:
    """Make the next ``nvflare provision`` of ``workspace`` issue new keys and certificates for ``names``
    (same root CA): their entries leave ``state/cert.json`` (a copy of the old file stays next to it as
    ``cert.json.<UTC time>``). Returns the names dropped.

    Args:
        workspace: the provisioning workspace (holds ``<project>/state/cert.json``).
        project: the project name (``name:`` of project.yml).
        names: participant names, or ``["all"]`` for every participant (not the root CA).
    """
    path = state_file(workspace, project)
    state = json.load(open(path))
    known = [k for k in state if k not in ("root_cert", "root_pri_key")]
    names = known if list(names) == ["all"] else list(names)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"{unknown} not in '{path}' (participants there: {known})")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    shutil.copy2(path, f"{path}.{stamp}")
    for n in names:
        del state[n]
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)
    return names


def export_ca_dir(workspace: str, project: str, server_kit: str) -> Dict[str, str]:
    """Write the provisioned project's root CA as the folder ``nvflare cert approve -c`` reads, and the
    project profile ``--profile`` reads, into ``<workspace>/<project>/state/ca/`` (private: it holds the root
    CA's key).

    Args:
        workspace: the provisioning workspace.
        project: the project name.
        server_kit: the server's kit of the newest ``prod_NN`` (its ``fed_server.json`` gives host, port,
            scheme and connection security of the profile).

    Returns:
        ``{"ca_dir", "profile", "fingerprint"}`` (the root CA's SHA256 fingerprint, as ``nvflare package
        --fingerprint`` expects it).
    """
    from nvflare.tool.cert.fingerprint import cert_fingerprint_sha256
    import yaml

    state = json.load(open(state_file(workspace, project)))
    cfg_path = os.path.join(server_kit, "startup", "fed_server.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"'{server_kit}' is not a server kit (no startup/fed_server.json)")
    server = json.load(open(cfg_path))["servers"][0]
    host, port = server["service"]["target"].rsplit(":", 1)
    ca_dir = os.path.join(workspace, project, "state", "ca")
    os.makedirs(ca_dir, mode=0o700, exist_ok=True)
    with open(os.path.join(ca_dir, "rootCA.pem"), "w") as f:
        f.write(state["root_cert"])
    fd = os.open(os.path.join(ca_dir, "rootCA.key"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(state["root_pri_key"])
    root = _load(os.path.join(ca_dir, "rootCA.pem"))
    fingerprint = cert_fingerprint_sha256(root)
    if _cn(root) != project:
        raise ValueError(f"the root CA of '{workspace}' is for project '{_cn(root)}', not '{project}'")
    with open(os.path.join(ca_dir, "ca.json"), "w") as f:
        json.dump({"project": project, "created_at": root.not_valid_before_utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
                   "provision_version": "00", "rootCA_fingerprint": fingerprint}, f, indent=1)
    profile = {"name": project, "scheme": server["service"].get("scheme", "grpc"),
               "connection_security": server.get("connection_security", "mtls"),
               "server": {"host": host, "fed_learn_port": int(port),
                          "admin_port": int(server.get("admin_port", port))}}
    profile_path = os.path.join(ca_dir, "project_profile.yml")
    with open(profile_path, "w") as f:
        yaml.safe_dump(profile, f, sort_keys=False)
    return {"ca_dir": ca_dir, "profile": profile_path, "fingerprint": fingerprint}
