"""FLARE 2.9 recipes: one per method (FedLSM, FedMLP, FedIRM, FedIA) and per baseline (FedAvg on
partial labels, with the partial-class loss, on full labels; segmentation FedAvg on incomplete and
on complete masks), built on NVFlare's ``Recipe`` and ``FedJob`` with the fedpartial Executor,
Aggregator, Persistor and privacy Filter.

A recipe takes a named ``profile`` (``"cpu"``: the settings the shipped job and docs/RESULTS.md
were measured with; ``"paper"``: the paper's; data profiles such as ``"ctich"`` or
``"lesions"``), the data (``fit_to=<data root>`` reads class names, task, channels and size from
the site files), rounds, model and rule arguments::

    from nvflare.recipe import SimEnv, PocEnv
    from fedpartial_tools.jobs.recipes import FedLSMRecipe, FedAvgRecipe

    method = FedLSMRecipe(data_root="/data/sites", with_code=True)
    method.execute(PocEnv(poc_workspace="/tmp/poc"))
    FedAvgRecipe.matched_to(method).execute(SimEnv(clients=["site-1", "site-2"]))

Only settings that differ from a constructor's default are written into the job: the defaults
live in the constructors. ``jobs/`` holds each recipe's export with its ``cpu`` profile
(``python -m fedpartial_tools jobs --write``, :mod:`.folders`); a test fails when a folder differs
from it.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from typing import Dict, Optional

from nvflare.app_common.shareablegenerators.full_model_shareable_generator import FullModelShareableGenerator
from nvflare.app_common.widgets.convert_to_fed_event import ConvertToFedEvent
from nvflare.app_common.widgets.intime_model_selector import IntimeModelSelector
from nvflare.app_common.widgets.validation_json_generator import ValidationJsonGenerator
from nvflare.app_common.workflows.cross_site_model_eval import CrossSiteModelEval
from nvflare.app_common.workflows.scatter_and_gather import ScatterAndGather
from nvflare.app_opt.tracking.tb.tb_receiver import TBAnalyticsReceiver
from nvflare.app_opt.tracking.tb.tb_writer import TBWriter
from nvflare.job_config.api import FedJob
from nvflare.job_config.defs import FilterType
from nvflare.recipe.spec import ExecEnv, Recipe

from fedpartial.algorithms.registry import rule_path
from fedpartial.flare.aggregators import RuleAggregator
from fedpartial.flare.common import runtime_identity
from fedpartial.flare.executors import FedPartialExecutor
from fedpartial.flare.filters import StatisticsPrivacyFilter
from fedpartial.flare.persistor import FedPartialModelLocator, FedPartialPersistor
from fedpartial.flare.selector import PooledModelSelector
from fedpartial_tools.data.sites import dataset_settings
from fedpartial_tools.jobs.matching import taken_from_method
from fedpartial_tools.jobs.packaging import copy_runtime
from fedpartial_tools.jobs.profiles import (FEDAVG_FULL_PROFILES, FEDAVG_PARTIAL_LOSS_PROFILES, FEDAVG_PROFILES,
                                            FEDIA_PROFILES, FEDIRM_PROFILES, FEDLSM_PROFILES, FEDMLP_PROFILES,
                                            SEG_FULL_PROFILES, SEG_PROFILES)
from fedpartial_tools.jobs.settings import constructor_defaults


# ---- building the FLARE job ------------------------------------------------------------------------
#: How often FLARE looks for work, in seconds (job variables, ``--set task_request_interval=2``):
#: ``task_request_interval``, the pause the server asks of a site between two task requests
#: (FLARE's default 2 s); ``task_check_period``, how often the server's workflows look for results
#: (FLARE's 0.5 s). On a small model the defaults' waiting is several times the training. 0.5 s
#: keeps an idle site to two small requests a second over a hospital link, the same setting
#: every bench row runs with; 0.1 s makes the workflows notice a result within a tenth of a second.
#: ``memory_gc_rounds``: the server's workflow collects garbage every this many rounds (FLARE's 1:
#: a full collection in the server process after every round, about half a second of each round
#: here); 10 keeps the server's memory in check over a long job.
TIMING = {"task_request_interval": 0.5, "task_check_period": 0.1, "memory_gc_rounds": 10}


def _spec(cls, **args):
    """An instance of ``cls`` that only records ``args`` for the job config: FedJob writes every
    constructor argument it finds as an attribute and differing from the default. The constructor
    does not run (the persistor would build the model, the executor check the device)."""
    obj = cls.__new__(cls)
    obj.__dict__.update(args)
    return obj


def rule_defaults(side: str, name: str) -> dict:
    """The constructor defaults of the registered ``side`` rule ``name`` (``client`` / ``server``)."""
    return constructor_defaults(rule_path(side, name))


def _without_defaults(side: str, name: str, args: dict) -> dict:
    """``args`` less the values equal to the rule constructor's defaults."""
    defaults = rule_defaults(side, name)
    unknown = sorted(set(args) - set(defaults))
    if unknown:
        raise ValueError(f"the {side} rule '{name}' takes no argument(s) {unknown}; it takes {sorted(defaults)}")
    return {k: v for k, v in args.items() if _jsonable(v) != _jsonable(defaults[k])}


