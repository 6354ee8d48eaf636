"""A site's own say over what a job reads and writes: ``<kit>/local/fedpartial_site.json``.

Provisioning writes this file into every kit (``SitePolicyBuilder``); the site edits it. It names
the data folders the site offers, one per federation or study::

    {"format_version": 1,
     "datasets": {"ham_lsm": "/data/fedpartial/ham", "ich_mlp": "/data/fedpartial/ich"}}

A kit that holds the file is a *provisioned site*: a job names a dataset (the executor's
``dataset``) and never a path; a job that sets ``data_root`` or ``reference_file``, names a
dataset the site does not offer, or names no runtime version is refused at its start. A kit
without the file (the simulator, ``nvflare poc`` kits) is a *development site*: the job's
``data_root`` or ``$FEDPARTIAL_DATA_ROOT`` is used, and the log says it is a development path.

Every path a job may set (``data_file``, ``state_dir``) is relative, and may not climb out of
the folder it is resolved in, at every kind of site. A provisioned site also accepts only its own
site file (``{site}.npz`` or ``{site}``) as ``data_file``, refuses a complete-label reference copy
whatever its name, caps ``model.input_size`` (``max_input_size``, default 1024 px), and keeps the
resized copy of a large site folder in its own workspace (``KIT/fedpartial_cache/``), never in the
data folder it offers.

**What a site allows** lives here, in one place: the datasets it offers, its privacy floors
(:data:`FLOORS`: a job may only raise them) and its resource limits (:data:`LIMITS`: a job asking
more is refused before anything is allocated), each a key of the file with a default that suits a
hospital's CPU or GPU server. The server's kit holds the same file (no datasets; its floors and
limits). What a job may set at all is :mod:`fedpartial.flare.job_schema`; what may leave a site is
:mod:`fedpartial.flare.result_policy`.
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, Optional

SITE_CONFIG = "fedpartial_site.json"
FORMAT_VERSION = 1


def site_config_path(workspace_root: str) -> str:
    """``<workspace_root>/local/fedpartial_site.json``."""
    return os.path.join(workspace_root, "local", SITE_CONFIG)


def load_site_config(workspace_root: str) -> Optional[dict]:
    """The site's configuration, checked; ``None`` when the kit has none (a development site).

    Dataset folders are returned absolute (``~`` expanded; a relative folder is taken from the
    kit's root).

    Args:
        workspace_root: the site's kit / workspace root (FLARE's ``workspace.get_root_dir()``).

    Raises:
        ValueError: the file is not valid JSON or lacks / misnames a key (naming the file and key).
    """
    path = site_config_path(workspace_root)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"site configuration '{path}' cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"site configuration '{path}' must hold a JSON object")
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"site configuration '{path}': format_version must be {FORMAT_VERSION}, got {version!r}")
    datasets = config.get("datasets", {})
    if not isinstance(datasets, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                 for k, v in datasets.items()):
        raise ValueError(f"site configuration '{path}': 'datasets' must map names to folders, got {datasets!r}")
    root = os.path.abspath(workspace_root)
    out = dict(config)
    out["datasets"] = {name: os.path.normpath(os.path.join(root, os.path.expanduser(folder)))
                       for name, folder in datasets.items()}
    out["path"] = path
    return out


def confined(base: str, relative: str, field: str, where: str) -> str:
    """``base``/``relative``, refused when ``relative`` is absolute or climbs out with ``..``.

    Args:
        base: the folder the job's value is resolved in.
        relative: the job's value.
        field: the job's setting, for the message (e.g. ``state_dir``).
        where: who refuses (e.g. ``site 'site-1'``).

    Raises:
        ValueError: naming the field, the value and the folder it must stay in.
    """
    value = str(relative)
    parts = value.replace("\\", "/").split("/")
    if os.path.isabs(value) or value.startswith("~") or ".." in parts:
        raise ValueError(f"{where} refuses the job: its '{field}' ({value!r}) must be a path relative to "
                         f"{base}, without '..'")
    return os.path.normpath(os.path.join(base, value))


#: the file name patterns a job may give a provisioned site: its own site file or site folder
SITE_FILE_PATTERNS = ("{site}.npz",)  # a site folder is found beside it (<site>/), see resolve_data_file
#: Privacy floors of a participant (keys of its file): a job may only make them stricter, the
#: larger of the participant's and the job's value applies (``min_count`` at a provisioned site:
#: not even stricter, see :data:`STATISTICS_FILTERS`).
FLOORS = {
    # the fewest images behind any count, statistic or curve that leaves a site
    "min_count": 5,
    # the server: the fewest sites behind any published aggregate (one site's = its local model)
    "min_sites_per_round": 2,
    # the server: the fewest sites behind a summed statistic sent back to the sites (with two, each
    # site subtracts its own from the sum and reads the other's)
    "min_sites_for_shared_stats": 3,
    # the fewest optimizer steps behind a local model a site sends: one Adam step moves every weight
    # by +-lr, so a one-step model is its batch's gradient signs, exact even inside a 2-site average
    "min_local_steps": 2,
}
#: Privacy bounds that are fractions (a job may only make them stricter):
FRACTION_BOUNDS = {
    # Adam with beta2 0 divides each step by that step's gradient size, so with beta1 0 too every
    # step is again +-lr, whatever the number of steps
    "min_adam_beta2": 0.9,
    # a weight decay that outweighs the data's gradient makes every site's update -lr x sign(the
    # round-0 weights), known to the submitter: it reads each weight's secret UpdateMask factors
    # (an outside attempt, weight_decay 1.0) and divides them out of a later job (the shipped 5e-4)
    "max_weight_decay": 0.01,
}
#: the floors and bounds a site's own file holds (the others are the server's)
SITE_FLOORS = ("min_count", "min_local_steps", "min_adam_beta2", "max_weight_decay")
#: Resource limits of a participant (keys of its file), checked on the job's config before anything
#: is built; defaults for a hospital's server (16-64 GB of memory, one GPU or none).
LIMITS = {
    # parameters of the job's model (counted on torch's meta device): 50 M is 200 MB of float32
    # weights, about 1 GB with gradients and optimiser state; DenseNet121 has 7 M, ResNet18 11 M
    "max_model_parameters": 50_000_000,
    "max_input_size": 1024,      # px a side of model.input_size (resized copies fill memory or disk)
    "max_batch_size": 256,       # images per batch, training and prediction
    "max_views": 8,              # augmented views / MixUp pairs / MC-dropout passes per image
    "max_local_epochs": 20,      # local epochs per round
    "max_local_steps": 10_000,   # local iterations per round
    "max_rounds": 1000,          # rounds of a job
    "max_loader_workers": 4,     # data loader processes
    # GiB of activations a training batch keeps for its backward pass (or a prediction batch's two
    # largest layers), estimated on torch's meta device: DenseNet-121 at 224 px, batch 64, is about
    # 9; what a width, stride or input size can ask is unbounded otherwise
    "max_activation_gib": 16,
    # GiB of the site's images at the job's input size, as float32: held in memory for a .npz, on
    # disk (fedpartial_cache) for a site folder; 250 images of 28 px asked at 1024 px are 3 GiB
    "max_resized_gib": 32,
    # hours a site gives one job, from its first training task: within the other limits a job can
    # still ask for days a round on a CPU, and a train_timeout of 0 never ends it
    "max_job_hours": 72,
    # jobs a site runs at once (fedpartial.flare.site_resources): every limit above is per job, and
    # the server starts up to 4 at once; a further job waits in the server's queue
    "max_concurrent_jobs": 1,
}
#: What a server's kit takes of a submitted job before FLARE reads any of it (keys of its file):
#: FLARE unpacks and parses an upload in the server's own process, so a small DEFLATE upload of
#: zeros, or a meta of whitespace, would take its memory. A job is its configs (a few kB).
SUBMISSION_LIMITS = {
    "max_job_bytes": 64 * 2 ** 20,   # bytes of the job's files, unpacked (byoc code included)
    "max_job_files": 1000,           # files and folders in the job
    "max_meta_bytes": 64 * 2 ** 10,  # bytes of its meta.json
}
#: the server aggregator's own weighting arguments, its constructor's defaults
AGGREGATOR_WEIGHTING = {"weight_rule": "mean", "trim_fraction": 0.2, "cap_samples": True, "max_norm_ratio": 10.0}
#: How the sites' updates are combined is the participant's to decide, not a job's: a job leaves
#: each at the participant's value (key ``weighting`` of its file; these the defaults, as the
#: shipped jobs run). Two jobs that combine the same local models with other weights are two
#: equations in them, and the submitter solves for each site's model. Keys: an argument of the
#: server's ``RuleAggregator``, or ``<rule>.<argument>`` of a rule's ``rule_args``.
SERVER_WEIGHTING = {
    **AGGREGATOR_WEIGHTING,
    "fedlsm.use_awpa": True, "fedlsm.without_awpa": "masked", "fedmlp.classifier_rows": "fedavg",
    # which sites enter a class's averaged prototype: one count between two sites' leaves one site's
    "fedmlp.min_prototype_samples": 1,
    "fedirm.relation_weighting": "sites", "fedirm.unlabelled_weight": 0.05,
    # when the completeness weighting starts: two jobs switching at different rounds would weight
    # one round's local models by size and by completeness
    "fedia.warmup_rounds": 10, "fedia.use_completeness_weighting": True, "fedia.fedavg_after_all_corrected": True,
    "fedia.loss_floor": 1e-6, "fedia.completeness_max": 1.0, "fedia.max_weight_ratio": 2.0,
}
#: ... and at a site, what it reports as its weight (the executor's ``rule_args``)
SITE_WEIGHTING = {
    "fedavg.weight_by": "labelled_rows",
    "fedia.completeness_floor": 1e-3, "fedia.completeness_cap": 1.0, "fedia.min_predicted_ratio": 0.5,
}
#: Which images enter what a site sends is the participant's too: the thresholds and sample sizes
#: that select the images behind a statistic or a count a site sends, on a model the submitter can
#: reproduce (a seeded job trains the same local model twice). Two jobs differing only there
#: count single images: FedMLP's learning degree at 'high' 0.4021 and 0.4022 published 3 and 1
#: images of a site's, an outside attempt's per-image score oracle. Keys as in the weighting
#: tables; the defaults are how the shipped jobs run.
SITE_STATISTICS = {
    # FedMLP: the learning degree's band, the positive-tag check's size, whose thresholds a site tags by
    "fedmlp.low": 0.3, "fedmlp.high": 0.7, "fedmlp.tag_check_samples": 10, "fedmlp.use_adaptive_threshold": True,
    # FedLSM: the pseudo-label thresholds and the confident / uncertain split behind its counts
    "fedlsm.tau": 0.95, "fedlsm.tau_l": 0.85, "fedlsm.tau_p": 0.85, "fedlsm.tau_n": 0.005, "fedlsm.tau_lp": 0.7,
    "fedlsm.tau_ln": 0.01, "fedlsm.confident_fraction": 0.143, "fedlsm.uncertain_fraction": 0.036,
    # FedIRM: the relation matrices' temperature and the reliable-sample filter
    "fedirm.temperature": 2.0, "fedirm.entropy_threshold": math.log(2), "fedirm.multilabel_entropy_threshold": 0.5,
    "fedirm.min_confidence": 0.0, "fedirm.reliable_fraction": 0.5,
    # FedIA: the mask threshold behind IoU and completeness, the correction threshold behind its pixel counts
    "fedia.prob_threshold": 0.5, "fedia.correction_threshold": 0.95,
}
#: ... and at the server, the tagging thresholds it sends FedMLP's sites
SERVER_STATISTICS = {"fedmlp.t0": 0.05, "fedmlp.t1": 0.1}
#: the participant's tables of how a job runs: key of its file -> (server's, site's, why, in the refusal)
PARTICIPANT_TABLES = {
    "weighting": (SERVER_WEIGHTING, SITE_WEIGHTING,
                  "how the sites' updates are weighted is this participant's to decide",
                  "two jobs weighting the same local models differently let their submitter solve for each "
                  "site's model"),
    "statistics": (SERVER_STATISTICS, SITE_STATISTICS,
                   "which images enter what a site sends is this participant's to decide",
                   "two jobs selecting differently from the same model let their submitter count single images"),
}
MIN_COUNT = FLOORS["min_count"]
MAX_INPUT_SIZE = LIMITS["max_input_size"]
#: the rule_args each limit covers (tests/test_job_schema.py keeps them in step with the schema)
LIMITED_ARGS = {
    "max_batch_size": ("batch_size", "eval_batch_size", "prediction_batch_size", "predict_batch_size"),
    "max_views": ("num_views", "ude_pairs", "mc_passes"),
    "max_local_epochs": ("local_epochs",),
    "max_local_steps": ("local_iterations",),
    "max_loader_workers": ("loader_workers",),
}


def site_rules(config: Optional[dict]) -> dict:
    """The participant's floors and limits: :data:`FLOORS` and :data:`LIMITS` with its file's values.

    Args:
        config: from :func:`load_site_config` (None: a development site, the defaults).

    Raises:
        ValueError: a floor or limit that is not a non-negative integer, naming the file and key.
    """
    out = {**FLOORS, **LIMITS, **SUBMISSION_LIMITS}
    for key in out:
        value = (config or {}).get(key, out[key])
        lowest = 0 if key in ("min_count", "min_sites_for_shared_stats", "max_loader_workers") else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise ValueError(f"site configuration '{(config or {}).get('path', '?')}': {key} must be an integer "
                             f">= {lowest}, got {value!r}")
        out[key] = value
    for key, value in FRACTION_BOUNDS.items():
        value = (config or {}).get(key, value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ValueError(f"site configuration '{(config or {}).get('path', '?')}': {key} must be a number in "
                             f"[0, 1), got {value!r}")
        out[key] = float(value)
    return out


def participant_table(config: Optional[dict], side: str, table: str) -> dict:
    """The participant's table ``table`` of :data:`PARTICIPANT_TABLES` (``weighting``: its
    :data:`SERVER_WEIGHTING` (``side`` ``server``) or :data:`SITE_WEIGHTING`; ``statistics``:
    :data:`SERVER_STATISTICS` or :data:`SITE_STATISTICS`) with its file's values.

    Args:
        config: from :func:`load_site_config` (None: a development site, the defaults).
        side: ``server`` or ``client``.
        table: ``weighting`` or ``statistics``.

    Raises:
        ValueError: a key that is none of them, naming the file and key.
    """
    server, site, _, _ = PARTICIPANT_TABLES[table]
    out = dict(server if side == "server" else site)
    own = (config or {}).get(table, {})
    path = (config or {}).get("path", "?")
    if not isinstance(own, dict):
        raise ValueError(f"site configuration '{path}': '{table}' must map settings to values, got {own!r}")
    unknown = sorted(set(own) - set(out))
    if unknown:
        raise ValueError(f"site configuration '{path}': '{table}' holds {unknown}; a {side} decides {sorted(out)}")
    out.update(own)
    return out


def _default(side: str, rule: str, arg: str):
    """The constructor default of ``arg`` of the server's aggregator (``rule`` "") or of a rule."""
    import inspect

    from fedpartial.algorithms.registry import rule_class

    if not rule:
        return AGGREGATOR_WEIGHTING[arg]
    return inspect.signature(rule_class(side, rule).__init__).parameters[arg].default


