"""What a job may set: the typed schema of a job's configs.

Every component a job may name (:data:`fedpartial.flare.allowed.CLASS_ALLOW_LIST`) is declared
here with each argument's type, range or vocabulary, and whether a job may set it at all
(:class:`Fixed`: only its default). The method rules' ``rule_args`` are declared per registered
rule, the ``model`` block per architecture, and the configs' top-level keys per side. A job is
data: :func:`check_config` refuses an unknown component, place, argument or top-level key, a value
of the wrong type or out of range, and naming the file, component, argument and the value as the
job wrote it.

**Nothing is filled in from a participant's world.** FLARE fills in a job's configs before any
component sees them: ``{$VAR}`` from the process environment (with ``str.format`` indexing),
``{SITE_NAME}``, ``{WORKSPACE}`` and other built-ins, ``${secret:...}``, and the config's own
top-level variables, nested and in a loop of up to 20 rounds. So the raw config is checked: the only
braces a job may write are a whole value ``"{name}"`` naming one of this schema's top-level
variables of the same file (``"model": "{model}"``, as the shipped jobs do), whose value is itself
plain, and the ``{site}`` placeholder of the executor's file patterns (filled in by fedpartial, not
FLARE). Every site therefore runs the same values.

The checks are pure Python on JSON values; :mod:`fedpartial.flare.job_gate` applies them (with the
site's limits of :mod:`fedpartial.flare.site_config`) before FLARE builds anything.
"""
from __future__ import annotations

import copy
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from fedpartial.algorithms import fedavg, fedia, fedirm, fedlsm, fedmlp, robust, segmentation
from fedpartial.data.transforms import TRAINING_VIEWS
from fedpartial.data.types import TASKS
from fedpartial.flare.filters import PRESET_NAMES
from fedpartial.training.common import LR_SCHEDULES, MEMORY_FORMATS
from fedpartial.flare.value_types import (NAME, AnyOf, Bool, ByKey, Choice, Fixed, Int, ListOf, MapOf, Maybe, Num,
                                          Record, Spec, Text, any_braces as _any_braces, has_braces as _braces,
                                          show as _show)

SERVER, CLIENT = "server", "client"
CONFIG_FILES = {SERVER: "config_fed_server.json", CLIENT: "config_fed_client.json"}
#: filters of one chain: the shipped jobs and recipes use up to 4
MAX_FILTERS = 16
#: a reference to a top-level variable, the whole value: "{model}"
REF = re.compile(r"\{([a-z_][a-z0-9_]*)\}")


class JobRefused(ValueError):
    """A job config outside the schema; the message names file, component, argument and value."""


OPTIONAL_NAME = Text(r"([A-Za-z_][A-Za-z0-9_.-]{0,63})?", "a name or ''", 64)
#: a relative path without '..' (the participant decides which folder it is relative to)
RELATIVE = Text(r"(?!/)(?!~)(?!.*(^|/)\.\.(/|$))[A-Za-z0-9_./ -]*", "a relative path without '..' (or '')", 255)
#: the executor's file pattern: relative, with at most one {site} (filled in by fedpartial per site)
SITE_PATTERN = Text(r"(?!\{site\}$)(?!/)(?!~)(?!.*(^|/)\.\.(/|$))[A-Za-z0-9_./-]*(\{site\}[A-Za-z0-9_./-]*)?",
                    "a relative file pattern without '..', with {site} for the site's name (not '{site}' alone: "
                    "FLARE would fill that whole value in)", 255, True)


class Agreement(Spec):
    """The federation's input agreement (:class:`fedpartial.data.grid.InputAgreement` as JSON)."""

    def why(self, value):
        from fedpartial.data.grid import agreement_from

        if value is None:
            return ""
        if not isinstance(value, dict) or _any_braces(value):
            return "must be a plain dict"
        try:
            agreement_from(value, "model.input_agreement")
        except (ValueError, TypeError) as e:
            return str(e)
        return ""

    def describe(self):
        return "input agreement (fedpartial.data.grid.InputAgreement) or null"