def _jsonable(value):
    return json.loads(json.dumps(value))


class FedPartialRecipe(Recipe):
    """One fedpartial job as a FLARE recipe: ScatterAndGather + cross-site evaluation on the server,
    the method's client rule in :class:`~fedpartial.flare.executors.FedPartialExecutor`, its server
    rule in :class:`~fedpartial.flare.aggregators.RuleAggregator`, and the statistics privacy filter
    on what the sites send.

    Args:
        profile: a key of ``PROFILES`` (``"cpu"`` = the shipped job).
        name: the job name (default: the recipe's).
        num_rounds: overrides the profile's.
        min_clients: overrides the profile's.
        model: model keys that override the profile's block (e.g. ``{"arch": "densenet121"}``).
        rule_args: client rule arguments that override the profile's; those the server rule also
            takes reach it too (FedIA's ``warmup_rounds``).
        server_rule_args: server rule arguments that override the profile's (and ``rule_args``).
        fit_to: a data root (site files or site folders): class names, task, channels and size from
            its first site.
        data_root: development sites (simulator, POC): where each site finds its data (default: the
            site's working directory). Provisioned sites refuse a job that names a path.
        dataset: provisioned sites: the name of the dataset each site offers for this federation
            (its kit's ``local/fedpartial_site.json``).
        with_code: carry the fedpartial package in ``app/custom`` (POC, simulator, and sites that grant
            bring-your-own-code).
        seed: the seed of the model's initialisation and each site's training.
        runtime_version: the runtime the job needs, checked by the executor and the persistor at the
            start (default: this checkout's ``runtime_identity()``, version and content hash; "" = none, as the folders
            of ``jobs/`` are written).
    """

    NAME = ""
    CLIENT_RULE = ""
    SERVER_RULE = ""
    PRESET: Optional[str] = None  # the statistics the client rule sends (fedpartial.flare.filters)
    KEY_METRIC = "auc"
    PROFILES: Dict[str, dict] = {}

    def __init__(self, profile: str = "cpu", *, name: Optional[str] = None, num_rounds: Optional[int] = None,
                 min_clients: Optional[int] = None, model: Optional[dict] = None, rule_args: Optional[dict] = None,
                 server_rule_args: Optional[dict] = None, fit_to: Optional[str] = None,
                 data_root: Optional[str] = None, with_code: bool = False, seed: int = 0,
                 runtime_version: Optional[str] = None, dataset: Optional[str] = None):
        if data_root and dataset:
            raise ValueError(f"{type(self).__name__}: give a dataset name (provisioned sites) or a data_root "
                             f"(development sites), not both")
        self.profile = profile
        self.settings = self.profile_settings(profile, num_rounds=num_rounds, min_clients=min_clients, model=model,
                                              rule_args=rule_args, server_rule_args=server_rule_args, fit_to=fit_to)
        self.data_root, self.with_code, self.seed = data_root, bool(with_code), int(seed)
        self.dataset = str(dataset or "")
        self.runtime_version = runtime_identity() if runtime_version is None else str(runtime_version)
        self._staging = None
        super().__init__(self._build_job(name or self.NAME))

    @classmethod
    def profile_settings(cls, profile: str = "cpu", *, num_rounds: Optional[int] = None,
                         min_clients: Optional[int] = None, model: Optional[dict] = None,
                         rule_args: Optional[dict] = None, server_rule_args: Optional[dict] = None,
                         fit_to: Optional[str] = None, **_ignored) -> dict:
        """The settings a recipe built with these arguments exports (the constructor's, less the job's
        name, data root, code and seed): ``model``, ``rule_args``, ``server_rule_args``,
        ``num_rounds``, ``min_clients``, ``data_file``, ``description``."""
        if profile not in cls.PROFILES:
            raise ValueError(f"{cls.__name__} has no profile '{profile}'; choose one of {sorted(cls.PROFILES)}")
        chosen = copy.deepcopy(cls.PROFILES[profile])
        # a rule argument both rules take (FedIA's warmup_rounds) reaches both, as --set does
        server_takes = rule_defaults("server", cls.SERVER_RULE)
        shared = {k: v for k, v in (rule_args or {}).items() if k in server_takes}
        settings = {
            "model": {**chosen["model"], **(model or {})},
            "rule_args": {**chosen.get("rule_args", {}), **(rule_args or {})},
            "server_rule_args": {**chosen.get("server_rule_args", {}), **shared, **(server_rule_args or {})},
            "num_rounds": int(num_rounds if num_rounds is not None else chosen["num_rounds"]),
            "min_clients": int(min_clients if min_clients is not None else chosen["min_clients"]),
            "data_file": chosen.get("data_file", "{site}.npz"),
            "description": chosen["description"],
        }
        if fit_to:
            settings["model"].update(dataset_settings(fit_to))
        return settings

    # the preset may depend on the task (FedIRM's multi-label relation vectors)
    def preset(self) -> Optional[str]:
        return self.PRESET

    def _build_job(self, name: str) -> FedJob:
        s = self.settings
        job = FedJob(name=name, min_clients=s["min_clients"])
        job.set_app_packages(["fedpartial"])  # the runtime travels as a whole (with_code) or is installed
        shared = {"model": s["model"], "seed": self.seed, "key_metric": self.KEY_METRIC}
        job.to_server({"num_rounds": s["num_rounds"], "min_clients": s["min_clients"], **shared,
                       **TIMING, "server": {"task_request_interval": "{task_request_interval}"}})
        workflow = ScatterAndGather(min_clients=s["min_clients"], num_rounds=s["num_rounds"], train_timeout=0,
                                    persistor_id="persistor")
        # the workflow reads the job's variables, so that --set num_rounds / min_clients change one place
        workflow._min_clients, workflow._num_rounds = "{min_clients}", "{num_rounds}"
        workflow._task_check_period = "{task_check_period}"
        workflow._memory_gc_rounds = "{memory_gc_rounds}"
        job.to_server(workflow, id="scatter_and_gather")
        validate = CrossSiteModelEval(model_locator_id="model_locator", submit_model_task_name="")
        validate._task_check_period = "{task_check_period}"
        job.to_server(validate, id="cross_site_validate")
        runtime = {"runtime_version": self.runtime_version} if self.runtime_version else {}
        job.to_server(_spec(FedPartialPersistor, model="{model}", seed="{seed}", **runtime), id="persistor")
        job.to_server(FullModelShareableGenerator(), id="shareable_generator")
        job.to_server(_spec(RuleAggregator, rule=self.SERVER_RULE, model="{model}",
                            rule_args=_without_defaults("server", self.SERVER_RULE, s["server_rule_args"])), id="aggregator")
        selector = _spec(PooledModelSelector if self.KEY_METRIC == "dice_pooled" else IntimeModelSelector,
                         key_metric="{key_metric}")
        job.to_server(selector, id="model_selector")
        job.to_server(_spec(FedPartialModelLocator), id="model_locator")
        job.to_server(ValidationJsonGenerator(), id="json_generator")
        job.to_server(TBAnalyticsReceiver(events=["fed.analytix_log_stats"]), id="tb_receiver")

        job.to_clients({**shared, "data_root": self.data_root or "", "device": "auto", "memory_format": "contiguous"})
        job.to_clients(TBWriter(event_type="analytix_log_stats"), id="analytics_writer")
        job.to_clients(ConvertToFedEvent(events_to_convert=["analytix_log_stats"], fed_event_prefix="fed."),
                       id="analytics_to_server")
        executor = _spec(FedPartialExecutor, rule=self.CLIENT_RULE, model="{model}", data_root="{data_root}",
                         data_file=s["data_file"], device="{device}", memory_format="{memory_format}",
                         seed="{seed}", key_metric="{key_metric}", analytics_writer="analytics_writer",
                         rule_args=_without_defaults("client", self.CLIENT_RULE, s["rule_args"]), **runtime,
                         **({"dataset": self.dataset} if self.dataset else {}))
        job.to_clients(executor, id="executor", tasks=["train", "submit_model", "validate"])
        if self.preset():
            job.to_clients(_spec(StatisticsPrivacyFilter, preset=self.preset(), min_count=5),
                           filter_type=FilterType.TASK_RESULT, tasks=["train"])
        if self.with_code:
            self._staging = tempfile.mkdtemp(prefix="fedpartial-code-")
            copy_runtime(self._staging)
            job.to_server(self._staging)
            job.to_clients(self._staging)
        return job

    def export(self, job_dir: str, server_exec_params: Optional[dict] = None,
               client_exec_params: Optional[dict] = None, env: Optional[ExecEnv] = None):
        """Write the job into ``job_dir/<name>`` (FLARE's layout), with the profile's description in
        meta.json."""
        super().export(job_dir, server_exec_params, client_exec_params, env)
        meta_path = os.path.join(job_dir, self.name, "meta.json")
        meta = json.load(open(meta_path))
        meta["description"] = self.settings["description"]
        with open(meta_path, "w") as f:
            f.write(json.dumps(meta, indent=2) + "\n")

    @classmethod
    def matched_to(cls, method: "FedPartialRecipe", compute: bool = True, **kwargs) -> "FedPartialRecipe":
        """This baseline with ``method``'s model (:data:`~fedpartial_tools.jobs.matching.SHARED_MODEL_KEYS`),
        whole local recipe (every client setting that is not the method's ``CONTRIBUTION``) and
        rounds, and with ``compute`` its optimizer steps per round and site weights
        (:func:`~fedpartial_tools.jobs.matching.compute_of`): a comparison of rules, not of networks,
        augmentations, schedules, compute or weighting.

        Args:
            method: the method's recipe.
            compute: match steps and weights too (False: the baseline's own epochs and weights).
            kwargs: further constructor arguments of this baseline (``profile``, ``data_root`` ...).
        """
        mine = cls.profile_settings(**kwargs)
        effective = {"rule": method.CLIENT_RULE, "model": method.settings["model"],
                     "rule_args": {**rule_defaults("client", method.CLIENT_RULE), **method.settings["rule_args"]}}
        model, rule = taken_from_method(effective, cls.CLIENT_RULE, rule_defaults("client", cls.CLIENT_RULE), compute)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("model", "rule_args", "num_rounds")}
        return cls(model={**mine["model"], **model}, rule_args={**mine["rule_args"], **rule},
                   num_rounds=method.settings["num_rounds"], **kwargs)

    def __del__(self):
        if getattr(self, "_staging", None):
            shutil.rmtree(self._staging, ignore_errors=True)


