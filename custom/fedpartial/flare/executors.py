"""The site side: one Executor for every method. It loads the site's data file, builds the model
from the job's ``model`` block, and hands each round to the method's ClientRule."""
from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.app_common.app_constant import AppConstants

from fedpartial.algorithms.base import ClientContext, RoundInput
from fedpartial.algorithms.registry import build_rule
from fedpartial.algorithms.thresholds import HISTOGRAM_KEY
from fedpartial.data.types import SEGMENTATION
from fedpartial.flare.common import (GLOBAL_STATS, SITE_IMAGES_SEEN, SITE_METRICS, SITE_OPTIMIZER_STEPS, SITE_STATS,
                                     SITE_TRAIN_SIZE, SITE_VAL_MIN_CLASS_COUNT, build_model_from_settings,
                                     model_settings, runtime_description, runtime_version_error)
from fedpartial.flare.site_config import (MIN_COUNT, SITE_CONFIG, check_data_file, check_limits, check_resized,
                                          confined, load_site_config, offered_data_root, site_rules, training_seed)
from fedpartial.training.common import (DRAWS, STEPS, check_memory_format, load_state_numpy, place_model, select_device,
                                        state_dict_numpy)

DATA_ROOT_ENV = "FEDPARTIAL_DATA_ROOT"


def resolve_data_file(data_root: str, pattern: str, site: str) -> str:
    """``data_root`` (or $FEDPARTIAL_DATA_ROOT when empty) joined with ``pattern`` for ``site``.

    When that path does not exist and the pattern ends in ``.npz`` (the default ``{site}.npz``),
    a site folder of the same name without ``.npz`` (``<data_root>/<site>/``, see
    :mod:`fedpartial.data.sitefile`) is used instead: large sites are kept as folders of
    memory-mapped ``.npy`` files. A pattern naming a folder directly works too.

    Args:
        data_root: the dataset folder the site offers, or (development sites) the job's
            ``data_root``; empty = $FEDPARTIAL_DATA_ROOT.
        pattern: the job's ``data_file`` (``{site}`` is replaced by the site name); relative to
            ``data_root``, never climbing out of it.
        site: this site's name.

    Raises:
        ValueError: no data root is set, or the pattern is absolute or holds ``..``.
        FileNotFoundError: naming every candidate tried when none exists.
    """
    root = data_root or os.environ.get(DATA_ROOT_ENV, "")
    if not root:
        raise ValueError(f"site '{site}': no data root: set 'data_root' in the job's client config "
                         f"or the {DATA_ROOT_ENV} environment variable")
    root = os.path.expanduser(root)
    path = confined(root, pattern.format(site=site), "data_file", f"site '{site}'")
    if os.path.isfile(path) or os.path.isdir(path):
        return path
    candidates = [path]
    if path.endswith(".npz"):
        folder = path[:-len(".npz")]
        if os.path.isdir(folder):
            return folder
        candidates.append(folder + os.sep)
    raise FileNotFoundError(f"site '{site}': data file " + " or site folder ".join(f"'{c}'" for c in candidates)
                            + f" not found (data_root='{root}', data_file='{pattern}')")