def check_participant_tables(checked, config: Optional[dict], side: str, where: str, source: str) -> None:
    """A provisioned participant runs a job only with its own weighting and its own selection of
    the images behind what a site sends (:data:`PARTICIPANT_TABLES`): a value the job sets, or the
    constructor's default it leaves, must be the participant's.

    Args:
        checked: the job's config as :func:`fedpartial.flare.job_schema.check_config` returns it.
        config: the participant's file (:func:`load_site_config`); None = a development site,
            where a job weights as it likes.
        side: ``server`` or ``client``: whose config ``checked`` is (a server checks only its own).
        where: who refuses.
        source: the participant's file, for the message.

    Raises:
        ValueError: naming the component, argument, the job's value and the participant's.
    """
    if config is None:
        return
    for table, (_, _, whose, why) in PARTICIPANT_TABLES.items():
        own = participant_table(config, side, table)
        for _, path, args in checked.components:
            name = path.rpartition(".")[2]
            if name not in ("RuleAggregator", "FedPartialExecutor"):
                continue
            rule = args.get("rule", "fedavg")
            rule_args = args.get("rule_args") or {}
            for key, wanted in own.items():
                owner, _, arg = key.rpartition(".")
                # a rule's argument of the rule this component runs; the aggregator's own of the aggregator
                if (owner and owner != rule) or (not owner and name != "RuleAggregator"):
                    continue
                values = rule_args if owner else args
                value = values[arg] if arg in values else _default(side, owner, arg)
                if value != wanted:
                    field = f"rule_args.{arg} of rule '{rule}'" if owner else arg
                    raise ValueError(f"{where} refuses the job: {name} {field} = {value!r}; {whose} ({wanted!r}, "
                                     f"'{key}' of '{table}' in {source}): {why}")