class FedAvgRecipe(FedPartialRecipe):
    """FedAvg on the sites' partial labels: unannotated entries count as negative (lower bound)."""

    NAME = "fedavg"
    CLIENT_RULE = "fedavg"
    SERVER_RULE = "fedavg"
    PROFILES = FEDAVG_PROFILES


class FedAvgPartialLossRecipe(FedAvgRecipe):
    """FedAvg with the partial-class loss: loss on the annotated classes only."""

    NAME = "fedavg_partial_loss"
    PROFILES = FEDAVG_PARTIAL_LOSS_PROFILES


class FedAvgFullRecipe(FedAvgRecipe):
    """FedAvg on every site's complete labels (upper bound)."""

    NAME = "fedavg_full"
    PROFILES = FEDAVG_FULL_PROFILES


class SegFedAvgRecipe(FedPartialRecipe):
    """Segmentation FedAvg on the sites' incomplete masks (lower bound for FedIA)."""

    NAME = "fedavg_seg"
    CLIENT_RULE = "fedavg_seg"
    SERVER_RULE = "fedavg"
    KEY_METRIC = "dice_pooled"
    PROFILES = SEG_PROFILES


class SegFedAvgFullRecipe(SegFedAvgRecipe):
    """Segmentation FedAvg on the complete masks (upper bound)."""

    NAME = "fedavg_seg_full"
    PROFILES = SEG_FULL_PROFILES


