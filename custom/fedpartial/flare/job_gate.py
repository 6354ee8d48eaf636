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
* at this participant, a job asking more than its limits (:func:`fedpartial.flare.site_config.check_limits`);
* at a provisioned server, a round-0 model (``model.pretrained``, ``resume_from``) that is not in
  the server kit's own folders (:func:`fedpartial.flare.site_config.check_server_files`).

The message names the participant, file, component, argument and the value as the job wrote it,
never what FLARE would have made of it.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Dict, List, Optional, Tuple

from nvflare.apis.app_validation import AppValidator

from fedpartial.flare.job_schema import CLIENT, CONFIG_FILES, SERVER, check_config
from fedpartial.flare.site_config import (check_limits, check_server_files, load_site_config, site_config_path,
                                          site_rules)

GATE_PATH = "fedpartial.flare.job_gate.JobGate"
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
    out = {}
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
        try:
            out[s] = check_config(raw, s, byoc=byoc)
        except ValueError as e:
            raise ValueError(f"{where} refuses the job: {e}") from None
    check_limits(out[side], rules, where, source)
    if side == SERVER and config is not None:
        check_server_files(out[side], workspace_root, where)
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
    return ""