#: client rules that can make a fixed number of steps a round (``rule_args.local_iterations``)
FIXED_STEP_RULES = ("fedavg", "fedlsm")


def check_equal_steps(client_checked, config: Optional[dict], where: str, source: str) -> None:
    """Under an unweighted server rule (``weight_rule`` ``median`` / ``trimmed_mean`` in the server's
    ``weighting``) every site makes the same number of steps: with epochs each site's step count
    follows its size, and at a small lr each update is about +-steps x lr per weight, so the size
    of an update tells the sites apart again (an outside attempt read 91 % / 96 % of two sites'
    update signs from one unweighted aggregate of 2 and 4 steps).

    Args:
        client_checked: the job's client config as :func:`fedpartial.flare.job_schema.check_config`
            returns it (None: the app has none).
        config: the server's file (:func:`load_site_config`); None = a development server.
        where: who refuses.
        source: the server's file, for the message.

    Raises:
        ValueError: naming the rule and what to set.
    """
    if config is None or client_checked is None:
        return
    rule_name = participant_table(config, "server", "weighting")["weight_rule"]
    if rule_name == "mean":
        return
    for _, path, args in client_checked.components:
        if path.rpartition(".")[2] != "FedPartialExecutor":
            continue
        rule = args.get("rule", "fedavg")
        rule_args = args.get("rule_args") or {}
        steps = rule_args.get("local_iterations")
        fixed = (rule in FIXED_STEP_RULES and isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1
                 and not rule_args.get("steps_of"))
        if not fixed:
            raise ValueError(f"{where} refuses the job: FedPartialExecutor rule '{rule}' does not make one fixed number "
                             f"of steps at every site; this server combines the sites' updates unweighted "
                             f"({rule_name!r}, 'weight_rule' of 'weighting' in {source}), and updates of different "
                             f"step counts tell the sites apart: set rule_args.local_iterations (rules "
                             f"{', '.join(repr(r) for r in FIXED_STEP_RULES)}; no steps_of)")