def load_site_dataset(path: str, site: str, settings: dict, cache_dir: str = "", provisioned: bool = False,
                      max_resized_gib: Optional[float] = None):
    """Load and check a site file against the job's model block; resize to the job's input size.

    A site folder stays memory-mapped; when its images are not at ``input_size`` they are resized
    chunk by chunk once into a cache (reused by later rounds and runs, rebuilt when the source
    changes: :func:`fedpartial.data.sitefile.cached_resize`). An ``.npz`` is resized in memory.

    Args:
        path: the site's ``.npz`` or site folder (from :func:`resolve_data_file`).
        site: this site's name (the file must belong to it).
        settings: the job's model block (``fedpartial.flare.common.model_settings``).
        cache_dir: where a site folder's resized copy goes (default ``<folder>/cache``).
        provisioned: a provisioned site: a complete-label reference copy (``split``'s
            ``reference/``) is refused, whatever the job's ``data_file`` says.
        max_resized_gib: the site's limit on its images at the job's input size (None: none).
    """
    from fedpartial.data.sitefile import cached_resize, is_site_folder, load_site_file
    from fedpartial.data.transforms import resize_dataset

    data = load_site_file(path, expected_site=site)
    if provisioned and (data.info or {}).get("reference"):
        raise ValueError(f"site '{site}' refuses the job: '{path}' is a complete-label reference copy; they are "
                         f"read only in the simulator and the bench")
    if data.task != settings["task"]:
        raise ValueError(f"site '{site}': data file '{path}' holds {data.task} data, the job expects {settings['task']}")
    if list(data.class_names) != list(settings["class_names"]):
        raise ValueError(f"site '{site}': class names in '{path}' {list(data.class_names)} do not match the job's "
                         f"class list {list(settings['class_names'])}")
    channels = 1 if data.splits["train"].images.ndim == 3 else data.splits["train"].images.shape[-1]
    if channels != settings["in_channels"]:
        raise ValueError(f"site '{site}': images in '{path}' have {channels} channel(s), "
                         f"the job's model expects in_channels={settings['in_channels']}")
    check_input_agreement(data, path, site, settings)
    size = tuple(settings.get("input_size") or (0, 0))
    if not any(size):
        return data
    if max_resized_gib is not None:
        check_resized(sum(len(split.images) for split in data.splits.values()), size, channels, max_resized_gib,
                      f"site '{site}'", path)
    # a folder may not fit in memory: resize it once into a memory-mapped cache
    if is_site_folder(path):
        return cached_resize(data, size, path, cache_dir=cache_dir or None, keep_one_size=provisioned)
    return resize_dataset(data, size)


def check_input_agreement(data, path: str, site: str, settings: dict) -> None:
    """Refuse a site file brought to another input agreement than the job's.

    A file that records no agreement passes (it was made without one), and a job without an
    agreement makes no promise about its input.

    Args:
        data: the loaded site file (``info["input_agreement"]`` as ``import --agreement`` records it).
        path: the file, for the message.
        site: this site's name.
        settings: the job's model block (``model_settings``).

    Raises:
        ValueError: naming the site, the file and every field the two agreements set differently.
    """
    from fedpartial.data.grid import AGREEMENT_KEY, agreement_differences, agreement_from

    job = agreement_from(settings.get(AGREEMENT_KEY), f"job config model.{AGREEMENT_KEY}")
    recorded = (data.info or {}).get(AGREEMENT_KEY)
    if job is None or recorded is None:
        return
    theirs = agreement_from(recorded, f"site '{site}': data file '{path}' info '{AGREEMENT_KEY}'")
    differences = agreement_differences(theirs, job)
    if differences:
        listed = "; ".join(f"{k}: file {a!r}, job {b!r}" for k, a, b in differences)
        raise ValueError(f"site '{site}': data file '{path}' was brought to another input agreement than the job's "
                         f"model.{AGREEMENT_KEY} ({listed}); import the site's volumes again with the job's agreement "
                         f"(python -m fedpartial import nifti --agreement FILE)")


def scored_val_split(data):
    """The val split of a site's data when it has something to score, else None: no split, an
    empty one, or a classification split that annotates nothing (an unlabelled site). A
    segmentation mask always counts: an empty mask is a measurement.

    Args:
        data: the site's loaded dataset.
    """
    val = data.splits.get("val")
    if val is None or len(val) == 0:
        return None
    if data.task != SEGMENTATION and val.label_mask is not None and not np.any(val.label_mask):
        return None
    return val


