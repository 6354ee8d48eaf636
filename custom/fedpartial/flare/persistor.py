"""Global model persistence in the self-describing fedpartial model format, and the model locator
that cross-site evaluation uses to find the server's models."""
from __future__ import annotations

import os
import shutil
from typing import Dict, List

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import ModelLearnable, ModelLearnableKey, make_model_learnable
from nvflare.app_common.abstract.model_locator import ModelLocator
from nvflare.app_common.abstract.model_persistor import ModelPersistor
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.model_desc import ModelDescriptor

from fedpartial.algorithms.thresholds import threshold_meta
from fedpartial.flare.aggregators import DECISION_THRESHOLDS, METRICS_FILE
from fedpartial.flare.common import (GLOBAL_STATS, app_targets, build_model_from_settings, model_file_meta,
                                     model_settings, runtime_description, runtime_version_error)
from fedpartial.flare.site_config import PRETRAINED_DIR, RESUME_DIR, confined, load_site_config
from fedpartial.training.common import state_dict_numpy

GLOBAL_MODEL_FILE = "global_model.pt"
BEST_MODEL_FILE = "best_global_model.pt"
SERVER_MODELS = {"SRV_global_model": GLOBAL_MODEL_FILE, "SRV_best_global_model": BEST_MODEL_FILE}


def one_client_app_error(fl_ctx: FLContext) -> str:
    """Why a provisioned server refuses the job's deployment ("" = fine): every site must run the
    same app. With two client apps (``deploy_map``), one site could run settings the others do not
    (no training, a filter that zeroes its update), and the average the job's submitter downloads
    would give away another site's local model.

    The job's ``meta.json`` sits in the server's run folder; a job whose deployment cannot be read
    is refused too.
    """
    import json

    run_dir = fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())
    try:
        with open(os.path.join(run_dir, "meta.json")) as f:
            deploy_map = json.load(f).get("deploy_map", {})
    except (OSError, ValueError) as e:
        return f"the server refuses the job: its deploy_map cannot be read ({e})"
    client_apps = [app for app, to_sites in app_targets(deploy_map).items() if to_sites[1]]
    if len(client_apps) > 1:
        return (f"the server refuses the job: its deploy_map gives the sites {len(client_apps)} different apps "
                f"({', '.join(sorted(client_apps))}); every site runs the same app")
    return ""