#: Filters that change the weights a site sends by the job's arguments, per site (FLARE's
#: ``PercentilePrivacy`` clips each update at gamma x that site's published sample count). From a
#: job, a clipped and a plain job are two different combinations of the same local models, which an
#: outside attempt solved for 70 % of both sites' updates; at a provisioned participant only its own
#: ``privacy.json`` scope adds them, the same for every job.
SITE_SCOPE_FILTERS = ("nvflare.app_common.filters.percentile_privacy.PercentilePrivacy",)


#: The job's statistics filters: at a provisioned participant a job names the method's preset and
#: nothing else of them (a ``min_count`` up to the participant's own, which applies anyway). Other
#: arguments, or a ``min_count`` between two sites' counts, change which statistics each site sends
#: and so how the server weights the same local models (FedLSM's class-wise rows: an outside attempt
#: solved both sites' classifier rows from two such jobs).
STATISTICS_FILTERS = ("fedpartial.flare.filters.StatisticsPrivacyFilter",
                      "fedpartial.flare.result_policy.SiteResultPolicy")
#: the client rules that send statistics, and the presets of their statistics filter
STATISTICS_PRESETS = {"fedlsm": ("fedlsm",), "fedmlp": ("fedmlp",), "fedirm": ("fedirm", "fedirm_multilabel"),
                      "fedia": ("fedia",)}