# ---- common argument types -----------------------------------------------------------------------
LR = Num(0, 10, open_lo=True)
DECAY = Num(0, 1)
BETAS = ListOf(Num(0, 1, open_hi=True), 2, 2)
FRACTION = Num(0, 1)
PROB = Num(0, 1, open_hi=True)
BATCH = Int(1, 1_000_000)
EPOCHS = Num(0, 1_000_000, open_lo=True)
STEPS = Int(1, 100_000_000)
ROUNDS = Int(0, 1_000_000)
VIEWS = Int(1, 1000)
WEIGHT = Num(0, 1e6)
POSITIVE = Num(0, 1e6, open_lo=True)
SEED = Int(0, 2 ** 32 - 1)
SECONDS = Num(0, 10 ** 7)
PERIOD = Num(0.05, 60)  # how often a participant polls: below 50 ms it only burns CPU
TASK = Text(r"[A-Za-z_][A-Za-z0-9_]{0,63}", "a task name", 64)
METRIC = Text(r"[a-z][a-z0-9_]{0,63}", "a metric name", 64)
ACT = Choice("relu", "prelu", "leakyrelu", "elu", "selu", "celu", "gelu", "sigmoid", "tanh", "swish", "mish")
NORM = Choice("batch", "instance", "group", "layer", "localresponse", "syncbatch")

# ---- rule_args: each registered rule's constructor arguments --------------------------------------
_SUPERVISED = {"lr": LR, "weight_decay": DECAY, "betas": BETAS, "batch_size": BATCH, "local_epochs": EPOCHS}
_SEGMENTATION = {**_SUPERVISED, "local_epochs": Int(1, 1_000_000), "prob_threshold": PROB, "dice_batch": Bool(),
                 "predict_batch_size": BATCH, "loss": Choice(*segmentation.SEG_LOSSES), "lesion_fraction": FRACTION,
                 "lr_schedule": Choice(*LR_SCHEDULES), "final_lr_fraction": FRACTION}
CLIENT_RULE_ARGS: Dict[str, Dict[str, Spec]] = {
    "fedavg": {**_SUPERVISED, "loss_mode": Choice(*fedavg.LOSS_MODES), "local_iterations": Maybe(STEPS),
               "augmentation": Choice(*TRAINING_VIEWS), "rotate_deg": Num(0, 180), "translate": FRACTION,
               "label_smoothing": PROB, "num_views": VIEWS, "loader_workers": Int(0, 256),
               "weight_by": Choice(*fedavg.WEIGHT_BY), "class_weighted_bce": Bool(), "max_pos_weight": Maybe(POSITIVE),
               "logit_adjustment": Bool(), "la_tau": WEIGHT, "la_eps": Num(0, 0.5, open_lo=True)},
    "fedavg_seg": dict(_SEGMENTATION),
    "fedlsm": {**_SUPERVISED, "local_epochs": Maybe(EPOCHS), "ude_pairs": VIEWS, "local_iterations": Maybe(STEPS),
               "confident_fraction": Maybe(FRACTION), "uncertain_fraction": Maybe(FRACTION), "ema_decay": FRACTION,
               "tau": FRACTION, "tau_l": FRACTION, "tau_p": FRACTION, "tau_n": FRACTION, "tau_lp": FRACTION,
               "tau_ln": FRACTION, "lambda_ude": WEIGHT, "mixup_alpha": Num(0, 100), "use_ue": Bool(),
               "use_ude": Bool(), "class_weighted_bce": Bool(), "max_pos_weight": Maybe(POSITIVE),
               "strong_view": Choice(*fedlsm.STRONG_VIEWS), "eval_batch_size": BATCH, "renormalise_missing": Bool()},
    "fedmlp": {**_SUPERVISED, "local_epochs": Int(1, 1_000_000), "warmup_rounds": ROUNDS, "num_views": VIEWS,
               "augmentation": Choice(*TRAINING_VIEWS), "low": FRACTION, "high": FRACTION, "la_tau": WEIGHT,
               "la_eps": Num(0, 1, open_lo=True), "cr_weight": WEIGHT, "use_mld": Bool(), "use_wpc": Bool(),
               "use_cr": Bool(), "use_adaptive_threshold": Bool(), "prediction_batch_size": BATCH,
               "positive_tag_cap": Choice(*fedmlp.POSITIVE_TAG_CAPS), "positive_tag_scale": WEIGHT,
               "assumed_negative_weight": WEIGHT, "warmup_end": Choice(*fedmlp.WARMUP_ENDS),
               "min_warmup_rounds": ROUNDS, "cr_in_warmup": Bool(), "la_prior": Choice(*fedmlp.LA_PRIORS),
               "tag_check_samples": Int(0, 1_000_000)},
    "fedirm": {**_SUPERVISED, "local_epochs": Int(1, 1_000_000), "temperature": POSITIVE, "label_smoothing": PROB,
               "ema_decay": FRACTION, "mc_passes": VIEWS, "entropy_threshold": Num(0, 100),
               "multilabel_entropy_threshold": Num(0, 100), "min_confidence": FRACTION, "ramp_rounds": ROUNDS,
               "reliable_fraction": FRACTION, "reliable_per_class": Bool(), "max_unsupervised_weight": WEIGHT,
               "relation_weight": WEIGHT, "pseudo_label_weight": WEIGHT, "pseudo_label_balance": Bool(),
               "unlabelled_start_round": ROUNDS, "ramp_scales_lr": Bool(), "augmentation": Choice(*fedirm.AUGMENTATIONS),
               "rotate_deg": Num(0, 180), "translate": FRACTION},
    "fedia": {**_SEGMENTATION, "warmup_rounds": ROUNDS, "iou_margin": FRACTION, "correction_threshold": FRACTION,
              "use_correction": Bool(), "correct_repeatedly": Bool(), "connectivity": Choice(4, 8),
              "completeness_floor": FRACTION, "completeness_cap": Maybe(FRACTION), "min_predicted_ratio": WEIGHT,
              "correction_rule": Choice(*fedia.CORRECTION_RULES), "warmup_from_first_lesion": Bool(),
              "retry_empty_correction": Bool()},
}