class FedPartialExecutor(Executor):
    """Runs a method's client rule for the tasks ``train``, ``validate`` and ``submit_model``.

    Where the data is, is the site's decision (:mod:`fedpartial.flare.site_config`): at a
    provisioned site the job names one of the datasets the site offers in ``dataset``; ``data_root``
    and ``reference_file`` are for development sites (simulator, POC) only.

    Args:
        rule: the registered name of the method's client rule (``fedavg``, ``fedavg_seg``, ``fedlsm``,
            ``fedmlp``, ``fedirm``, ``fedia``: :mod:`fedpartial.algorithms.registry`).
        rule_args: the rule's hyperparameters.
        model: the job's model block (arch, arch_args, in_channels, class_names, task, input_size,
            normalisation); the same block configures the server's persistor.
        dataset: the name of a dataset the site offers (``local/fedpartial_site.json``); required
            at a provisioned site, unused at a development site.
        data_root: development sites only: folder holding the site files; empty =
            $FEDPARTIAL_DATA_ROOT. A provisioned site refuses a job that sets it.
        data_file: file name pattern under the dataset folder; ``{site}`` is the site name.
            Relative, without ``..``.
        reference_file: development sites only: pattern of the complete-label copy, read ONLY when
            set (diagnostics such as pseudo-label precision); method jobs leave it empty.
        device: ``auto`` (CUDA when present), ``cpu`` or ``cuda:N``.
        memory_format: ``contiguous`` (default) or ``channels_last``: the layout the model trains in
            (see ``fedpartial.training.common.place_model``; on CPU channels_last is 1.2-1.6x faster
            for the methods with affine views, but a seeded run no longer repeats a contiguous one).
        seed: base seed; each site and round derives its own (``training.common.round_seed``). A
            provisioned site draws a fresh one for each job instead (``site_config.training_seed``).
        key_metric: validation metric reported to the server for best-model selection.
        state_dir: where per-site state lives, relative to the job's run folder (absolute paths and
            ``..`` are refused); empty = ``<site workspace>/fedpartial_state/<job id>``.
        tensorboard: write per-round metrics as TensorBoard events in the site's run folder.
        analytics_writer: component id of an NVFlare analytics writer (``TBWriter``) that streams
            the same per-round scalars to the server (with ``ConvertToFedEvent`` on the site and
            ``TBAnalyticsReceiver`` on the server, every site's curves land in the server's
            ``tb_events/<site>``); "" = local files only.
        train_task_name / submit_model_task_name / validate_task_name: FLARE task names.
        runtime_version: the runtime the job was packaged for (``package-job`` writes
            :func:`fedpartial.flare.common.runtime_identity`: version and content hash); a site whose
            installed fedpartial differs refuses the job at its start, and a provisioned site refuses
            a job that names none.
    """

    def __init__(self, rule: str = "fedavg", rule_args: dict = None,
                 model: dict = None, dataset: str = "", data_root: str = "", data_file: str = "{site}.npz", reference_file: str = "",
                 device: str = "auto", seed: int = 0, key_metric: str = "auc", state_dir: str = "",
                 tensorboard: bool = True, train_task_name: str = AppConstants.TASK_TRAIN,
                 submit_model_task_name: str = AppConstants.TASK_SUBMIT_MODEL,
                 validate_task_name: str = AppConstants.TASK_VALIDATION, memory_format: str = "contiguous",
                 analytics_writer: str = "", runtime_version: str = ""):
        super().__init__()
        self.runtime_version = str(runtime_version or "")
        self.memory_format = check_memory_format(memory_format)  # at job load, not at the first task
        self.rule_path, self.rule_args = rule, dict(rule_args or {})
        self.settings = model_settings(model or {})
        self.dataset, self.data_root = str(dataset or ""), str(data_root or "")
        self.data_file, self.reference_file = str(data_file), str(reference_file or "")
        self.state_dir = str(state_dir or "")
        self.device_name, self.seed, self.key_metric = device, int(seed), key_metric
        self.tensorboard = tensorboard
        self.analytics_writer_id, self.analytics, self._analytics_failed = str(analytics_writer or ""), None, False
        self._log = self.logger.warning
        self.train_task_name, self.submit_model_task_name = train_task_name, submit_model_task_name
        self.validate_task_name = validate_task_name
        self.site = None
        self.stream_floor = 0
        self.rule = None
        self.rules = {}
        self.model = None
        self.writer = None
        self.local_weights = None
        self.ready = False
        self.setup_error = "set-up did not run"
        self.first_train_at = None  # time.time() of this job's first training task here
        self._abort_signal = None

    # ---- set-up ---------------------------------------------------------------------------
    def handle_event(self, event_type: str, fl_ctx: FLContext):
        if event_type == EventType.START_RUN:
            try:
                self._setup(fl_ctx)
            except Exception as e:  # a bad data file must stop this site with a clear message
                # No system_panic: a panicked site stops asking for tasks and the server would wait
                # for it forever. Unready, it answers every task with EXECUTION_EXCEPTION, so the
                # workflow drops it (min_clients still reachable) or stops the job clearly.
                self.setup_error = str(e)
                self.log_error(fl_ctx, f"site set-up failed: {e}")
        elif event_type == EventType.END_RUN and self.writer is not None:
            self.writer.close()

    def _setup(self, fl_ctx: FLContext):
        self.site = fl_ctx.get_identity_name()
        where = f"site '{self.site}'"
        engine = fl_ctx.get_engine()
        job_id = fl_ctx.get_job_id()
        workspace = engine.get_workspace()
        run_dir = workspace.get_run_dir(job_id)
        site_config = load_site_config(workspace.get_root_dir())
        wrong_runtime = runtime_version_error(self.runtime_version, where, required_at_site=site_config is not None)
        if wrong_runtime:
            raise ValueError(wrong_runtime)
        # every check that can refuse the job comes before anything is read or written
        cache_dir = ""
        self.rules = site_rules(site_config)
        # the analytics stream passes no result filter: a provisioned site streams a curve only
        # when at least min_count images stand behind it (its file's "min_count", default 5)
        self.stream_floor = self.rules["min_count"] if site_config is not None else 0
        if site_config is not None:
            data_root = offered_data_root(site_config, self.dataset, self.data_root, self.reference_file, where)
            check_data_file(self.data_file, where)
            # the job gate checked the job's config at deployment; these are the arguments as built
            own = [("client.executors", type(self).__name__, {"model": self.settings, "rule_args": self.rule_args})]
            check_limits(SimpleNamespace(components=own, variables={}), self.rules, where, site_config["path"])
            cache_dir = os.path.join(workspace.get_root_dir(), "fedpartial_cache", self.dataset, self.site)
        else:
            self.rules = {**self.rules, "max_rounds": float("inf"), "max_job_hours": float("inf")}
            data_root = self.data_root or os.environ.get(DATA_ROOT_ENV, "")
            self.log_warning(fl_ctx, f"{where} has no local/{SITE_CONFIG} in its kit: "
                                     f"development site, reading the job's data_root / ${DATA_ROOT_ENV} "
                                     f"('{data_root}')")
        if self.state_dir:
            state_dir = confined(run_dir, self.state_dir, "state_dir", where)
        else:
            state_dir = os.path.join(workspace.get_root_dir(), "fedpartial_state", str(job_id))
        state_dir = os.path.join(state_dir, self.site)
        data_path = resolve_data_file(data_root, self.data_file, self.site)
        reference_path = resolve_data_file(data_root, self.reference_file, self.site) if self.reference_file else ""
        rule = build_rule("client", self.rule_path, self.rule_args)
        torch.set_num_threads(max(1, int(os.environ.get("FEDPARTIAL_THREADS", torch.get_num_threads()))))
        self.device = select_device(self.device_name)
        self.data = load_site_dataset(data_path, self.site, self.settings, cache_dir, site_config is not None,
                                      self.rules["max_resized_gib"] if site_config is not None else None)
        reference = load_site_dataset(reference_path, self.site, self.settings) if reference_path else None
        os.makedirs(state_dir, exist_ok=True)
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=os.path.join(run_dir, "tb", self.site))
        if self.analytics_writer_id:
            self.analytics = engine.get_component(self.analytics_writer_id)
            if self.analytics is None or not hasattr(self.analytics, "add_scalar"):
                raise ValueError(f"analytics_writer '{self.analytics_writer_id}' is not a component of the client "
                                 f"config with add_scalar (e.g. nvflare.app_opt.tracking.tb.tb_writer.TBWriter)")
        self._log = lambda msg: self.log_warning(fl_ctx, msg)
        self.model = place_model(build_model_from_settings(self.settings), self.device, self.memory_format)
        self.rule = rule
        self._abort_signal = None
        ctx = ClientContext(site=self.site, data=self.data, device=self.device, state_dir=state_dir,
                            seed=training_seed(self.seed, site_config is not None),
                            log=lambda msg: self.log_info(fl_ctx, msg), add_scalar=self._add_rule_scalar,
                            abort=self._aborted, normalisation=self.settings["normalisation"], reference=reference)
        self.rule.setup(ctx)
        n_train = len(self.data.splits["train"])
        self.log_info(fl_ctx, f"site '{self.site}': {n_train} training images from {data_path}; rule "
                              f"{self.rule_path}; device {self.device}; state in {state_dir}; {runtime_description()}")
        self.ready = True

    def _aborted(self) -> bool:
        return bool(self._abort_signal is not None and self._abort_signal.triggered) or self._budget_spent() > 0

    def _budget_spent(self) -> float:
        """Hours this job has trained here beyond the site's ``max_job_hours`` (0 within it)."""
        if self.first_train_at is None:
            return 0.0
        hours = (time.time() - self.first_train_at) / 3600
        return max(0.0, hours - self.rules.get("max_job_hours", float("inf")))

    def _add_scalar(self, tag, value, step, stream: bool = True):
        """A scalar for TensorBoard: always in the site's own files; streamed to the server when
        ``stream`` (the caller's count check) and the job has an analytics writer."""
        if value is None or not np.isfinite(value):
            return
        if self.writer is not None:
            self.writer.add_scalar(tag, float(value), step)
        if stream and self.analytics is not None and not self._analytics_failed:
            try:
                self.analytics.add_scalar(tag, float(value), global_step=int(step))
            except Exception as e:  # the curves are a convenience: never fail a round over them
                self._analytics_failed = True
                self._log(f"streaming metrics to the server stopped: {type(e).__name__}: {e}")

    def _add_rule_scalar(self, tag, value, step):
        # a rule's own scalars come from inside a round, before anyone knows how many images it
        # drew: a provisioned site keeps them in its own files
        self._add_scalar(tag, value, step, stream=not self.stream_floor)

    # ---- tasks ----------------------------------------------------------------------------
    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        if not self.ready:
            self.log_error(fl_ctx, f"site '{self.site}' is not set up: {self.setup_error}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        self._abort_signal = abort_signal
        try:
            if task_name == self.train_task_name:
                return self._train(shareable, fl_ctx, abort_signal)
            if task_name == self.validate_task_name:
                return self._validate_task(shareable, fl_ctx)
            if task_name == self.submit_model_task_name:
                if self.local_weights is None:
                    return make_reply(ReturnCode.EMPTY_RESULT)
                return DXO(DataKind.WEIGHTS, data=self.local_weights).to_shareable()
            return make_reply(ReturnCode.TASK_UNKNOWN)
        except Exception as e:
            self.log_exception(fl_ctx, f"site '{self.site}' failed on task '{task_name}': {e}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)

    def _train(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        dxo = from_shareable(shareable)
        round_num = int(shareable.get_header(AppConstants.CURRENT_ROUND, 0))
        num_rounds = int(shareable.get_header(AppConstants.NUM_ROUNDS, 1))
        limit = self.rules.get("max_rounds", float("inf"))
        if num_rounds > limit or round_num >= limit:
            self.log_error(fl_ctx, f"site '{self.site}' refuses round {round_num} of {num_rounds}: beyond this site's "
                                   f"limit of {limit} rounds ('max_rounds' in its local/{SITE_CONFIG})")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        if self.first_train_at is None:
            self.first_train_at = time.time()
        if self._out_of_time(fl_ctx):
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        load_state_numpy(self.model, dxo.data)
        global_stats = dxo.get_meta_prop(GLOBAL_STATS) or {}
        started = time.time()
        val_metrics, histograms = self.evaluate(self.model, with_histograms=True)
        val_images = len(self.data.splits["val"]) if "val" in self.data.splits else 0
        for k, v in val_metrics.items():
            self._add_scalar(f"val/{k}", v, round_num, stream=val_images >= self.stream_floor)
        DRAWS.start()
        STEPS.start()
        try:
            result = self.rule.train_round(self.model, RoundInput(round_num, num_rounds, global_stats))
        finally:
            seen = DRAWS.stop()
            steps = STEPS.stop()
        if abort_signal.triggered:
            return make_reply(ReturnCode.TASK_ABORTED)
        if self._out_of_time(fl_ctx):  # the rule stopped mid-round: its model is not a round's
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        self.local_weights = state_dict_numpy(self.model)
        metrics = dict(result.metrics)
        metrics["train_seconds"] = time.time() - started
        for k, v in metrics.items():
            if isinstance(v, (int, float, np.floating, np.integer)):
                self._add_scalar(f"train/{k}", float(v), round_num, stream=seen >= self.stream_floor)
        self.log_info(fl_ctx, f"round {round_num + 1}/{num_rounds}: received model {self.key_metric}="
                              f"{val_metrics.get(self.key_metric, float('nan')):.4f}; "
                              + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float))))
        out = DXO(DataKind.WEIGHTS, data=self.local_weights)
        out.set_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND, int(result.num_samples))
        out.set_meta_prop(MetaKey.INITIAL_METRICS, val_metrics)
        out.set_meta_prop(SITE_STATS, result.stats)
        out.set_meta_prop(SITE_METRICS, metrics)
        out.set_meta_prop(SITE_TRAIN_SIZE, len(self.data.splits["train"]))
        # for the site's policy, which runs on this task's FLContext: never on the wire
        fl_ctx.set_prop(SITE_IMAGES_SEEN, int(seen), private=True, sticky=False)
        fl_ctx.set_prop(SITE_OPTIMIZER_STEPS, int(steps), private=True, sticky=False)
        fl_ctx.set_prop(SITE_VAL_MIN_CLASS_COUNT, self._min_count(), private=True, sticky=False)
        if histograms is not None:
            out.set_meta_prop(HISTOGRAM_KEY, histograms)
        return out.to_shareable()

    def _min_count(self) -> int:
        # the site's own k (its file's "min_count"), the default before set-up read it
        return int(self.rules.get("min_count", MIN_COUNT))

    def _out_of_time(self, fl_ctx: FLContext) -> bool:
        if self._budget_spent() <= 0:
            return False
        limit = self.rules["max_job_hours"]
        self.log_error(fl_ctx, f"site '{self.site}' stops the job: it has trained for more than this site's {limit:g} "
                               f"hours ('max_job_hours' in its local/{SITE_CONFIG})")
        return True

    def _validate_task(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        dxo = from_shareable(shareable)
        model = place_model(build_model_from_settings(self.settings), self.device, self.memory_format)
        load_state_numpy(model, dxo.data)
        metrics = self.evaluate(model)
        self.log_info(fl_ctx, f"validation of model from {shareable.get_header(AppConstants.MODEL_OWNER, '?')}: "
                              f"{self.key_metric}={metrics.get(self.key_metric, float('nan')):.4f}")
        fl_ctx.set_prop(SITE_VAL_MIN_CLASS_COUNT, self._min_count(), private=True, sticky=False)
        return DXO(DataKind.METRICS, data=metrics).to_shareable()

    def evaluate(self, model, with_histograms: bool = False):
        """Metrics of ``model`` on this site's val split, over the labels the site holds there
        (as its train split is annotated, unless the split file says ``val_labels: curated``).
        Empty where the val split annotates nothing (an unlabelled site): no score, not a 0.
        ``val_curated`` = 1 where the site's val split is a curated, completely annotated one.
        Classification is scored only over the classes with at least this site's ``min_count``
        positives and negatives there (:func:`fedpartial.evaluation.describable`): these scores
        leave the site.

        Args:
            model: the model to score.
            with_histograms: also return the per-class histograms of its probabilities over the
                annotated positives and negatives (:func:`fedpartial.algorithms.thresholds.probability_histograms`),
                what the server picks decision thresholds from; None for segmentation or without
                a val split. Both come from one prediction pass.

        Returns:
            the metrics, or ``(metrics, histograms)`` with ``with_histograms``.
        """
        from fedpartial.algorithms.thresholds import probability_histograms
        from fedpartial.evaluation import predict_split, split_metrics

        val = scored_val_split(self.data)
        metrics, histograms = {}, None
        if val is not None:
            probs = predict_split(model, val, self.data.task, self.settings["normalisation"], self.device)
            metrics = split_metrics(probs, val, self.data.task, self.data.class_names, flat=True,
                                    min_class_count=self._min_count())
            if (self.data.info or {}).get("val_labels") == "curated":
                metrics["val_curated"] = 1.0
            if with_histograms and self.data.task != SEGMENTATION:
                histograms = probability_histograms(probs, val.labels, val.label_mask)
        return (metrics, histograms) if with_histograms else metrics