def check_job_filters(checked, config: Optional[dict], where: str, raw: Optional[dict] = None) -> None:
    """A provisioned participant runs a job's filters only as the method ships them, so that every
    job of a method sends the same statistics and weights: no filter that changes the weights a site
    sends (:data:`SITE_SCOPE_FILTERS`), a statistics filter with the method's preset only
    (:data:`STATISTICS_FILTERS`), and, for a rule that sends statistics, that filter on its training
    task. A development site (``config`` None) runs any (the bench's privacy measurements).

    Args:
        checked: a config as :func:`fedpartial.flare.job_schema.check_config` returns it.
        config: the participant's file; None = a development site.
        where: who refuses.
        raw: the client config as the job wrote it (for the tasks its statistics filter covers).

    Raises:
        ValueError: naming the filter, argument and value.
    """
    if config is None:
        return
    floor_count = site_rules(config)["min_count"]
    covered = set()  # the tasks whose results pass a statistics filter
    for chain in (raw or {}).get("task_result_filters", []):
        if any(isinstance(f, dict) and f.get("path") in STATISTICS_FILTERS for f in chain.get("filters", [])):
            covered |= set(chain.get("tasks") or [])

    def refuse(what: str, why: str):
        raise ValueError(f"{where} refuses the job: {what} {why}")

    presets = []
    for place, path, args in checked.components:
        name = path.rpartition(".")[2]
        if not place.endswith(".filters"):
            continue
        if path in SITE_SCOPE_FILTERS:
            refuse(f"its filter {name} ({place})", "changes the weights each site sends by the job's arguments; a "
                   "site adds it in its own local/privacy.json, the same for every job: from a job, a filtered "
                   "and a plain job combine the same local models two ways")
        if path in STATISTICS_FILTERS:
            extra = sorted(set(args) - {"preset", "min_count"})
            if extra:
                refuse(f"its filter {name} sets {extra}:", "a job's statistics filter names the method's preset "
                       "(and a min_count up to this participant's): other settings change which statistics each "
                       "site sends, and so how the server weights the same local models")
            if int(args.get("min_count", 0)) > floor_count:
                refuse(f"its filter {name} min_count = {args['min_count']}", f"is above this participant's "
                       f"{floor_count} ('min_count' in local/fedpartial_site.json): a count chosen between two "
                       f"sites' makes one of them withhold a statistic, and so changes how the server weights the "
                       f"same local models")
            presets.append(args.get("preset"))
    for _, path, args in checked.components:
        if not path.endswith(".FedPartialExecutor"):
            continue
        wanted = STATISTICS_PRESETS.get(args.get("rule", "fedavg"))
        task = args.get("train_task_name", "train")
        if wanted and (not set(presets) & set(wanted) or (raw is not None and not covered & {task, "*"})):
            refuse(f"its rule '{args.get('rule')}'", f"sends statistics, and its client config has no "
                   f"StatisticsPrivacyFilter with the preset {wanted[0]!r} on its training task {task!r}: every "
                   f"job of a method sends its statistics through the same filter")