class RuleSteps(Spec):
    """A baseline's ``steps_of``: ``{"rule": a registered client rule, "rule_args": that rule's
    arguments}``, each argument checked as that rule's own would be."""

    def __init__(self, tables: Dict[str, Dict[str, Spec]]):
        self.tables = tables

    def why(self, value):
        if not isinstance(value, dict) or set(value) - {"rule", "rule_args"}:
            return "must be a dict of 'rule' and 'rule_args'"
        # only a method that states its steps; never a baseline, whose steps_of would nest
        why = Choice(*STEP_RULES).why(value.get("rule"))
        if why:
            return f"'rule' ({_show(value.get('rule'))}) {why}"
        why = Record(self.tables[value["rule"]]).why(value.get("rule_args") or {})
        return f"'rule_args' {why}" if why else ""

    def describe(self):
        return "dict of rule, rule_args"


#: the client rules that state their steps per round (a matched baseline may copy them)
STEP_RULES = ("fedirm", "fedlsm", "fedmlp")
CLIENT_RULE_ARGS["fedavg"]["steps_of"] = Maybe(RuleSteps(CLIENT_RULE_ARGS))
SERVER_RULE_ARGS: Dict[str, Dict[str, Spec]] = {
    "fedavg": {},
    "fedavg_seg": {},
    "fedlsm": {"use_awpa": Bool(), "without_awpa": Choice("masked", "fedavg"), "max_pos_weight": Maybe(POSITIVE)},
    "fedmlp": {"t0": FRACTION, "t1": FRACTION, "min_prototype_samples": Int(1, 1_000_000),
               "classifier_rows": Choice(*fedmlp.CLASSIFIER_ROWS), "warmup_end": Choice(*fedmlp.WARMUP_ENDS),
               "warmup_degree": FRACTION, "positive_tag_gate": FRACTION},
    "fedirm": {"relation_weighting": Choice(*fedirm.RELATION_WEIGHTINGS), "unlabelled_weight": WEIGHT},
    "fedia": {"warmup_rounds": ROUNDS, "use_completeness_weighting": Bool(), "fedavg_after_all_corrected": Bool(),
              "loss_floor": Num(0, 1), "completeness_max": Maybe(FRACTION), "max_weight_ratio": Maybe(Num(1, 1e6))},
}

