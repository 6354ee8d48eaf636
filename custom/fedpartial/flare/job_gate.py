"""The job gate: each provisioned participant checks a job when FLARE deploys it, before anything
of it is built or run.

FLARE calls the ``app_validator`` of a kit's ``local/resources.json`` on every app it deploys to
that participant (the server's app on the server, the client app at each site), after unzipping it
and before the job's process starts; an error refuses the deployment (the job ends
``FINISHED:FAILED_TO_RUN``, the server's log names the site and the reason). Provisioning
(``SitePolicyBuilder``) writes :class:`JobGate` there in every kit. It reads the app's raw configs,
as the job ships them, and refuses:

* anything outside the schema or filled in from the participant's world
  (:func:`fedpartial.flare.job_schema.check_config`): the server also checks the client config
  when the app carries one, so most jobs are refused before any site receives them;
* any file of the app but its two JSON configs and FLARE's signature (:func:`stray_files`): FLARE
  also reads ``.conf`` / ``.yml`` configs, with their own substitutions, and a job process looks for
  ``comm_config.json``, ``resources.json`` and others by walking the participant's kit, job folders
  included;
* at this participant, a job asking more than its limits (:func:`fedpartial.flare.site_config.check_limits`),
  weighting the sites or selecting their images otherwise than it does
  (:func:`fedpartial.flare.site_config.check_participant_tables`), or
  bringing a filter that changes the weights a site sends (:func:`fedpartial.flare.site_config.check_job_filters`);
* at a provisioned server, a round-0 model (``model.pretrained``, ``resume_from``) that is not in
  the server kit's own folders (:func:`fedpartial.flare.site_config.check_server_files`).

The message names the participant, file, component, argument and the value as the job wrote it,
never what FLARE would have made of it.

Before any of that, at submission, the server's :class:`SubmissionGate` (a component of its
``local/resources.json``) refuses a job whose meta sets anything but FLARE's job keys
(:func:`meta_error`), and keeps every config and meta of a job to JSON (:func:`json_configs_only`).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Dict, List, Optional, Tuple

from nvflare.apis.app_validation import AppValidator
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.fuel.utils.config import ConfigFormat, ConfigLoader
from nvflare.fuel.utils.config_factory import ConfigFactory

from fedpartial.flare.job_schema import CLIENT, CONFIG_FILES, SERVER, check_config
from fedpartial.flare.site_config import (SUBMISSION_LIMITS, check_equal_steps, check_job_filters, check_limits,
                                          check_participant_tables, check_server_files, load_site_config,
                                          site_config_path, site_rules)

GATE_PATH = "fedpartial.flare.job_gate.JobGate"
SUBMISSION_GATE_PATH = "fedpartial.flare.job_gate.SubmissionGate"
#: what a job's meta.json may hold: the keys FLARE reads from a submitter
META_KEYS = ("name", "description", "resource_spec", "min_clients", "mandatory_clients", "deploy_map", "scope")
#: what FLARE adds to the meta before the check: ``study`` from the admin session, ``byoc`` from the app
FLARE_META_KEYS = ("study", "byoc")
APP_PREFIX = "app_"
#: what FLARE itself writes into an app it deploys: the job's signature, in every folder
FLARE_SIGNATURE_FILES = (".__nvfl_sig.json", ".__nvfl_submitter.crt")
#: the folder of a job's own code: FLARE's byoc, allowed or refused by the participant's authorization
CODE_FOLDER = "custom"


def stray_files(app_folder: str) -> List[str]:
    """Every file or link of a deployed app that is neither one of its two configs
    (``config/config_fed_{server,client}.json``), FLARE's signature files, nor (when the app has a
    ``custom/`` folder) its code, relative to the app. A job process finds several of its own
    configuration files by walking the participant's kit, job folders included (FLARE's
    ``ConfigFactory.search_config_format``): a ``comm_config.json`` in a job would load the Python
    files of a folder it names as communication drivers, a ``resources.json`` or ``log_config.json``
    stand for the kit's own. So a job's app holds its two configs and nothing else.

    Args:
        app_folder: the app as deployed.
    """
    allowed = {os.path.join("config", name) for name in CONFIG_FILES.values()}
    stray = []
    for root, dirs, files in os.walk(app_folder):
        rel_root = os.path.relpath(root, app_folder)
        if rel_root.split(os.sep)[0] == CODE_FOLDER:
            continue
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            rel = os.path.normpath(os.path.join(rel_root, name))
            link = os.path.islink(os.path.join(root, name))
            if link or not (rel in allowed or name in FLARE_SIGNATURE_FILES):
                stray.append(rel)
    return sorted(stray)


def check_app(app_folder: str, side: str, workspace_root: str, where: str) -> Dict[str, object]:
    """Check one deployed app at one participant.

    Args:
        app_folder: the app as deployed (``<workspace>/<job_id>/app_<name>``), holding ``config/``.
        side: ``server`` or ``client``: which participant checks it.
        workspace_root: the participant's kit (for ``local/fedpartial_site.json``).
        where: who checks, for messages (``the server``, ``site 'site-1'``).

    Returns:
        ``{side: Checked}`` of each config checked.

    Raises:
        ValueError: why the participant refuses the job.
    """
    folder = os.path.join(app_folder, "config")
    byoc = os.path.isdir(os.path.join(app_folder, CODE_FOLDER))  # a linked custom/ is a stray file
    stray = stray_files(app_folder)
    if stray:
        shown = stray[:5] + ([f"... {len(stray) - 5} more"] if len(stray) > 5 else [])
        raise ValueError(f"{where} refuses the job: its app holds {shown}; a job's app is its configs "
                         f"(config/{', config/'.join(CONFIG_FILES.values())}, JSON) and nothing else: FLARE "
                         f"would read other files of a job as this participant's own")
    sides = [side] + ([CLIENT] if side == SERVER else [])
    config = load_site_config(workspace_root)
    rules = site_rules(config)
    # named relative to the kit: a refusal reaches the submitter, a kit's path is the site's own
    source = (os.path.relpath(config["path"], workspace_root) if config
              else os.path.relpath(site_config_path(workspace_root), workspace_root) + ", defaults")
    out, raws = {}, {}
    for s in sides:
        path = os.path.join(folder, CONFIG_FILES[s])
        if not os.path.isfile(path):
            if s == side:
                raise ValueError(f"{where} refuses the job: its app has no {CONFIG_FILES[s]}")
            continue
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{where} refuses the job: {CONFIG_FILES[s]} cannot be read: {e}") from None
        raws[s] = raw
        try:
            out[s] = check_config(raw, s, byoc=byoc)
        except ValueError as e:
            raise ValueError(f"{where} refuses the job: {e}") from None
    check_limits(out[side], rules, where, source)
    check_participant_tables(out[side], config, side, where, source)
    for s, checked in out.items():
        check_job_filters(checked, config, where, raws[s] if s == CLIENT else None)
    if side == SERVER and config is not None:
        check_server_files(out[side], workspace_root, where)
        check_equal_steps(out.get(CLIENT), config, where, source)
    return out


class JobGate(AppValidator):
    """FLARE ``app_validator`` of a provisioned kit (``local/resources.json``): :func:`check_app`
    on every app deployed here.

    Args:
        side: ``server`` or ``client``; "" = from the kit (a server's holds ``startup/fed_server.json``).
    """

    def __init__(self, side: str = ""):
        super().__init__()
        if side not in ("", SERVER, CLIENT):
            raise ValueError(f"JobGate side must be '{SERVER}' or '{CLIENT}', got {side!r}")
        self.side = side
        self.logger = logging.getLogger(type(self).__name__)

    def validate(self, app_folder: str) -> Tuple[str, dict]:
        app_folder = os.path.abspath(app_folder)
        root = os.path.dirname(os.path.dirname(app_folder))  # <kit>/<job_id>/app_<name>
        side = self.side or (SERVER if os.path.isfile(os.path.join(root, "startup", "fed_server.json")) else CLIENT)
        name = os.path.basename(app_folder)
        name = name[len(APP_PREFIX):] if name.startswith(APP_PREFIX) else name
        where = "the server" if side == SERVER else f"site '{name}'"
        try:
            check_app(app_folder, side, root, where)
        except ValueError as e:
            self.logger.error(str(e))
            return str(e), {}
        except Exception as e:  # anything else refuses too, with no internals for the submitter
            self.logger.exception(f"{where}: the job gate failed on {app_folder}")
            return f"{where} refuses the job: its configs could not be checked ({type(e).__name__})", {}
        self.logger.info(f"{where}: job app {os.path.basename(os.path.dirname(app_folder))} passed the job gate")
        return "", {}


def gate_error(workspace_root: str, where: str) -> Optional[str]:
    """Why a provisioned participant's kit cannot be trusted to have checked its jobs ("" = its
    ``local/resources.json`` names :class:`JobGate` as ``app_validator``)."""
    path = os.path.join(workspace_root, "local", "resources.json")
    try:
        with open(path) as f:
            validator = (json.load(f).get("app_validator") or {}).get("path")
    except (OSError, ValueError, AttributeError) as e:
        return f"{where}: its kit's {path} cannot be read ({e})"
    if validator != GATE_PATH:
        return (f"{where}: its kit's {path} names no app_validator {GATE_PATH} (has {validator!r}), so jobs "
                f"are not checked before they are deployed; provision the kit with SitePolicyBuilder")
    if os.path.isfile(os.path.join(workspace_root, "startup", "fed_server.json")):
        with open(path) as f:
            components = json.load(f).get("components") or []
        if not any(isinstance(c, dict) and c.get("path") == SUBMISSION_GATE_PATH for c in components):
            return (f"{where}: its kit's {path} names no component {SUBMISSION_GATE_PATH}, so a job's meta is "
                    f"not checked at submission; provision the kit with SitePolicyBuilder")
    return ""


def meta_error(meta: dict) -> str:
    """Why the server refuses a submitted job's meta ("" = it does not).

    FLARE takes a ``job_id`` from the meta as the job's name on every participant and empties the
    kit's folder of that name before the job gate runs, so ``"job_id": "local"`` deletes each kit's
    policies; any other key is none FLARE or the runtime reads, so nothing of it is kept.

    Args:
        meta: the job's meta as FLARE parsed it at submission.
    """
    if "job_id" in meta:
        return (f"the server refuses the job: its meta sets 'job_id' ({meta['job_id']!r}); FLARE names each job "
                f"itself, and a chosen id is the name of a folder in every participant's kit")
    unknown = sorted(set(meta) - set(META_KEYS) - set(FLARE_META_KEYS))
    if unknown:
        return (f"the server refuses the job: its meta holds {unknown}, keys a job may not set "
                f"(a job's meta.json may hold {list(META_KEYS)})")
    return ""


class _RefusedFormat(ConfigLoader):
    """A loader for a config format this participant does not read: every load refuses."""

    def _refuse(self, *args, **kwargs):
        raise ValueError(f"this participant reads a job's meta and configs as JSON only (meta.json, "
                         f"config/config_fed_{{server,client}}.json); {self.format.value} is refused: its "
                         f"parser fills in environment variables, files and URLs")

    load_config = load_config_from_str = load_config_from_dict = _refuse


def json_configs_only() -> None:
    """Make this process read every FLARE config (a job's ``meta`` included) as JSON only.

    FLARE reads ``meta.conf`` and ``config_fed_*.conf`` with pyhocon when a job brings them, at
    submission, in the server's own process: ``${?VAR}`` fills in its environment, ``include
    file(...)`` / ``url(...)`` any file it can read and any address it can reach, and the result is
    stored as the job's meta, which the submitter reads back. FLARE 2.9 has no setting for the formats
    it reads, so its loaders for HOCON and OmegaConf are replaced by ones that refuse (the red-team
    suite submits such a meta end to end, so a FLARE that stops reading this table fails it).
    """
    for fmt in (ConfigFormat.PYHOCON, ConfigFormat.OMEGACONF):
        ConfigFactory._fmt2Loader[fmt] = _RefusedFormat(fmt)


def upload_error(zip_path: str, job_folder: str, limits: Dict[str, int]) -> str:
    """Why the server refuses a job's upload before FLARE unpacks or parses any of it ("" = it does
    not): more bytes unpacked, more files, or a larger meta than the server kit's
    :data:`fedpartial.flare.site_config.SUBMISSION_LIMITS`. The sizes are the zip's declared ones,
    which bound what Python's zipfile unpacks (it stops at the declared size and checks the CRC).

    Args:
        zip_path: the uploaded zip (FLARE streams the upload to a file).
        job_folder: the job's folder name inside the zip.
        limits: the server's ``max_job_bytes``, ``max_job_files``, ``max_meta_bytes``.
    """
    import zipfile

    def refuse(what, value, key):
        return (f"the server refuses the job: {what} {value:,} is beyond its limit of {limits[key]:,} ('{key}' in "
                f"local/fedpartial_site.json of the server's kit)")

    try:
        uploaded = os.path.getsize(zip_path)
        if uploaded > limits["max_job_bytes"]:
            return refuse("its upload of", uploaded, "max_job_bytes")
        with zipfile.ZipFile(zip_path) as zf:
            infos = zf.infolist()
    except (OSError, zipfile.BadZipFile) as e:
        return f"the server refuses the job: its upload is not a zip it can read ({type(e).__name__})"
    if len(infos) > limits["max_job_files"]:
        return refuse("its number of files and folders", len(infos), "max_job_files")
    unpacked = sum(i.file_size for i in infos)
    if unpacked > limits["max_job_bytes"]:
        return refuse("its files unpacked, bytes:", unpacked, "max_job_bytes")
    for info in infos:
        if info.filename.startswith(f"{job_folder}/meta.") and info.file_size > limits["max_meta_bytes"]:
            return refuse(f"its {info.filename[len(job_folder) + 1:]}, bytes:", info.file_size, "max_meta_bytes")
    return ""


def bounded_uploads(limits: Dict[str, int]) -> None:
    """Make this process check a job's upload with :func:`upload_error` before FLARE's
    ``JobMetaValidator`` unpacks its meta and FLARE stores the job. FLARE fires no event before
    that, so the validator its ``submit_job`` command builds is replaced by one that checks first
    (the red-team suite submits an oversized job end to end, so a FLARE that stops building it
    there fails it).

    Args:
        limits: the server's :data:`fedpartial.flare.site_config.SUBMISSION_LIMITS`.
    """
    from nvflare.private.fed.server import job_cmds
    from nvflare.private.fed.server.job_meta_validator import JobMetaValidator

    class BoundedJobMetaValidator(JobMetaValidator):
        def validate(self, job_name, job_data):
            if isinstance(job_data, str):
                error = upload_error(job_data, job_name, limits)
                if error:
                    return False, error, {}
            elif isinstance(job_data, (bytes, bytearray)) and len(job_data) > limits["max_job_bytes"]:
                return False, (f"the server refuses the job: its upload of {len(job_data):,} bytes is beyond its "
                               f"limit of {limits['max_job_bytes']:,} ('max_job_bytes')"), {}
            return super().validate(job_name, job_data)

    job_cmds.JobMetaValidator = BoundedJobMetaValidator


class SubmissionGate(FLComponent):
    """The server's check of a job at submission (``local/resources.json`` component, handling
    FLARE's ``SUBMIT_JOB`` as FLARE's confidential-computing manager does): :func:`meta_error`
    refuses the job before it is stored. Built in the server's process, it also makes that process
    read configs as JSON only (:func:`json_configs_only`) and check an upload's size before FLARE
    unpacks it (:func:`bounded_uploads`, with the server kit's limits once the system starts)."""

    def __init__(self):
        super().__init__()
        json_configs_only()
        bounded_uploads(dict(SUBMISSION_LIMITS))

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        if event_type == EventType.SYSTEM_START:
            root = fl_ctx.get_engine().get_workspace().get_root_dir()
            rules = site_rules(load_site_config(root))
            bounded_uploads({k: rules[k] for k in SUBMISSION_LIMITS})
            return
        if event_type != EventType.SUBMIT_JOB:
            return
        error = meta_error(fl_ctx.get_prop(FLContextKey.JOB_META) or {})
        if error:
            self.log_error(fl_ctx, error)
            fl_ctx.set_prop(FLContextKey.JOB_BLOCK_REASON, error, sticky=False, private=True)
