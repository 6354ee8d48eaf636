"""Certificate expiry of provisioned startup kits: what a site checks daily (``fedpartial-site
cert-expiry KIT``), so it ships in the runtime wheel. The tooling's :mod:`fedpartial_tools.certs`
adds renewal and the root-CA folder.
"""
from __future__ import annotations

import datetime
import glob
import os
import re
from typing import Dict, List, Optional, Sequence

ROOT = "root CA"


def _load(path: str):
    from cryptography import x509

    with open(path, "rb") as f:
        return x509.load_pem_x509_certificate(f.read())


def _cn(cert) -> str:
    from cryptography.x509.oid import NameOID

    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return names[0].value if names else "?"


def _kits(path: str) -> List[str]:
    """Kit folders (with ``startup/``) at or under ``path``; of one participant only the kit of the newest
    ``prod_NN`` counts (an older kit of a renewed participant is no longer the one in use)."""
    path = os.path.abspath(path)
    found = sorted({os.path.dirname(os.path.dirname(p)) for pattern in ("*.crt", "rootCA.pem")
                    for p in glob.glob(os.path.join(path, "**", "startup", pattern), recursive=True)})
    if os.path.isdir(os.path.join(path, "startup")) and path not in found:
        found.append(path)
    newest: Dict[tuple, str] = {}
    for kit in found:
        prod = os.path.dirname(kit)
        key = (os.path.dirname(prod), os.path.basename(kit))
        if re.fullmatch(r"prod_\d+", os.path.basename(prod)):
            if key not in newest or os.path.basename(prod) > os.path.basename(os.path.dirname(newest[key])):
                newest[key] = kit
        else:
            newest[(kit, "")] = kit
    return sorted(newest.values())


def expiry_report(path: str, warn_days: float = 30, now: Optional[datetime.datetime] = None) -> List[dict]:
    """One row per certificate of the kits at / under ``path`` (a kit, a ``prod_NN`` folder or a provisioning
    workspace), plus each distinct root CA once.

    Args:
        path: a startup kit, a folder of kits, or a provisioning workspace.
        warn_days: a certificate with fewer days left than this is ``WARN``.
        now: the time to compare with (UTC; default: now).

    Returns:
        rows ``{"name", "kind", "cn", "not_after", "days_left", "status", "file"}``; ``status`` is ``ok``,
        ``WARN`` or ``EXPIRED``; ``days_left`` is a float (negative once expired).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"'{path}' does not exist")
    now = now or datetime.datetime.now(datetime.timezone.utc)
    rows, roots = [], {}

    def row(name, kind, cert, file):
        left = (cert.not_valid_after_utc - now).total_seconds() / 86400.0
        status = "EXPIRED" if left <= 0 else ("WARN" if left < warn_days else "ok")
        return {"name": name, "kind": kind, "cn": _cn(cert), "not_after": cert.not_valid_after_utc.isoformat(),
                "days_left": left, "status": status, "file": file}

    for kit in _kits(path):
        startup = os.path.join(kit, "startup")
        for base, kind in (("server.crt", "server"), ("client.crt", "")):
            f = os.path.join(startup, base)
            if os.path.isfile(f):
                if not kind:
                    kind = "admin" if os.path.isfile(os.path.join(startup, "fed_admin.json")) else "site"
                rows.append(row(os.path.basename(kit), kind, _load(f), f))
                break
        ca = os.path.join(startup, "rootCA.pem")
        if os.path.isfile(ca):
            cert = _load(ca)
            roots.setdefault(cert.fingerprint(cert.signature_hash_algorithm).hex(), (cert, ca))
    if not rows and not roots:
        raise FileNotFoundError(f"no startup kit (startup/*.crt) at or under '{path}'")
    return [row(ROOT, "root CA", c, f) for c, f in roots.values()] + rows


def format_report(rows: Sequence[dict], warn_days: float) -> str:
    lines = [f"{'participant':34s} {'kind':8s} {'expires (UTC)':20s} {'days left':>9s}  status"]
    for r in rows:
        lines.append(f"{r['name']:34s} {r['kind']:8s} {r['not_after'][:19].replace('T', ' '):20s} "
                     f"{r['days_left']:9.1f}  {r['status']}")
    bad = [r for r in rows if r["status"] != "ok"]
    if bad:
        lines.append(f"{len(bad)} certificate(s) expired or with fewer than {warn_days:g} days left: renew them "
                     f"(docs/DEPLOYMENT.md §2.6)")
    return "\n".join(lines)