# ---- the model block ---------------------------------------------------------------------------------
#: arch_args: shape options only (no weights file: MONAI's own loading is not reachable)
ARCH_ARGS: Dict[str, Dict[str, Spec]] = {
    "small_cnn": {"width": Int(1, 65536), "depth": Int(1, 12), "dropout": PROB, "stem_stride": Int(1, 8)},
    "resnet18": {"dropout": PROB, "conv1_t_size": Int(1, 15), "conv1_t_stride": Int(1, 8), "no_max_pool": Bool(),
                 "shortcut_type": Choice("A", "B"), "widen_factor": Num(0, 64, open_lo=True), "norm": NORM,
                 "act": ACT, "bias_downsample": Bool()},
    "densenet121": {"dropout": PROB, "init_features": Int(1, 4096), "growth_rate": Int(1, 4096),
                    "block_config": ListOf(Int(1, 256), 1, 8), "bn_size": Int(1, 64), "norm": NORM, "act": ACT,
                    "dropout_prob": PROB},
    "unet": {"channels": ListOf(Int(1, 8192), 2, 10), "strides": ListOf(Int(1, 8), 1, 9),
             "num_res_units": Int(0, 16), "foreground_prior": PROB, "kernel_size": Choice(1, 3, 5, 7),
             "up_kernel_size": Choice(1, 3, 5, 7), "act": ACT, "norm": NORM, "dropout": PROB, "bias": Bool(),
             "adn_ordering": Choice("NDA", "NAD", "DNA", "DAN", "AND", "ADN", "NA", "AN", "ND", "DN", "A", "N", "D")},
}
# Pixel units: images are read as x / 255 in [0, 1] and fed as (x - mean) / std. A job may only
# centre and scale them as a dataset would; a std of 1e6 made every image the same input, so the
# seeded model answered alike for all and the sites' published losses and accuracies gave their
# exact per-class counts (an outside attempt).
NORM_MEAN = AnyOf(Num(0.0, 1.0), ListOf(Num(0.0, 1.0), 1, 16))
NORM_STD = AnyOf(Num(0.01, 1.0), ListOf(Num(0.01, 1.0), 1, 16))
MODEL_FIELDS: Dict[str, Spec] = {
    "arch": Choice(*ARCH_ARGS), "arch_args": ByKey(ARCH_ARGS), "in_channels": Int(1, 64),
    "class_names": ListOf(Text(r"[^{}\x00-\x1f]{1,100}", "a plain class name (no braces)", 100), 1, 10_000),
    "task": Choice(*TASKS), "input_size": ListOf(Int(0, 1_000_000), 2, 2),
    "normalisation": Record({"mean": NORM_MEAN, "std": NORM_STD}, required=("mean", "std")),
    # the round-0 model: a file in the server kit's own folders, never one the job brings
    "pretrained": RELATIVE, "input_agreement": Agreement(),
}
MODEL_REQUIRED = ("arch", "in_channels", "class_names", "task")


class ModelBlock(Record):
    """The job's ``model`` block, its ``arch_args`` by ``arch``."""

    def __init__(self):
        super().__init__(MODEL_FIELDS, MODEL_REQUIRED)

    def why(self, value):
        why = super().why(value)
        if why:
            return why
        record = ARCH_ARGS[value["arch"]]
        why = Record(record).why(value.get("arch_args", {}))
        return f"'arch_args' of {value['arch']} {why}" if why else ""


MODEL = ModelBlock()


# ---- components: where each may sit, and its arguments -------------------------------------------
class Component:
    """A component a job may name: the places it may sit in (``server.components``,
    ``client.executors``, ``client.filters`` ...) and its arguments. ``keyed``: an argument whose
    fields depend on another (``rule_args`` on ``rule``)."""

    def __init__(self, places: Sequence[str], args: Dict[str, Spec], keyed: Optional[Dict[str, str]] = None):
        self.places, self.args, self.keyed = tuple(places), args, dict(keyed or {})


