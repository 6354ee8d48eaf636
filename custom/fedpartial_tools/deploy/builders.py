"""NVFlare provisioning builders for fedpartial consortia (listed under ``builders:`` in project.yml).

:class:`SitePolicyBuilder` writes the site policy that lets the server and every site run jobs
from the *installed* fedpartial runtime without trusting code that travels with jobs:

* ``local/resources.json``: FLARE's ``resources.json.default`` with its ``class_allow_list`` (the
  component allow-list FLARE enforces for jobs without code) REPLACED by the exact class paths of
  :data:`fedpartial.flare.allowed.CLASS_ALLOW_LIST`; the job gate
  (:class:`fedpartial.flare.job_gate.JobGate`) as its ``app_validator``, which checks every job
  against the schema and the participant's limits when it is deployed; live log streaming off: a
  site gets ``allow_log_streaming: false`` and no ``SiteLogStreamer``, the server no ``JobLogReceiver``;
  a site's resource manager and consumer are :mod:`fedpartial.flare.site_resources`' (FLARE's GPU
  accounting, at most ``max_concurrent_jobs`` jobs at once);
* ``local/authorization.json``: FLARE's ``authorization.json.default`` with the ``byoc`` right
  taken from every role (unless ``allow_byoc``), so a job that carries code in ``app/custom`` is
  refused, and shell commands (``ls``, ``cat``, ``grep`` ...) and a job's error lines
  (``show_errors``) only for roles of the site's own organisation (``"o:site"``);
* ``local/privacy.json`` on every site (optional): a copy of the consortium's privacy policy;
* ``local/fedpartial_site.json`` in every kit (:mod:`fedpartial.flare.site_config`): the datasets a
  site offers to jobs (``datasets`` of the builder, or a site's own ``datasets:`` entry in
  ``project.yml``; empty = none yet, the site adds them), and the participant's privacy floors and
  resource limits written out with their defaults for it to edit; its presence makes the kit a
  provisioned participant, which refuses data paths and jobs naming no runtime version.

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
#: the server's tries at starting a queued job (FLARE's scheduler waits 10, 20, 40 ... at most 600 s
#: between them, then ends the job FINISHED:CANT_SCHEDULE): about two days for a site running
#: its max_concurrent_jobs or a site offline
SCHEDULE_TRIES = 300
#: a site kit's resource manager and consumer (FLARE's default's paths -> fedpartial's)
SITE_RESOURCES = {
    "nvflare.app_common.resource_managers.gpu_resource_manager.GPUResourceManager":
        "fedpartial.flare.site_resources.SiteResourceManager",
    "nvflare.app_common.resource_consumers.gpu_resource_consumer.GPUResourceConsumer":
        "fedpartial.flare.site_resources.SiteResourceConsumer",
}
AUTHORIZATION_JSON = "authorization.json"
PRIVACY_JSON = "privacy.json"
SITE_CONFIG = "fedpartial_site.json"
BYOC = "byoc"
SHELL_COMMANDS = "shell_commands"
OWN_SITE = "o:site"
CLASS_ALLOW_LIST = "class_allow_list"
ENFORCEMENT_MODE = "class_list_enforcement_mode"
ALLOW_LOG_STREAMING = "allow_log_streaming"
APP_VALIDATOR = "app_validator"
# the site component that streams job logs to the server, the server one that stores them, and the
# job component the site's streamer adds to every job (it must then be on the site's allow-list)
SITE_LOG_STREAMER = "nvflare.app_common.logging.site_log_streamer.SiteLogStreamer"
JOB_LOG_RECEIVER = "nvflare.app_common.logging.job_log_receiver.JobLogReceiver"
JOB_LOG_STREAMER = "nvflare.app_common.logging.job_log_streamer.JobLogStreamer"


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


def shell_command_rights() -> list:
    """The admin commands of FLARE's ``shell_commands`` category (``cat``, ``grep``, ``ls`` ...)."""
    from nvflare.security.security import COMMAND_CATEGORIES, CommandCategory

    return sorted(c for c, category in COMMAND_CATEGORIES.items() if category == CommandCategory.SHELL_COMMANDS)


def _role_rights(policy: dict, what: str) -> dict:
    """``policy["permissions"]`` (copied) with each role as a dict of rights: a role given as one
    expression (``"any"``) is expanded to every right, byoc included, with that expression (FLARE
    has no "all but" form)."""
    permissions = policy.get("permissions")
    if not isinstance(permissions, dict) or not permissions:
        raise ValueError(f"{what}: authorization policy has no 'permissions' dict: {policy}")
    out = {}
    for role, rights in permissions.items():
        if isinstance(rights, (str, list)):
            rights = {right: copy.deepcopy(rights) for right in all_admin_rights() + [BYOC]}
        elif not isinstance(rights, dict):
            raise ValueError(f"{what}: rights of role '{role}' must be a dict or an expression, "
                             f"got {type(rights).__name__}")
        out[role] = copy.deepcopy(rights)
    return out