def participant_config(fl_ctx) -> Optional[dict]:
    """The site configuration of the participant running ``fl_ctx`` (None: a development site, or
    a context without a workspace, as in unit tests)."""
    engine = fl_ctx.get_engine() if fl_ctx is not None else None
    try:
        root = engine.get_workspace().get_root_dir() if engine is not None else None
    except Exception:  # no workspace: not a running participant
        return None
    return load_site_config(root) if isinstance(root, str) else None


def training_seed(job_seed: int, provisioned: bool) -> int:
    """The seed a site's training draws its shuffles and augmentations from.

    A development site (simulator, POC) takes the job's, so a seeded run repeats. A provisioned
    site draws a fresh one for every job: a lead who could repeat a site's training ran two jobs
    that differed only in one site's step count (``local_epochs`` 1.06 and 1.07) and read that
    site's last step, one batch's gradient signs, exactly from the difference of the two aggregates.

    Args:
        job_seed: the job's ``seed``.
        provisioned: whether the site has its ``local/fedpartial_site.json``.
    """
    if not provisioned:
        return int(job_seed)
    import secrets

    return secrets.randbits(31)


def floor(config: Optional[dict], key: str, job_value: int) -> int:
    """The larger of the participant's floor ``key`` and the job's value (a development site: the
    job's value)."""
    if config is None:
        return int(job_value)
    return max(int(job_value), site_rules(config)[key])


def parameter_count(model: dict) -> int:
    """Parameters of the job's model block, built on torch's meta device (nothing is allocated)."""
    import torch

    from fedpartial.flare.common import build_model_from_settings, model_settings

    with torch.device("meta"):
        net = build_model_from_settings(model_settings(model))
    return sum(p.numel() for p in net.parameters())


#: the folders of a provisioned server's kit a job may read weights from (by relative path); the
#: server's operator puts files there
PRETRAINED_DIR, RESUME_DIR = "pretrained", "resume"


#: the batch a site's validation and cross-site evaluation predict with (fedpartial.evaluation)
PREDICT_BATCH = 128
_PREDICT_BATCH_ARGS = ("eval_batch_size", "prediction_batch_size", "predict_batch_size")


def activation_gib(model: dict, train_batch: int, predict_batch: int) -> tuple:
    """GiB of activations of the job's model for one training batch (every layer's output, kept for
    the backward pass) and one prediction batch (its largest layer's output twice), from a forward
    pass of one image on torch's meta device (nothing is allocated).

    Args:
        model: the job's model block.
        train_batch: images a training step puts through the model (batch size x views).
        predict_batch: images a prediction step puts through it.
    """
    import torch

    from fedpartial.flare.common import build_model_from_settings, model_settings

    settings = model_settings(model)
    with torch.device("meta"):
        net = build_model_from_settings(settings).eval()
    sizes = []

    def record(module, inputs, output):
        for out in output if isinstance(output, (list, tuple)) else [output]:
            if isinstance(out, torch.Tensor):
                sizes.append(out.numel() * out.element_size())

    hooks = [m.register_forward_hook(record) for m in net.modules() if not list(m.children())]
    try:
        h, w = settings["input_size"]
        with torch.no_grad():
            net(torch.empty(1, settings["in_channels"], h, w, device="meta"))
    finally:
        for hook in hooks:
            hook.remove()
    gib = float(2 ** 30)
    return sum(sizes) * train_batch / gib, 2 * max(sizes, default=0) * predict_batch / gib


def check_server_files(checked, workspace_root: str, where: str) -> None:
    """A provisioned server starts a job only from weights its operator placed in its kit:
    ``model.pretrained`` in ``pretrained/``, the persistor's ``resume_from`` in ``resume/``.

    Raises:
        ValueError: naming the argument, the value and the folder it must be in.
    """
    wanted = []
    for _, path, args in checked.components:
        if path.endswith(".FedPartialPersistor"):
            model = args.get("model") if isinstance(args.get("model"), dict) else {}
            wanted += [("model.pretrained", model.get("pretrained") or "", PRETRAINED_DIR),
                       ("resume_from", args.get("resume_from") or "", RESUME_DIR)]
    for field, value, folder in wanted:
        if not value:
            continue
        base = os.path.join(workspace_root, folder)
        target = confined(base, value, field, where)
        if not (os.path.isfile(target) or (folder == RESUME_DIR and os.path.isdir(target))):
            raise ValueError(f"{where} refuses the job: its '{field}' ({value!r}) is not in its kit's {folder}/ "
                             f"folder; the server's operator places the weights a job may start from there, a job "
                             f"cannot bring them")