_FP, _NV = "fedpartial.flare.", "nvflare.app_common."
_EXECUTOR_ARGS = {
    "rule": Choice(*CLIENT_RULE_ARGS), "rule_args": ByKey(CLIENT_RULE_ARGS), "model": MODEL,
    "dataset": OPTIONAL_NAME, "data_root": Text(r"[^{}\x00-\x1f]*", "a folder (development sites only)", 1000),
    "data_file": SITE_PATTERN, "reference_file": SITE_PATTERN,
    "device": Text(r"auto|cpu|cuda|cuda:[0-9]{1,2}|mps", "auto, cpu, cuda or cuda:N", 8), "seed": SEED,
    "key_metric": METRIC, "state_dir": RELATIVE, "tensorboard": Bool(), "train_task_name": TASK,
    "submit_model_task_name": TASK, "validate_task_name": TASK, "memory_format": Choice(*MEMORY_FORMATS),
    "analytics_writer": OPTIONAL_NAME,
    "runtime_version": Text(r"([0-9][0-9A-Za-z.+_-]{0,79})?", "a runtime version (package-job writes it)", 80),
}
_MIN_COUNT = Int(0, 1_000_000)
_NOISE = MapOf(Num(0, 1e6))
COMPONENTS: Dict[str, Component] = {
    _FP + "executors.FedPartialExecutor": Component(["client.executors"], _EXECUTOR_ARGS, {"rule_args": "rule"}),
    _FP + "aggregators.RuleAggregator": Component(["server.components"], {
        "rule": Choice(*SERVER_RULE_ARGS), "rule_args": ByKey(SERVER_RULE_ARGS), "model": MODEL,
        "min_valid_updates": Int(1, 10_000), "min_sites_for_shared_stats": Int(0, 10_000), "cap_samples": Bool(),
        "max_norm_ratio": Maybe(Num(1, 1e9)), "weight_rule": Choice(*robust.WEIGHT_RULES),
        "trim_fraction": Num(0, 0.5, open_hi=True)}, {"rule_args": "rule"}),
    _FP + "persistor.FedPartialPersistor": Component(["server.components"], {
        "model": MODEL, "seed": SEED, "resume_from": RELATIVE, "runtime_version": _EXECUTOR_ARGS["runtime_version"]}),
    _FP + "persistor.FedPartialModelLocator": Component(["server.components"], {"persistor_id": NAME}),
    _FP + "selector.PooledModelSelector": Component(["server.components"], {
        "key_metric": METRIC, "weigh_by_local_iter": Bool(), "aggregation_weights": Fixed({}),
        "validation_metric_name": Fixed("initial_metrics"), "negate_key_metric": Bool()}),
    _FP + "filters.StatisticsPrivacyFilter": Component(["client.filters"], {
        "preset": Choice(*PRESET_NAMES), "min_count": _MIN_COUNT, "guards": Maybe(MapOf(NAME)),
        "fill": Maybe(MapOf(AnyOf(Num(-1e6, 1e6), Choice("uniform")))), "noise_sigma": Maybe(_NOISE),
        "clip": Maybe(MapOf(ListOf(Num(-1e9, 1e9), 2, 2))), "normalise_rows": Maybe(ListOf(NAME, 0, 100)),
        "seed": Maybe(SEED), "data_kinds": Maybe(ListOf(Choice("WEIGHTS", "WEIGHT_DIFF"), 1, 2)),
        "unknown_keys": Maybe(Choice("withhold", "pass"))}),
    _FP + "filters.SendWeightDiff": Component(["client.filters"], {}),
    _FP + "filters.RestoreFullWeights": Component(["server.filters"], {}),
    _FP + "result_policy.SiteResultPolicy": Component(["client.filters"], {
        "min_count": _MIN_COUNT, "noise_sigma": Maybe(_NOISE), "seed": Maybe(SEED)}),
    _FP + "site_policy.LocalModelGate": Component(["client.filters"], {"share_local_model": Bool()}),
    # a site's own filter (its privacy.json); a job naming it gets it as a site would set it
    _FP + "site_policy.UpdateMask": Component(["client.filters"], {
        "spread": Fixed(1.0), "key_file": Fixed("startup/client.key")}),
    _FP + "site_policy.FedEventGuard": Component(["client.components"], {
        "allowed_events": Maybe(ListOf(NAME, 0, 100)),
        "allowed_tags": Maybe(ListOf(Text(r"[A-Za-z0-9_/*?.-]{1,100}", "a tag pattern", 100), 0, 1000)),
        "analytics_event": Fixed("fed.analytix_log_stats")}),
    _NV + "filters.percentile_privacy.PercentilePrivacy": Component(["client.filters"], {
        "percentile": Num(0, 100), "gamma": Num(0, 1e6),
        "data_kinds": Maybe(ListOf(Choice("WEIGHTS", "WEIGHT_DIFF"), 1, 2))}),
    _NV + "shareablegenerators.full_model_shareable_generator.FullModelShareableGenerator":
        Component(["server.components"], {}),
    _NV + "widgets.convert_to_fed_event.ConvertToFedEvent": Component(["client.components"], {
        "events_to_convert": ListOf(Choice("analytix_log_stats"), 1, 1), "fed_event_prefix": Fixed("fed.")}),
    _NV + "widgets.intime_model_selector.IntimeModelSelector": Component(["server.components"], {
        "weigh_by_local_iter": Bool(), "aggregation_weights": Fixed({}),
        "validation_metric_name": Fixed("initial_metrics"), "key_metric": METRIC, "negate_key_metric": Bool()}),
    _NV + "widgets.validation_json_generator.ValidationJsonGenerator": Component(["server.components"], {
        "results_dir": Fixed("cross_site_val"), "json_file_name": Fixed("cross_val_results.json")}),
    _NV + "workflows.cross_site_model_eval.CrossSiteModelEval": Component(["server.workflows"], {
        "task_check_period": PERIOD, "cross_val_dir": Fixed("cross_site_val"), "submit_model_timeout": Int(0, 10 ** 7),
        "validation_timeout": Int(0, 10 ** 7), "model_locator_id": OPTIONAL_NAME, "formatter_id": Fixed(""),
        "submit_model_task_name": AnyOf(TASK, Choice("")), "validation_task_name": TASK,
        "cleanup_models": Bool(), "participating_clients": Fixed(None),
        "wait_for_clients_timeout": Int(0, 10 ** 7)}),
    _NV + "workflows.scatter_and_gather.ScatterAndGather": Component(["server.workflows"], {
        "min_clients": Int(1, 10_000), "num_rounds": Int(1, 1_000_000), "start_round": Int(0, 1_000_000),
        "wait_time_after_min_received": Int(0, 10 ** 6), "aggregator_id": NAME, "persistor_id": OPTIONAL_NAME,
        "shareable_generator_id": NAME, "train_task_name": TASK, "train_timeout": Int(0, 10 ** 7),
        "ignore_result_error": Maybe(Bool()), "allow_empty_global_weights": Fixed(False),
        "task_check_period": PERIOD, "persist_every_n_rounds": Int(0, 10 ** 6),
        "snapshot_every_n_rounds": Int(0, 10 ** 6), "memory_gc_rounds": Int(0, 10 ** 6),
        "enable_tensor_disk_offload": Fixed(False)}),
    "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver": Component(["server.components"], {
        "tb_folder": Fixed("tb_events"), "events": Maybe(ListOf(Choice("fed.analytix_log_stats"), 1, 1))}),
    "nvflare.app_opt.tracking.tb.tb_writer.TBWriter": Component(["client.components"], {
        "event_type": Fixed("analytix_log_stats")}),
}

