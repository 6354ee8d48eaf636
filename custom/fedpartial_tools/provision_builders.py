"""NVFlare provisioning builders for fedpartial consortia (listed under ``builders:`` in project.yml).

:class:`SitePolicyBuilder` writes the site policy that lets the server and every site run jobs
from the *installed* fedpartial runtime without trusting code that travels with jobs:

* ``local/resources.json``: FLARE's ``resources.json.default`` with the fedpartial package prefix
  added to ``class_allow_list`` (the component allow-list FLARE enforces for jobs without code);
* ``local/authorization.json``: FLARE's ``authorization.json.default`` with the ``byoc`` right
  taken from every role (unless ``allow_byoc``), so a job that carries code in ``app/custom`` is
  refused;
* ``local/privacy.json`` on every site (optional): a copy of the consortium's privacy policy.

FLARE reads ``resources.json`` / ``authorization.json`` before their ``.default`` files, which
stay as FLARE wrote them (a site can diff its policy against FLARE's defaults). The builder
must come after ``StaticFileBuilder`` in ``builders:``. ``nvflare provision`` imports it, so run
provisioning with ``custom/`` on PYTHONPATH (``provisioning/provision.sh`` does).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from typing import Optional, Sequence

from nvflare.lighter.constants import ProvFileName
from nvflare.lighter.spec import Builder, Project, ProvisionContext

RESOURCES_JSON = "resources.json"
AUTHORIZATION_JSON = "authorization.json"
PRIVACY_JSON = "privacy.json"
BYOC = "byoc"
CLASS_ALLOW_LIST = "class_allow_list"


def all_admin_rights() -> list:
    """Every right FLARE 2.9 checks for admin commands (command names and their categories):
    what a role written as ``"any"`` holds, listed one by one so that one right can be removed."""
    from nvflare.apis.fl_constant import AdminCommandNames
    from nvflare.security.security import CommandCategory

    names = {v for k, v in vars(AdminCommandNames).items() if k.isupper() and isinstance(v, str)}
    names |= {v for k, v in vars(CommandCategory).items() if k.isupper() and isinstance(v, str)}
    names.add("server-predeployed-flwr")
    names.discard(BYOC)
    return sorted(names)


def without_byoc(policy: dict) -> dict:
    """An authorization policy (``authorization.json`` format 1.0) in which no role has the byoc
    right; every other right keeps its condition. A role given as one expression (``"any"``)
    is expanded to every right with that expression (FLARE has no "all but" form)."""
    out = copy.deepcopy(policy)
    permissions = out.get("permissions")
    if not isinstance(permissions, dict) or not permissions:
        raise ValueError(f"authorization policy has no 'permissions' dict: {policy}")
    for role, rights in list(permissions.items()):
        if isinstance(rights, (str, list)):
            rights = {right: copy.deepcopy(rights) for right in all_admin_rights()}
        elif not isinstance(rights, dict):
            raise ValueError(f"authorization policy: rights of role '{role}' must be a dict or an expression, "
                             f"got {type(rights).__name__}")
        rights[BYOC] = "none"
        permissions[role] = rights
    return out


def with_class_prefixes(resources: dict, prefixes: Sequence[str]) -> dict:
    """``resources`` (a ``resources.json``) with ``prefixes`` appended to its ``class_allow_list``."""
    out = copy.deepcopy(resources)
    allow = out.get(CLASS_ALLOW_LIST)
    if not isinstance(allow, list):
        raise ValueError(f"resources has no '{CLASS_ALLOW_LIST}' list (FLARE 2.9's StaticFileBuilder writes one)")
    for prefix in prefixes:
        if prefix not in allow:
            allow.append(prefix)
    return out


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} '{path}' does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} '{path}' is not valid JSON: {e}") from None


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=2) + "\n")


class SitePolicyBuilder(Builder):
    """Writes ``local/resources.json`` (class allow-list), ``local/authorization.json`` (byoc) and
    optionally ``local/privacy.json`` into the server's and every site's kit.

    Args:
        allow_byoc: keep FLARE's byoc right (project_admin, lead) so jobs may carry code in
            ``app/custom``. False (default): no role has it; jobs run from the installed runtime.
        class_prefixes: entries added to ``class_allow_list``; FLARE matches an entry ending in
            ``.`` as a package prefix (``"fedpartial."`` allows every fedpartial component).
        privacy_file: a site privacy policy (FLARE's ``privacy.json`` format) copied into every
            site kit as ``local/privacy.json``; absolute, or relative to the folder provisioning
            runs in. ``None`` / "" = none (FLARE's ``privacy.json.sample`` only).
    """

    def __init__(self, allow_byoc: bool = False, class_prefixes: Sequence[str] = ("fedpartial.",),
                 privacy_file: Optional[str] = None):
        if not isinstance(allow_byoc, bool):
            raise ValueError(f"SitePolicyBuilder: allow_byoc must be true or false, got {allow_byoc!r}")
        prefixes = [class_prefixes] if isinstance(class_prefixes, str) else list(class_prefixes or [])
        for prefix in prefixes:
            if not isinstance(prefix, str) or not prefix or ("." not in prefix):
                raise ValueError(f"SitePolicyBuilder: class_prefixes entry {prefix!r} must be a package prefix "
                                 f"ending in '.' (e.g. 'fedpartial.') or a dotted class path")
        self.allow_byoc = allow_byoc
        self.class_prefixes = prefixes
        self.privacy_file = os.path.abspath(privacy_file) if privacy_file else None

    def initialize(self, project: Project, ctx: ProvisionContext):
        if self.privacy_file:  # fail before any kit is written
            privacy = _read_json(self.privacy_file, "SitePolicyBuilder privacy_file")
            if not isinstance(privacy, dict):
                raise ValueError(f"SitePolicyBuilder privacy_file '{self.privacy_file}' must hold a JSON object")

    def build(self, project: Project, ctx: ProvisionContext):
        server = project.get_server()
        for participant in ([server] if server else []) + list(project.get_clients()):
            local = ctx.get_local_dir(participant)
            resources_default = os.path.join(local, ProvFileName.RESOURCES_JSON_DEFAULT)
            authz_default = os.path.join(local, ProvFileName.AUTHORIZATION_JSON_DEFAULT)
            for path in (resources_default, authz_default):
                if not os.path.isfile(path):
                    raise RuntimeError(f"SitePolicyBuilder: '{path}' is missing; list "
                                       f"nvflare.lighter.impl.static_file.StaticFileBuilder before this builder")
            resources = with_class_prefixes(_read_json(resources_default, "resources"), self.class_prefixes)
            _write_json(os.path.join(local, RESOURCES_JSON), resources)
            policy = _read_json(authz_default, "authorization policy")
            _write_json(os.path.join(local, AUTHORIZATION_JSON), policy if self.allow_byoc else without_byoc(policy))
            if self.privacy_file and participant is not server:
                shutil.copyfile(self.privacy_file, os.path.join(local, PRIVACY_JSON))