def check_limits(checked, rules: dict, where: str, source: str) -> None:
    """Refuse a job asking more of this participant than its limits allow, before anything is built.

    Args:
        checked: the job's config as :func:`fedpartial.flare.job_schema.check_config` returns it.
        rules: :func:`site_rules`.
        where: who refuses (``site 'site-1'``, ``the server``).
        source: the participant's file, for the message.

    Raises:
        ValueError: naming the component, argument, value and the limit's key.
    """
    def refuse(what: str, value, key: str, unit: str = ""):
        raise ValueError(f"{where} refuses the job: {what} = {value}{unit} is beyond this participant's limit of "
                         f"{rules[key]:,}{unit} ('{key}' in {source})")

    models = [args["model"] for _, _, args in checked.components if isinstance(args.get("model"), dict)]
    if isinstance(checked.variables.get("model"), dict):
        models.append(checked.variables["model"])
    seen = set()
    for model in models:
        size = list(model.get("input_size") or [0, 0])
        if any(v > rules["max_input_size"] for v in size):
            raise ValueError(f"{where} refuses the job: model.input_size {size} is beyond this site's limit of "
                             f"{rules['max_input_size']} px a side ('max_input_size' in {source})")
        key = repr(sorted((k, repr(v)) for k, v in model.items() if k in ("arch", "arch_args", "in_channels",
                                                                             "class_names", "task")))
        if key not in seen:
            seen.add(key)
            count = parameter_count(model)
            if count > rules["max_model_parameters"]:
                refuse(f"model {model['arch']} {model.get('arch_args', {})} ({len(model['class_names'])} classes): "
                       f"parameters", f"{count:,}", "max_model_parameters")
    for place, path, args in checked.components:
        name = path.rpartition(".")[2]
        rule_args = args.get("rule_args") or {}
        # a matched baseline makes the steps of the rule named in steps_of: its arguments count too
        steps_of = rule_args.get("steps_of") if isinstance(rule_args.get("steps_of"), dict) else {}
        for prefix, values in (("rule_args", rule_args),
                               ("rule_args.steps_of.rule_args", steps_of.get("rule_args") or {})):
            for limit, names in LIMITED_ARGS.items():
                for arg in names:
                    value = values.get(arg)
                    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > rules[limit]:
                        refuse(f"{name} {prefix}.{arg}", value, limit)
            betas = values.get("betas")
            if isinstance(betas, (list, tuple)) and len(betas) == 2 and isinstance(betas[1], (int, float)) \
                    and betas[1] < rules["min_adam_beta2"]:
                raise ValueError(f"{where} refuses the job: {name} {prefix}.betas = {list(betas)}: Adam's beta2 "
                                 f"below this participant's floor of {rules['min_adam_beta2']} ('min_adam_beta2' in "
                                 f"{source}) makes each step the sign of its gradient, which a 2-site average "
                                 f"does not hide")
            decay = values.get("weight_decay")
            if isinstance(decay, (int, float)) and not isinstance(decay, bool) and decay > rules["max_weight_decay"]:
                raise ValueError(f"{where} refuses the job: {name} {prefix}.weight_decay = {decay} is above this "
                                 f"participant's limit of {rules['max_weight_decay']} ('max_weight_decay' in "
                                 f"{source}): a decay that outweighs the data's gradient makes each site's update "
                                 f"predictable from the round-0 model")
        # last: the arguments' own limits name the argument a job overdid
        if name == "FedPartialExecutor" and isinstance(args.get("model"), dict):
            train, predict = _activations(args["model"], rule_args, where)
            for what, gib in (("a training batch", train), ("a prediction batch", predict)):
                if gib > rules["max_activation_gib"]:
                    refuse(f"model {args['model'].get('arch')} {args['model'].get('arch_args', {})} at "
                           f"{args['model'].get('input_size')} px: activations of {what}", f"{gib:,.1f}",
                           "max_activation_gib", " GiB")
        rounds = args.get("num_rounds") if name == "ScatterAndGather" else None
        if isinstance(rounds, int) and rounds > rules["max_rounds"]:
            refuse(f"{name} num_rounds", rounds, "max_rounds")


def resized_gib(num_images: int, size, channels: int) -> float:
    """GiB of ``num_images`` images resized to ``size`` (H, W) with ``channels``, as float32."""
    return num_images * int(size[0]) * int(size[1]) * max(1, int(channels)) * 4 / 2 ** 30