# ---- the configs' top level ------------------------------------------------------------------------
#: the lists of components of each side
SECTIONS = {SERVER: ("workflows", "components", "task_data_filters", "task_result_filters"),
            CLIENT: ("executors", "components", "task_data_filters", "task_result_filters")}
#: the top-level variables a config may hold (and name as "{name}"), and FLARE's own settings
VARIABLES: Dict[str, Dict[str, Spec]] = {
    SERVER: {"num_rounds": Int(1, 1_000_000), "min_clients": Int(1, 10_000), "model": MODEL, "seed": SEED,
             "key_metric": METRIC, "task_request_interval": PERIOD, "task_check_period": PERIOD,
             "memory_gc_rounds": Int(0, 10 ** 6)},
    CLIENT: {"model": MODEL, "seed": SEED, "key_metric": METRIC, "data_root": _EXECUTOR_ARGS["data_root"],
             "device": _EXECUTOR_ARGS["device"], "memory_format": Choice(*MEMORY_FORMATS)},
}
SETTINGS: Dict[str, Dict[str, Spec]] = {
    SERVER: {"format_version": Choice(2), "server": Record({"task_request_interval": PERIOD})},
    CLIENT: {"format_version": Choice(2)},
}
FILTER_CHAIN = Record({"tasks": ListOf(TASK, 1, 100), "direction": Choice("in", "out", "inout")}, required=("tasks",))


class Checked:
    """A config that passed: its components with their arguments as FLARE will see them (the
    top-level references filled in), for the site's limits."""

    def __init__(self, side: str):
        self.side = side
        self.components: List[Tuple[str, str, dict]] = []  # (place, class path, args)
        self.variables: Dict[str, Any] = {}

    def args_of(self, path_suffix: str) -> List[dict]:
        return [args for _, path, args in self.components if path.endswith(path_suffix)]