def without_byoc(policy: dict) -> dict:
    """An authorization policy (``authorization.json`` format 1.0) in which no role has the byoc
    right; every other right keeps its condition."""
    out = copy.deepcopy(policy)
    out["permissions"] = _role_rights(policy, "without_byoc")
    for rights in out["permissions"].values():
        rights[BYOC] = "none"
    return out


def shell_at_own_site(policy: dict) -> dict:
    """An authorization policy in which a role holding shell commands holds them only at sites of
    its own organisation (``"o:site"``): what a site's files and logs show (data paths, counts,
    tracebacks) stays with its own organisation's admins. A role without them gets an explicit
    ``"none"``. The per-command rights (``ls``, ``cat`` ...) are dropped: FLARE lets them override
    the category."""
    out = copy.deepcopy(policy)
    out["permissions"] = _role_rights(policy, "shell_at_own_site")
    commands = shell_command_rights()
    for rights in out["permissions"].values():
        held = any(rights.get(r, "none") not in ("none", "", [], None) for r in [SHELL_COMMANDS] + commands)
        for command in commands:
            rights.pop(command, None)
        rights[SHELL_COMMANDS] = OWN_SITE if held else "none"
    return out


#: the admin commands that return what a job's processes logged as errors at a participant (a site's
#: error lines name its data paths, class lists and counts)
ERROR_COMMANDS = ("show_errors", "reset_errors")


def errors_at_own_site(policy: dict) -> dict:
    """An authorization policy in which every role sees (and resets) a participant's job errors only
    at participants of its own organisation (``"o:site"``); FLARE's default lets every role with
    ``view`` (project_admin, lead, org_admin, member) read every site's error lines."""
    out = copy.deepcopy(policy)
    out["permissions"] = _role_rights(policy, "errors_at_own_site")
    for rights in out["permissions"].values():
        for command in ERROR_COMMANDS:
            rights[command] = OWN_SITE
    return out


def with_class_allow_list(resources: dict, allow_list: Sequence[str]) -> dict:
    """``resources`` (a ``resources.json``) whose ``class_allow_list`` is ``allow_list`` (FLARE's
    default list is replaced, not extended) and enforced."""
    out = copy.deepcopy(resources)
    if not isinstance(out.get(CLASS_ALLOW_LIST), list):
        raise ValueError(f"resources has no '{CLASS_ALLOW_LIST}' list (FLARE 2.9's StaticFileBuilder writes one)")
    out[CLASS_ALLOW_LIST] = list(allow_list)
    out[ENFORCEMENT_MODE] = "enforce"
    return out


def without_components(resources: dict, paths: Sequence[str]) -> dict:
    """``resources`` without the entries of its ``components`` whose ``path`` is one of ``paths``."""
    out = copy.deepcopy(resources)
    components = out.get("components", [])
    if not isinstance(components, list):
        raise ValueError(f"resources: 'components' must be a list, got {type(components).__name__}")
    out["components"] = [c for c in components if not (isinstance(c, dict) and c.get("path") in paths)]
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


def _dotted(entry, what: str, prefix: bool) -> str:
    """``entry`` if it is a package prefix ending in '.' (``prefix``) or an exact dotted class path."""
    ok = isinstance(entry, str) and entry.endswith(".") == prefix
    if ok:
        parts = (entry[:-1] if prefix else entry).split(".")
        ok = all(part.isidentifier() for part in parts) and (prefix or len(parts) > 1)
    if not ok:
        form = "a package prefix ending in '.' (e.g. 'fedpartial.flare.')" if prefix else \
            "an exact dotted class path (e.g. 'fedpartial.flare.executors.FedPartialExecutor')"
        raise ValueError(f"SitePolicyBuilder: {what} entry {entry!r} must be {form}")
    return entry