def check_resized(num_images: int, size, channels: int, limit_gib: float, where: str, path: str) -> None:
    """Refuse to resize a site's images to the job's input size beyond ``max_resized_gib``: the
    resized copy is held in memory (a .npz) or written to disk (a site folder's cache), and the job
    sets the size.

    Args:
        num_images: images in every split of the site's file.
        size: the job's ``input_size``.
        channels: channels of an image.
        limit_gib: the participant's ``max_resized_gib``.
        where: who refuses.
        path: the site's file, for the message (named by its file name only).

    Raises:
        ValueError: naming the images, the size and the limit.
    """
    gib = resized_gib(num_images, size, channels)
    if gib > limit_gib:
        raise ValueError(f"{where} refuses the job: {num_images:,} images of '{os.path.basename(path)}' at "
                         f"{int(size[0])}x{int(size[1])} px = {gib:,.1f} GiB is beyond this participant's limit of "
                         f"{limit_gib:,} GiB ('max_resized_gib' in local/fedpartial_site.json)")


def _activations(model: dict, rule_args: dict, where: str) -> tuple:
    def number(key, default):
        value = rule_args.get(key, default)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default

    train = number("batch_size", 64) * max(number("num_views", 1), number("ude_pairs", 1))
    predict = max([PREDICT_BATCH] + [number(k, PREDICT_BATCH) for k in _PREDICT_BATCH_ARGS])
    try:
        return activation_gib(model, train, predict)
    except Exception as e:  # a model whose size cannot be estimated is not run
        raise ValueError(f"{where} refuses the job: the memory of its model {model.get('arch')} cannot be "
                         f"estimated ({type(e).__name__})") from None


def check_data_file(data_file: str, where: str) -> None:
    """A provisioned site reads only its own site file (or site folder) in the dataset a job names.

    Raises:
        ValueError: naming the job's ``data_file`` and the patterns the site accepts.
    """
    if data_file not in SITE_FILE_PATTERNS:
        raise ValueError(f"{where} refuses the job: its 'data_file' ({data_file!r}) is not one of "
                         f"{list(SITE_FILE_PATTERNS)}: a job reads the site's own file in the dataset it names")


def offered_data_root(config: dict, dataset: str, data_root: str, reference_file: str, where: str) -> str:
    """The folder of the dataset a job names at a provisioned site, or a refusal.

    Args:
        config: from :func:`load_site_config`.
        dataset: the job's ``dataset``.
        data_root: the job's ``data_root`` (must be empty here).
        reference_file: the job's ``reference_file`` (must be empty here: complete-label copies
            exist only in the simulator and the bench).
        where: who refuses (e.g. ``site 'site-1'``).

    Raises:
        ValueError: naming the field that was refused and the datasets the site offers.
    """
    offered: Dict[str, str] = config["datasets"]
    names = ", ".join(sorted(offered)) or "none (add one to its 'datasets')"
    hint = f"{where} offers the datasets: {names} ({config['path']})"
    if data_root:
        raise ValueError(f"{where} refuses the job: it sets 'data_root' ({data_root!r}); a job names a dataset "
                         f"in 'dataset', never a path. {hint}")
    if reference_file:
        raise ValueError(f"{where} refuses the job: it sets 'reference_file' ({reference_file!r}); complete-label "
                         f"copies are read only in the simulator and the bench")
    if not dataset:
        raise ValueError(f"{where} refuses the job: it names no 'dataset'. {hint}")
    if dataset not in offered:
        raise ValueError(f"{where} refuses the job: 'dataset' {dataset!r} is not offered here. {hint}")
    return offered[dataset]


def offer_dataset(workspace_root: str, name: str, folder: str) -> str:
    """Add (or move) the dataset ``name`` -> ``folder`` in the kit's site configuration, creating
    the file when the kit has none. Returns the file's path.

    Args:
        workspace_root: the site's kit.
        name: the name jobs give in ``dataset`` (letters, digits, ``_``, ``-``, ``.``).
        folder: the folder holding ``<site>.npz`` (or site folders); made absolute.

    Raises:
        ValueError: a bad name, a folder that does not exist, or a broken existing file.
    """
    import re

    if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(name or "")):
        raise ValueError(f"dataset name {name!r}: use letters, digits, '_', '-' and '.' only")
    folder = os.path.abspath(os.path.expanduser(folder))
    if not os.path.isdir(folder):
        raise ValueError(f"dataset '{name}': folder '{folder}' does not exist")
    path = site_config_path(workspace_root)
    config = {"format_version": FORMAT_VERSION, "datasets": {}}
    if os.path.isfile(path):
        load_site_config(workspace_root)  # refuse to rewrite a file that does not check
        with open(path) as f:
            config = json.load(f)
    config.setdefault("datasets", {})[name] = folder
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, path)
    return path