def check_config(config, side: str, file: str = "", byoc: bool = False) -> Checked:
    """Check a job's raw config against the schema.

    Args:
        config: the loaded JSON of ``config_fed_server.json`` / ``config_fed_client.json``, as the
            job ships it (before FLARE fills anything in).
        side: ``server`` or ``client``.
        file: the file's name for messages (default the side's config file).
        byoc: the job carries code (``app/custom``, allowed by the site's byoc right): components
            the schema does not know are left to that code; their values must still be plain.

    Returns:
        :class:`Checked`: the components and arguments FLARE will build.

    Raises:
        JobRefused: naming the file, component, argument and value (as the job wrote it).
    """
    file = file or CONFIG_FILES[side]

    def refuse(what: str, why: str):
        raise JobRefused(f"{file}: {what} {why}")

    if not isinstance(config, dict):
        refuse("the config", "must be a JSON object")
    out = Checked(side)
    variables = VARIABLES[side]
    unknown = [k for k in config if k not in SECTIONS[side] and k not in variables and k not in SETTINGS[side]]

    def resolve(value):
        """FLARE's whole-value reference to a top-level variable, filled in as FLARE will."""
        m = REF.fullmatch(value) if isinstance(value, str) else None
        if m and m.group(1) in out.variables:
            return copy.deepcopy(out.variables[m.group(1)]), True
        return value, False

    def filled_in(value):
        # a FLARE setting block (the server's task_request_interval) may name a variable whole
        if isinstance(value, dict):
            return {k: filled_in(v) for k, v in value.items()}
        return resolve(value)[0]

    # the variables first: a FLARE setting block may name one of them whole
    for key, value in sorted(config.items(), key=lambda kv: kv[0] in SETTINGS[side] and kv[0] not in variables):
        if key in SECTIONS[side] or key in unknown:
            continue
        spec = variables.get(key) or SETTINGS[side].get(key)
        if key not in variables:
            value = filled_in(value)
        _plain(value, lambda where, v: refuse(f"top-level '{key}{where}'", _filled(v)))
        why = spec.why(value)
        if why:
            refuse(f"top-level '{key}' ({_show(value)})", why)
        if key in variables:
            out.variables[key] = value

    ids = set()
    for section in SECTIONS[side]:
        entries = config.get(section, [])
        if not isinstance(entries, list):
            refuse(f"'{section}'", "must be a list")
        if section == "executors" and len(entries) > 1:  # each loads the site's data and builds a model
            refuse(f"'executors' ({len(entries)} entries)", "must hold one executor: a site's limits apply to "
                                                            "each, so more would multiply them")
        for i, entry in enumerate(entries):
            at = f"{section}[{i}]"
            if section in ("task_data_filters", "task_result_filters"):
                if not isinstance(entry, dict) or not isinstance(entry.get("filters"), list):
                    refuse(at, "must be a dict with 'tasks' and a list of 'filters'")
                shape = {k: v for k, v in entry.items() if k != "filters"}
                _plain(shape, lambda where, v: refuse(f"{at}{where}", _filled(v)))
                why = FILTER_CHAIN.why(shape)
                if why:
                    refuse(at, why)
                if len(entry["filters"]) > MAX_FILTERS:
                    refuse(f"{at}.filters ({len(entry['filters'])} entries)", f"may hold at most {MAX_FILTERS}")
                for j, item in enumerate(entry["filters"]):
                    _component(item, f"{at}.filters[{j}]", f"{side}.filters", out, resolve, refuse, byoc, None)
            elif section == "executors":
                if not isinstance(entry, dict) or set(entry) - {"tasks", "executor"}:
                    refuse(at, "must be a dict of 'tasks' and 'executor'")
                why = ListOf(TASK, 1, 100).why(entry.get("tasks"))
                if why:
                    refuse(f"{at}.tasks ({_show(entry.get('tasks'))})", why)
                _component(entry.get("executor"), f"{at}.executor", f"{side}.executors", out, resolve, refuse, byoc, None)
            else:
                _component(entry, at, f"{side}.{section}", out, resolve, refuse, byoc, ids)
    if unknown:  # after the components, so that a value FLARE would fill in is what the message names
        refuse(f"top-level key {_show(unknown[0])}", f"is not one a job may set (it may set "
                                                     f"{sorted(set(variables) | set(SETTINGS[side]) | set(SECTIONS[side]))})")
    return out