class SitePolicyBuilder(Builder):
    """Writes ``local/resources.json`` (class allow-list, log streaming), ``local/authorization.json``
    (byoc, shell commands) and optionally ``local/privacy.json`` into the server's and every site's kit.

    Args:
        allow_byoc: keep FLARE's byoc right (project_admin, lead) so jobs may carry code in
            ``app/custom`` (FLARE then skips the class allow-list for them). False (default): no
            role has it; jobs run from the installed runtime.
        class_allow_list: the exact class paths a job without code may name; they REPLACE FLARE's
            default list (88 entries, log streamers and peer-to-peer Swarm / Cyclic controllers
            among them). ``None`` (default): :data:`fedpartial.flare.allowed.CLASS_ALLOW_LIST`, the
            components the shipped jobs, recipes and ``provisioning/privacy.json`` use.
        class_prefixes: package prefixes ending in ``.`` added to the list, for operators who opt
            in. Weaker than exact paths: a prefix admits every class AND every module-level
            function below it (FLARE builds whatever the path names), test-only components
            included. Default: none.
        allow_log_streaming: False (default): a site's ``resources.json`` has ``allow_log_streaming:
            false`` and no ``SiteLogStreamer``, the server's no ``JobLogReceiver``, so job logs stay
            at the site. True: FLARE's default: each site streams every job's ``error_log.txt``
            (its ERROR records and tracebacks: data file paths, sample and class counts, metric
            values and whatever else an error message quotes) to the server's job store, where the
            job's submitter reads it (``get_job_log``, ``download_job``); ``JobLogStreamer``, which
            the site's streamer adds to every job, is then on the sites' allow-list, so a job may
            also stream its ``log.txt`` / ``log.json`` (every INFO line of the run: data paths,
            counts, per-round metrics).
        privacy_file: a site privacy policy (FLARE's ``privacy.json`` format) copied into every
            site kit as ``local/privacy.json``; absolute, or relative to the folder provisioning
            runs in. ``None`` / "" = none (FLARE's ``privacy.json.sample`` only).
        datasets: ``{name: folder}`` every site offers (written into its
            ``local/fedpartial_site.json``); a client entry of ``project.yml`` with its own
            ``datasets:`` mapping replaces it for that site. Default: none; each site then offers
            its data itself (``fedpartial-site offer-dataset KIT NAME FOLDER``).
        min_sites_per_round: the server's floor of sites behind a published aggregate. ``"all"``
            (default): every site of ``project.yml``, so no job can publish an aggregate of a subset
            of the sites (jobs over different subsets of one round's local models are equations in
            them); a round then waits for every site. A number (>= 2) lets rounds go on without
            some sites.
    """

    def __init__(self, allow_byoc: bool = False, class_allow_list: Optional[Sequence[str]] = None,
                 class_prefixes: Sequence[str] = (), allow_log_streaming: bool = False,
                 privacy_file: Optional[str] = None, datasets: Optional[dict] = None,
                 min_sites_per_round="all"):
        if min_sites_per_round != "all" and (isinstance(min_sites_per_round, bool) or
                                             not isinstance(min_sites_per_round, int) or min_sites_per_round < 2):
            raise ValueError(f"SitePolicyBuilder: min_sites_per_round must be \"all\" or an integer >= 2, "
                             f"got {min_sites_per_round!r}")
        self.min_sites_per_round = min_sites_per_round
        self.datasets = self._datasets(datasets, "datasets")
        for name, value in (("allow_byoc", allow_byoc), ("allow_log_streaming", allow_log_streaming)):
            if not isinstance(value, bool):
                raise ValueError(f"SitePolicyBuilder: {name} must be true or false, got {value!r}")
        if class_allow_list is None:
            from fedpartial.flare.allowed import CLASS_ALLOW_LIST as class_allow_list
        elif isinstance(class_allow_list, str) or not isinstance(class_allow_list, (list, tuple)):
            raise ValueError(f"SitePolicyBuilder: class_allow_list must be a list of class paths, "
                             f"got {class_allow_list!r}")
        prefixes = [class_prefixes] if isinstance(class_prefixes, str) else list(class_prefixes or [])
        self.allow_byoc = allow_byoc
        self.allow_log_streaming = allow_log_streaming
        self.class_allow_list = [_dotted(c, "class_allow_list", prefix=False) for c in class_allow_list]
        self.class_prefixes = [_dotted(p, "class_prefixes", prefix=True) for p in prefixes]
        self.privacy_file = os.path.abspath(privacy_file) if privacy_file else None

    @staticmethod
    def _datasets(value, where: str) -> dict:
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                                  for k, v in value.items()):
            raise ValueError(f"SitePolicyBuilder: {where} must map dataset names to folders, got {value!r}")
        return dict(value)

    def site_config(self, participant, site: bool, num_sites: int = 0) -> dict:
        """The ``fedpartial_site.json`` of a site (its datasets) or of the server (none), with the
        participant's floors, limits, weighting and statistics at their defaults (the server's floors
        and submission limits on sites)."""
        from fedpartial.flare.site_config import (FLOORS, FORMAT_VERSION, FRACTION_BOUNDS, LIMITS, PARTICIPANT_TABLES,
                                                  SITE_FLOORS, SUBMISSION_LIMITS)

        datasets = {}
        if site:
            own = participant.get_prop("datasets")
            datasets = self.datasets if own is None else self._datasets(own, f"'datasets' of {participant.name}")
        floors = {k: v for k, v in {**FLOORS, **FRACTION_BOUNDS}.items() if site == (k in SITE_FLOORS)}
        if not site:
            floors["min_sites_per_round"] = max(FLOORS["min_sites_per_round"], num_sites) \
                if self.min_sites_per_round == "all" else self.min_sites_per_round
        own = {table: dict(site_table if site else server_table)
               for table, (server_table, site_table, _, _) in PARTICIPANT_TABLES.items()}
        if not site:
            own.update(SUBMISSION_LIMITS)
        return {"format_version": FORMAT_VERSION, "datasets": datasets, **floors, **LIMITS, **own}

    def allow_list(self, site: bool) -> list:
        """The ``class_allow_list`` written into a site's (``site``) or the server's kit."""
        out = list(dict.fromkeys(self.class_allow_list + self.class_prefixes))
        if site and self.allow_log_streaming and JOB_LOG_STREAMER not in out:
            out.append(JOB_LOG_STREAMER)
        return out

    def resources(self, default: dict, site: bool) -> dict:
        """The ``resources.json`` of a site (``site``) or the server from FLARE's ``.default``."""
        from fedpartial.flare.job_gate import GATE_PATH, SUBMISSION_GATE_PATH

        out = with_class_allow_list(default, self.allow_list(site))
        out[APP_VALIDATOR] = {"path": GATE_PATH, "args": {"side": "client" if site else "server"}}
        if site:  # FLARE's GPU accounting, plus a count of the jobs the site runs at once
            out["components"] = [dict(c, path=SITE_RESOURCES.get(c.get("path"), c.get("path")))
                                 if isinstance(c, dict) else c for c in out.get("components", [])]
        else:  # a job waiting for a busy site stays queued for days, not FLARE's 10 tries (50 minutes)
            out["components"] = [dict(c, args={**c.get("args", {}), "max_schedule_count": SCHEDULE_TRIES})
                                 if isinstance(c, dict) and c.get("id") == "job_scheduler" else c
                                 for c in out.get("components", [])]
            # the job's meta, checked at submission, before FLARE stores or deploys the job
            out = without_components(out, [SUBMISSION_GATE_PATH])
            out["components"].append({"id": "submission_gate", "path": SUBMISSION_GATE_PATH, "args": {}})
        if self.allow_log_streaming:
            return out
        if site:
            out[ALLOW_LOG_STREAMING] = False
            return without_components(out, [SITE_LOG_STREAMER])
        return without_components(out, [JOB_LOG_RECEIVER])

    def authorization(self, default: dict) -> dict:
        """The ``authorization.json`` from FLARE's ``.default``."""
        return errors_at_own_site(shell_at_own_site(default if self.allow_byoc else without_byoc(default)))

    def initialize(self, project: Project, ctx: ProvisionContext):
        if self.privacy_file:  # fail before any kit is written
            privacy = _read_json(self.privacy_file, "SitePolicyBuilder privacy_file")
            if not isinstance(privacy, dict):
                raise ValueError(f"SitePolicyBuilder privacy_file '{self.privacy_file}' must hold a JSON object")

    def build(self, project: Project, ctx: ProvisionContext):
        server = project.get_server()
        for participant in ([server] if server else []) + list(project.get_clients()):
            site = participant is not server
            local = ctx.get_local_dir(participant)
            resources_default = os.path.join(local, ProvFileName.RESOURCES_JSON_DEFAULT)
            authz_default = os.path.join(local, ProvFileName.AUTHORIZATION_JSON_DEFAULT)
            for path in (resources_default, authz_default):
                if not os.path.isfile(path):
                    raise RuntimeError(f"SitePolicyBuilder: '{path}' is missing; list "
                                       f"nvflare.lighter.impl.static_file.StaticFileBuilder before this builder")
            try:
                resources = self.resources(_read_json(resources_default, "resources"), site)
            except ValueError as e:
                raise ValueError(f"SitePolicyBuilder: '{resources_default}': {e}") from None
            try:
                policy = self.authorization(_read_json(authz_default, "authorization policy"))
            except ValueError as e:
                raise ValueError(f"SitePolicyBuilder: '{authz_default}': {e}") from None
            _write_json(os.path.join(local, RESOURCES_JSON), resources)
            _write_json(os.path.join(local, AUTHORIZATION_JSON), policy)
            _write_json(os.path.join(local, SITE_CONFIG),
                        self.site_config(participant, site, len(list(project.get_clients()))))
            if self.privacy_file and site:
                shutil.copyfile(self.privacy_file, os.path.join(local, PRIVACY_JSON))