class FedLSMRecipe(FedPartialRecipe):
    """FedLSM (MICCAI 2023): label-set mismatch, single- or multi-label."""

    NAME = "fedlsm"
    CLIENT_RULE = "fedlsm"
    SERVER_RULE = "fedlsm"
    PRESET = "fedlsm"
    PROFILES = FEDLSM_PROFILES


class FedMLPRecipe(FedPartialRecipe):
    """FedMLP (MICCAI 2024): multi-label, each site annotates a few classes."""

    NAME = "fedmlp"
    CLIENT_RULE = "fedmlp"
    SERVER_RULE = "fedmlp"
    PRESET = "fedmlp"
    PROFILES = FEDMLP_PROFILES


class FedIRMRecipe(FedPartialRecipe):
    """FedIRM (MICCAI 2021): labelled and unlabelled sites, relation matching."""

    NAME = "fedirm"
    CLIENT_RULE = "fedirm"
    SERVER_RULE = "fedirm"
    PROFILES = FEDIRM_PROFILES

    def preset(self) -> Optional[str]:
        return "fedirm_multilabel" if self.settings["model"]["task"] == "multi-label" else "fedirm"


class FedIARecipe(FedPartialRecipe):
    """FedIA (MICCAI 2024): segmentation with incomplete masks."""

    NAME = "fedia"
    CLIENT_RULE = "fedia"
    SERVER_RULE = "fedia"
    PRESET = "fedia"
    KEY_METRIC = "dice_pooled"
    PROFILES = FEDIA_PROFILES