class FedPartialPersistor(ModelPersistor):
    """Builds the initial global model (seeded) and saves every global model as a self-describing
    file (architecture, arguments, class names, input size, normalisation, task, round, global
    statistics) that ``python -m fedpartial evaluate`` reads with nothing else.

    Args:
        model: the job's model block (same as the executor's).
        seed: seed of the initial weights.
        resume_from: a ``global_model.pt`` written by this persistor (or its folder), e.g. the run
            folder of a job lost in a server crash. The job starts from its weights and global
            statistics, and its ``metrics.json`` is carried over. The workflow's ``start_round``
            must be the file's round + 1 (``num_rounds`` then counts the rounds left).
        runtime_version: the runtime the job was packaged for (``package-job`` writes version and
            content hash); a server whose installed fedpartial differs stops the job at its start, and
            a provisioned server (its kit holds ``local/fedpartial_site.json``) stops a job naming none.

    At a provisioned server, ``pretrained`` and ``resume_from`` are relative paths without ``..``
    in the server kit's own folders, placed there by its operator: ``pretrained`` in
    ``<server kit>/pretrained/``, ``resume_from`` in ``<server kit>/resume/`` (where the operator
    copies a crashed job's run folder). The round-0 model is the consortium's, never a file the job
    brings, and a job reads no other file there, another job's run folder included.

    The model is built when it is first needed (the job's start), not when FLARE builds the
    component: a provisioned server's checks come before anything is allocated.

    The model block's ``pretrained`` (a weights file on the server, see
    :func:`fedpartial.models.pretrained.load_pretrained`) sets the body of the round-0 global
    model; sites get those weights with the first global model and need no file. Ignored when
    resuming (the checkpoint already holds trained weights).
    """

    def __init__(self, model: dict = None, seed: int = 0, resume_from: str = "", runtime_version: str = ""):
        super().__init__()
        self.runtime_version = str(runtime_version or "")
        self.settings = model_settings(model or {})
        self.seed = int(seed)
        self._model = None
        self.resume_from = str(resume_from or "")
        self.run_dir = None
        self._best_copied = False  # best_global_model.pt was copied this round: stamp its thresholds

    @property
    def model(self):
        if self._model is None:
            torch.manual_seed(self.seed)  # the same initial weights wherever and whenever it is built
            self._model = build_model_from_settings(self.settings)
        return self._model

    def _dir(self, fl_ctx: FLContext) -> str:
        if self.run_dir is None:
            self.run_dir = fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())
            os.makedirs(self.run_dir, exist_ok=True)
        return self.run_dir

    def load_model(self, fl_ctx: FLContext) -> ModelLearnable:
        if self.resume_from:
            if self.settings.get("pretrained"):
                self.log_info(fl_ctx, "model.pretrained is ignored: the job resumes from a checkpoint")
            try:
                return self._resume(fl_ctx)
            except Exception as e:  # FLARE's secure logging would show only the exception type
                self.log_error(fl_ctx, f"cannot resume: {e}")
                raise
        if self.settings.get("pretrained"):
            try:
                self._load_pretrained(fl_ctx)
            except Exception as e:  # FLARE's secure logging would show only the exception type
                self.log_error(fl_ctx, f"cannot start from pretrained weights: {e}")
                raise
        return make_model_learnable(state_dict_numpy(self.model), {})

    def _pretrained_path(self, fl_ctx: FLContext) -> str:
        """``model.pretrained`` -> an existing file. A provisioned server reads it from its kit's
        ``pretrained/`` only (never the job's app folder: the round-0 model every site validates is
        the consortium's, not one the job brings). Elsewhere ``~`` is expanded and a relative path
        is looked up in the job's app folder, then in the server's workspace root."""
        raw = str(self.settings["pretrained"])
        workspace = fl_ctx.get_engine().get_workspace()
        if self._provisioned(fl_ctx):
            tried = [confined(os.path.join(workspace.get_root_dir(), PRETRAINED_DIR), raw, "model.pretrained",
                              "the server")]
        elif os.path.isabs(os.path.expanduser(raw)):
            tried = [os.path.expanduser(raw)]
        else:
            tried = [os.path.join(workspace.get_app_dir(fl_ctx.get_job_id()), raw),
                     os.path.join(workspace.get_root_dir(), raw)]
        for path in tried:
            if os.path.isfile(path):
                return path
        raise FileNotFoundError(f"model.pretrained: weights file '{self.settings['pretrained']}' not found on the "
                                f"server (looked for {tried}); copy it there or give an absolute path")

    def _load_pretrained(self, fl_ctx: FLContext) -> None:
        from fedpartial.models.pretrained import load_pretrained

        path = self._pretrained_path(fl_ctx)
        report = load_pretrained(self.model, path, class_names=self.settings["class_names"],
                                 task=self.settings["task"])
        self.log_info(fl_ctx, f"initial global model from pretrained weights: {report['summary']}")

    def _resume(self, fl_ctx: FLContext) -> ModelLearnable:
        from fedpartial.models.io import load_model_file

        path = self.resume_from
        if self._provisioned(fl_ctx):  # a checkpoint the operator put in <kit>/resume/, never another job's folder
            path = confined(os.path.join(fl_ctx.get_engine().get_workspace().get_root_dir(), RESUME_DIR), path,
                            "resume_from", "the server")
        if os.path.isdir(path):
            path = os.path.join(path, GLOBAL_MODEL_FILE)
        saved, meta = load_model_file(path)
        for key in ("class_names", "task"):
            if meta.get(key) != self.settings[key]:
                raise ValueError(f"resume_from '{path}': {key} {meta.get(key)!r} differs from the job's "
                                 f"{self.settings[key]!r}")
        if saved.spec != self.model.spec:
            raise ValueError(f"resume_from '{path}': model {saved.spec} differs from the job's {self.model.spec}")
        last = meta.get("round")
        start = fl_ctx.get_prop(AppConstants.START_ROUND)
        if last is None or start != last + 1:
            raise ValueError(f"resume_from '{path}' holds the global model after round {last} (job "
                             f"{meta.get('job_id')}), but the job starts at round {start}: set start_round="
                             f"{'?' if last is None else last + 1} and num_rounds to the rounds left")
        self.model.load_state_dict(saved.state_dict())
        metrics = os.path.join(os.path.dirname(path), METRICS_FILE)
        if os.path.isfile(metrics) and not os.path.exists(os.path.join(self._dir(fl_ctx), METRICS_FILE)):
            shutil.copyfile(metrics, os.path.join(self._dir(fl_ctx), METRICS_FILE))
        stats = {k: np.asarray(v) if isinstance(v, list) else v for k, v in (meta.get(GLOBAL_STATS) or {}).items()}
        self.log_info(fl_ctx, f"resumed from '{path}' (round {last} of job {meta.get('job_id')}); "
                              f"continuing at round {start}")
        return make_model_learnable(state_dict_numpy(self.model), {GLOBAL_STATS: stats})

    def save_model(self, learnable: ModelLearnable, fl_ctx: FLContext):
        from fedpartial.models.io import save_weights_file

        round_num = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
        meta = learnable.get(ModelLearnableKey.META) or {}
        extra = {"round": None if round_num is None else int(round_num), "job_id": fl_ctx.get_job_id(),
                 GLOBAL_STATS: meta.get(GLOBAL_STATS, {})}
        thresholds = fl_ctx.get_prop(DECISION_THRESHOLDS)
        if thresholds:  # this round's: they describe the previous model, and say so
            extra["decision_thresholds"] = threshold_meta(thresholds, extra["round"])
        save_weights_file(os.path.join(self._dir(fl_ctx), GLOBAL_MODEL_FILE), learnable[ModelLearnableKey.WEIGHTS],
                          self.model.spec, model_file_meta(self.settings, **extra))

    @staticmethod
    def _provisioned(fl_ctx: FLContext) -> bool:
        return load_site_config(fl_ctx.get_engine().get_workspace().get_root_dir()) is not None

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        super().handle_event(event_type, fl_ctx)
        if event_type == EventType.START_RUN:
            provisioned = self._provisioned(fl_ctx)
            wrong_runtime = runtime_version_error(self.runtime_version, "the server", required_at_site=provisioned)
            if not wrong_runtime and provisioned:
                wrong_runtime = one_client_app_error(fl_ctx)
            if wrong_runtime:
                # logged in full first: the panic reason alone may reach the log shortened
                self.log_error(fl_ctx, wrong_runtime)
                self.system_panic(wrong_runtime, fl_ctx)
            else:
                self.log_info(fl_ctx, runtime_description())
        elif event_type == AppEventType.GLOBAL_BEST_MODEL_AVAILABLE:
            # The selector judged the model sent out at the start of this round, which is the one
            # last saved: copy that file.
            src = os.path.join(self._dir(fl_ctx), GLOBAL_MODEL_FILE)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(self._dir(fl_ctx), BEST_MODEL_FILE))
                self._best_copied = True
                self.log_info(fl_ctx, f"new best global model saved to {BEST_MODEL_FILE}")
        elif event_type == EventType.END_RUN:
            self._write_model_card(fl_ctx)
        elif event_type == AppEventType.AFTER_AGGREGATION and self._best_copied:
            # The aggregator has just chosen thresholds from the validation the selector judged, i.e.
            # of the copied model: they replace the older ones the copy carried.
            self._best_copied = False
            self._stamp_best(fl_ctx)

    def _write_model_card(self, fl_ctx: FLContext) -> None:
        """``model_card.md`` / ``.json`` beside the result models (:mod:`fedpartial.flare.model_card`);
        a failure is logged, never raised: the models are saved already."""
        from fedpartial.flare.model_card import write_model_card

        try:
            workspace = fl_ctx.get_engine().get_workspace()
            job_id = fl_ctx.get_job_id()
            if not os.path.isfile(os.path.join(self._dir(fl_ctx), GLOBAL_MODEL_FILE)):
                return  # no round was aggregated: nothing to describe
            _, md = write_model_card(self._dir(fl_ctx), workspace.get_app_config_dir(job_id), self.settings,
                                     GLOBAL_MODEL_FILE, BEST_MODEL_FILE, str(job_id))
            self.log_info(fl_ctx, f"model card written: {md}")
        except Exception as e:
            self.log_error(fl_ctx, f"model card not written: {type(e).__name__}: {e}")

    def _stamp_best(self, fl_ctx: FLContext) -> None:
        """Store this round's decision thresholds in ``best_global_model.pt`` when they describe its model."""
        from fedpartial.models.io import read_model_file, save_weights_file

        record = fl_ctx.get_prop(DECISION_THRESHOLDS)
        path = os.path.join(self._dir(fl_ctx), BEST_MODEL_FILE)
        if not record or not os.path.isfile(path):
            return
        payload = read_model_file(path)
        meta = dict(payload["meta"])
        if meta.get("round") != record["model_round"]:
            self.log_warning(fl_ctx, f"{BEST_MODEL_FILE} holds the model of round {meta.get('round')}, the sites "
                                     f"validated that of round {record['model_round']}: thresholds left as they were")
            return
        meta["decision_thresholds"] = threshold_meta(record, meta["round"])
        save_weights_file(path, {k: v.numpy() for k, v in payload["state_dict"].items()}, payload["spec"], meta,
                          validate=False)

    def get_model_inventory(self, fl_ctx: FLContext) -> Dict[str, ModelDescriptor]:
        return {name: ModelDescriptor(name=name, location=os.path.join(self._dir(fl_ctx), f), model_format="fedpartial",
                                      props={}) for name, f in SERVER_MODELS.items()
                if os.path.isfile(os.path.join(self._dir(fl_ctx), f))}

    def get_model(self, model_file: str, fl_ctx: FLContext) -> ModelLearnable:
        from fedpartial.models.io import load_model_file

        if model_file not in SERVER_MODELS:  # only this job's own files, never a path from the config
            raise ValueError(f"model '{model_file}' is not one of the server's models {sorted(SERVER_MODELS)}")
        model, _ = load_model_file(os.path.join(self._dir(fl_ctx), SERVER_MODELS[model_file]))
        return make_model_learnable(state_dict_numpy(model), {})


class FedPartialModelLocator(ModelLocator):
    """Gives cross-site evaluation the server's final and best global models.

    Args:
        persistor_id: component id of the FedPartialPersistor.
    """

    def __init__(self, persistor_id: str = "persistor"):
        super().__init__()
        self.persistor_id = persistor_id

    def _persistor(self, fl_ctx) -> FedPartialPersistor:
        return fl_ctx.get_engine().get_component(self.persistor_id)

    def get_model_names(self, fl_ctx: FLContext) -> List[str]:
        return list(self._persistor(fl_ctx).get_model_inventory(fl_ctx).keys())

    def locate_model(self, model_name, fl_ctx: FLContext) -> DXO:
        learnable = self._persistor(fl_ctx).get_model(model_name, fl_ctx)
        return DXO(DataKind.WEIGHTS, data=learnable[ModelLearnableKey.WEIGHTS])