def _filled(value) -> str:
    return (f"holds {_show(value)}: FLARE would fill that in from the participant (its environment, name, "
            f"workspace or the config's variables); a job's values are plain, the same at every site")


def _plain(value, refuse, where: str = "") -> None:
    """Refuse any brace in ``value`` (keys included), where FLARE would fill something in."""
    if isinstance(value, dict):
        for k, v in value.items():
            if _braces(k):
                refuse(f"{where} key", k)
            _plain(v, refuse, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _plain(v, refuse, f"{where}[{i}]")
    elif _braces(value):
        refuse(where, value)


def _nested_component(value, where: str = "") -> Optional[str]:
    """Where in ``value`` a dict names a class as FLARE's component builder reads one (a key
    'path', 'class_path' or 'name'), or None."""
    if isinstance(value, dict):
        if {"path", "class_path", "name"} & set(value):
            return where
        for k, v in value.items():
            found = _nested_component(v, f"{where}.{k}")
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _nested_component(v, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def _component(entry, at: str, place: str, out: Checked, resolve, refuse, byoc: bool, ids: Optional[set]) -> None:
    if not isinstance(entry, dict):
        refuse(at, "must be a dict with 'path' and 'args'")
    extra = set(entry) - {"id", "path", "args"}
    if extra or "path" not in entry:
        refuse(at, f"must name its class in 'path' (with 'id' and 'args' only), has {sorted(entry)}")
    path, cid, args = entry["path"], entry.get("id"), entry.get("args", {})
    if not place.endswith(".filters") and any(path == named for _, named, _ in out.components):
        # each is checked against the site's limits (a model built on the meta device): many of
        # them would keep the gate busy, and no job needs one component class twice. It is a
        # privacy rule too: a second workflow training from another persistor's model would keep
        # the sites' UpdateMask factors of the first while changing the signs under them
        refuse(f"{at} path {_show(path)}", "is named a second time; a config names each class once")
    if ids is not None:
        why = NAME.why(cid)
        if why or cid in ids:
            refuse(f"{at} id {_show(cid)}", why or "is used twice")
        ids.add(cid)
    name = f"component '{cid}' ({path})" if cid else f"component {path} ({at})"
    if not isinstance(path, str) or _braces(path):
        refuse(f"{at} path {_show(path)}", "must be a class path")
    if not isinstance(args, dict):
        refuse(f"{name} 'args'", "must be a dict")
    component = COMPONENTS.get(path)
    if component is None:
        if byoc:  # the job's own code: FLARE's byoc right decides; its values must still be plain
            _plain(args, lambda where, v: refuse(f"{name}, argument '{where.lstrip('.')}'", _filled(v)))
            out.components.append((place, path, dict(args)))
            return
        refuse(name, f"is not one a job may name ({at}); see fedpartial.flare.job_schema.COMPONENTS")
    if place not in component.places:
        refuse(name, f"may not sit in {place} ({at}); it belongs in {list(component.places)}")
    resolved = {}
    for arg, raw in args.items():
        spec = component.args.get(arg)
        where = f"{name}, argument '{arg}'"
        if spec is None:
            refuse(where, f"is not one it takes; a job may set {sorted(k for k, s in component.args.items() if s.settable)}")
        value, was_ref = resolve(raw)
        nested = _nested_component(value)
        if nested is not None:
            refuse(f"{name}, argument '{arg}{nested}'", "is a dict FLARE would build as a component (it names "
                                                        "'path', 'class_path' or 'name'); a job's arguments are "
                                                        "plain values")
        if not was_ref and not getattr(spec, "site_placeholder", False):
            _plain(raw, lambda w, v: refuse(f"{name}, argument '{arg}{w}'", _filled(v)), "")
        why = spec.why(value)
        if why:
            refuse(f"{where} = {_show(raw)}", why)
        resolved[arg] = value
    for arg, key in component.keyed.items():  # rule_args by rule
        spec = component.args[arg]
        record = spec.record(resolved.get(key, "fedavg"))
        why = record.why(resolved.get(arg) or {}) if record is not None else ""
        if why:
            refuse(f"{name}, argument '{arg}' of {key} {_show(resolved.get(key, 'fedavg'))}", why)
    out.components.append((place, path, resolved))