RECIPES = {r.NAME: r for r in (FedLSMRecipe, FedMLPRecipe, FedIRMRecipe, FedIARecipe, FedAvgRecipe,
                               FedAvgPartialLossRecipe, FedAvgFullRecipe, SegFedAvgRecipe, SegFedAvgFullRecipe)}


def recipe(recipe_name: str, profile: str = "cpu", **kwargs) -> FedPartialRecipe:
    """The recipe ``recipe_name`` (a key of :data:`RECIPES`) with ``profile``.

    Args:
        recipe_name: ``fedlsm``, ``fedavg`` ...
        profile: one of the recipe's profiles.
        kwargs: further constructor arguments (:class:`FedPartialRecipe`).
    """
    if recipe_name not in RECIPES:
        raise ValueError(f"no recipe '{recipe_name}'; choose one of {sorted(RECIPES)}")
    return RECIPES[recipe_name](profile, **kwargs)


def export_job(name: str, out_dir: str, profile: str = "cpu", **kwargs) -> str:
    """Export recipe ``name`` with ``profile`` as the job folder ``out_dir`` (replaced). Returns it."""
    out_dir = os.path.abspath(out_dir)
    kwargs.setdefault("runtime_version", "")  # package-job writes the version of the checkout that packages
    r = recipe(name, profile, name=os.path.basename(out_dir), **kwargs)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        r.export(tmp)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(os.path.join(tmp, r.name), out_dir)
    return out_dir
