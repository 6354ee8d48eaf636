"""Site-side guards that a site's ``local/privacy.json`` applies to every job (see
provisioning/privacy.json and docs/DEPLOYMENT.md "What leaves a site").

* :class:`LocalModelGate` (a scope filter, in BOTH the task data and the task result chain): model
  weights leave the site only as the answer to a task that brought a model (a training round's
  global model); any other result holding weights is withheld unless the site shares its local model.
* :class:`fedpartial.flare.result_policy.SiteResultPolicy` (a scope result filter): every key of every
  result is on an allow-list, and counts from fewer than ``min_count`` samples are withheld.
* :class:`FedEventGuard` (a privacy.json component): only allowed federated events leave the site,
  and of the analytics events (TensorBoard curves) only scalars whose tag is on the site's list.
* :class:`UpdateMask` (a scope filter a site may add, in BOTH chains, last): each weight's update
  leaves rescaled by the site's secret factor, so a lead who makes every update about +-k x lr cannot
  read a site's signs from a weighted average (docs/DEPLOYMENT.md §6). Append
  :data:`UPDATE_MASK_FILTER` to both chains of the default scope::

    {"path": "fedpartial.flare.site_policy.UpdateMask", "args": {"spread": 1.0}}

FLARE's scope filters see task data and task results only; analytics travel as federated events
(``ConvertToFedEvent`` -> ``ClientFedEventRunner`` -> aux message), which no filter sees. A
privacy.json component is added to every job's run after the job's own components and before
FLARE's ``ClientFedEventRunner`` widget, so it sees each outgoing federated event first; it stops one
by marking it as not outgoing (the runner sends only events whose direction header is ``out``).

The shipped policy has one scope, ``default``, which every job gets. A site that agrees to send its
locally trained model (cross-site evaluation of site models) adds a scope of its own to its
``local/privacy.json``; a job then asks for it with ``"scope": "share_local_model"`` in its
``meta.json`` (a job naming a scope the site lacks is refused)::

    {"name": "share_local_model",
     "task_data_filters": [
       {"path": "fedpartial.flare.site_policy.LocalModelGate", "args": {"share_local_model": true}}],
     "task_result_filters": [
       {"path": "fedpartial.flare.site_policy.LocalModelGate", "args": {"share_local_model": true}},
       {"path": "fedpartial.flare.result_policy.SiteResultPolicy", "args": {"min_count": 5}}]}
"""
from __future__ import annotations

import fnmatch
import numbers
from typing import Dict, List, Optional

import numpy as np
from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE, AnalyticsDataType, TrackConst
from nvflare.apis.dxo import DXO, DataKind, from_dict, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.filter import Filter
from nvflare.app_common.app_constant import AppConstants
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import EventScope, FedEventHeader, FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReservedHeaderKey, Shareable, make_reply

#: the direction header value that keeps an event on the site (anything but "out" is not sent)
WITHHELD = "withheld_by_site_policy"
#: fl_ctx property the gate's task-data half leaves for its result half: ``{"task_id", "model"}``
TASK_RECEIVED_MODEL = "fedpartial.task_received_model"
#: DXO kinds that are model weights by their kind alone
WEIGHT_KINDS = (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF, DataKind.FL_MODEL)


def holds_arrays(value) -> bool:
    """Whether ``value`` (DXO data, recursively) holds anything that can carry weights: an array or
    tensor with at least one dimension, a non-empty list / tuple, or raw bytes. Scalars do not.

    Args:
        value: a DXO's data or part of it.
    """
    if isinstance(value, dict):
        return any(holds_arrays(v) for v in value.values())
    if isinstance(value, (bytes, bytearray, memoryview)):
        return True
    if isinstance(value, (list, tuple)):
        return len(value) > 0
    shape = getattr(value, "shape", None)
    if shape is not None:
        return len(tuple(shape)) > 0
    return not (value is None or isinstance(value, (numbers.Number, str, np.generic)))


def carries_weights(dxo: DXO) -> bool:
    """Whether a DXO carries model weights: kind WEIGHTS / WEIGHT_DIFF / FL_MODEL with data, a
    COLLECTION holding such a DXO, or any DXO whose data holds arrays (:func:`holds_arrays`).

    Args:
        dxo: the DXO of a task's data or result.
    """
    data = dxo.data or {}
    if dxo.data_kind in WEIGHT_KINDS and data:
        return True
    if dxo.data_kind == DataKind.COLLECTION:
        for item in data.values():
            if isinstance(item, DXO) and carries_weights(item):
                return True
            if isinstance(item, dict):
                try:
                    if carries_weights(from_dict(item)):
                        return True
                except Exception:  # not an encoded DXO: judged by its content below
                    pass
    return holds_arrays(data)


def shareable_carries_weights(shareable: Shareable) -> bool:
    """:func:`carries_weights` of a task's data or result; a Shareable that is no DXO is judged by
    its content outside the headers (:func:`holds_arrays`).

    Args:
        shareable: task data or task result.
    """
    try:
        dxo = from_shareable(shareable)
    except Exception:  # e.g. the submit_model request: headers only
        return holds_arrays({k: v for k, v in shareable.items() if k != ReservedHeaderKey.HEADERS})
    return carries_weights(dxo)


class LocalModelGate(Filter):
    """Scope filter: model weights leave the site only as the answer to a task whose incoming data
    brought a model to train on (a training round's global model); the answer to a model sent for
    validation (it carries the ``MODEL_OWNER`` header of cross-site evaluation, whatever the task is
    called) and any other result that
    carries weights (:func:`carries_weights`: the ``submit_model`` answer under whatever task name a
    job gives it) is answered with EMPTY_RESULT unless the site shares its local model.

    The decision is by content, never by task name, so list the class in BOTH chains of the scope:
    ``task_data_filters`` (remembers, in the task's FLContext, whether this task brought a model)
    and ``task_result_filters`` (decides). FLARE's client runner passes one FLContext through the
    data filters, the executor and the result filters of a task, and a new one to the next task.
    Without the data-filter half every result carrying weights is withheld.

    Args:
        share_local_model: False (default): weights leave only as the answer to a task that
            brought a model. True: any result may carry weights.
    """

    def __init__(self, share_local_model: bool = False):
        super().__init__()
        if not isinstance(share_local_model, bool):
            raise ValueError(f"LocalModelGate share_local_model must be true or false, got {share_local_model!r}")
        self.share_local_model = share_local_model

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        task_id = fl_ctx.get_prop(FLContextKey.TASK_ID)
        if str(fl_ctx.get_prop(FLContextKey.FILTER_DIRECTION, "")).lower() == "in":
            model = shareable_carries_weights(shareable)
            # a model sent for cross-site validation names its owner; whatever task name the job gives
            # that request, the answer is a score, never this site's weights
            validation = shareable.get_header(AppConstants.MODEL_OWNER) is not None
            fl_ctx.set_prop(TASK_RECEIVED_MODEL, {"task_id": task_id, "model": model, "validation": validation},
                            private=True, sticky=False)
            return shareable
        if self.share_local_model or not shareable_carries_weights(shareable):
            return shareable
        received = fl_ctx.get_prop(TASK_RECEIVED_MODEL)
        if (isinstance(received, dict) and received.get("task_id") == task_id and received.get("model") is True
                and received.get("validation") is False):
            return shareable
        site = fl_ctx.get_identity_name() or "?"
        task = fl_ctx.get_prop(FLContextKey.TASK_NAME, "?")
        if not isinstance(received, dict):
            self.log_error(fl_ctx, f"site '{site}': the result of task '{task}' carries model weights and is withheld: "
                                   f"LocalModelGate is not in this scope's task_data_filters, so no task is known "
                                   f"to have brought a model")
        else:
            why = ("the task asked to validate a model" if received.get("validation") else "the task brought no model")
            self.log_info(fl_ctx, f"site '{site}': the result of task '{task}' withheld: it carries model weights "
                                  f"but {why}, and this site does not share its local model")
        return make_reply(ReturnCode.EMPTY_RESULT)


#: the entry a site appends to both chains of its privacy.json scope to mask its updates
UPDATE_MASK_FILTER = {"path": "fedpartial.flare.site_policy.UpdateMask", "args": {"spread": 1.0}}
#: fl_ctx property the mask's task-data half leaves for its result half: ``{"task_id", "weights"}``
TASK_RECEIVED_WEIGHTS = "fedpartial.task_received_weights"


class UpdateMask(Filter):
    """Scope filter: each weight's update leaves the site rescaled by a factor drawn from the site's
    secret and the model the job's first update was trained from (:mod:`fedpartial.algorithms.update_mask`):
    the same in every round of a job and in every job from the same round-0 model.

    List it in BOTH chains of the scope, after the other filters: ``task_data_filters`` remembers the
    global model a training task brought, ``task_result_filters`` sends ``received + factors x
    (local - received)`` (a WEIGHT_DIFF result: ``factors x diff``). A result carrying weights that
    no remembered model matches, or a job's first one without its task's model, is withheld, never
    sent unmasked.

    Args:
        spread: the factors are uniform in ``[1 - spread, 1 + spread]``; in [0, 1].
        key_file: the secret's file, relative to the kit's folder: by default the site's private key
            (``startup/client.key``), which never leaves the site.
    """

    #: (job id, site) -> model_digest of the model the job's first weights result at the site trained
    #: from. Shared by the instances of both chains (each chain builds its own); kept for the
    #: process's life, so a job process that restarts ties its factors to the model it trains from then.
    first_model: Dict[tuple, bytes] = {}

    def __init__(self, spread: float = 1.0, key_file: str = "startup/client.key"):
        super().__init__()
        if isinstance(spread, bool) or not isinstance(spread, numbers.Real) or not 0.0 <= float(spread) <= 1.0:
            raise ValueError(f"UpdateMask spread must be a number in [0, 1], got {spread!r}")
        if not isinstance(key_file, str) or not key_file:
            raise ValueError(f"UpdateMask key_file must be a path relative to the kit, got {key_file!r}")
        self.spread, self.key_file = float(spread), key_file

    def _key(self, fl_ctx: FLContext) -> bytes:
        from fedpartial.flare.site_config import confined

        root = fl_ctx.get_engine().get_workspace().get_root_dir()
        path = confined(root, self.key_file, "key_file", "the site's UpdateMask")
        with open(path, "rb") as f:
            key = f.read()
        if not key:
            raise ValueError(f"UpdateMask key file '{path}' is empty")
        return key

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        from fedpartial.algorithms.update_mask import masked_diff, masked_weights, model_digest

        task_id = fl_ctx.get_prop(FLContextKey.TASK_ID)
        if str(fl_ctx.get_prop(FLContextKey.FILTER_DIRECTION, "")).lower() == "in":
            try:
                dxo = from_shareable(shareable)
            except Exception:  # not a DXO: the task brought no model
                return shareable
            if dxo.data_kind == DataKind.WEIGHTS and isinstance(dxo.data, dict):
                fl_ctx.set_prop(TASK_RECEIVED_WEIGHTS, {"task_id": task_id, "weights": dict(dxo.data)},
                                private=True, sticky=False)
            return shareable
        if not shareable_carries_weights(shareable):
            return shareable
        site = fl_ctx.get_identity_name() or "?"
        job = (str(fl_ctx.get_job_id()), site)
        try:
            dxo = from_shareable(shareable)
            key = self._key(fl_ctx)
            received = fl_ctx.get_prop(TASK_RECEIVED_WEIGHTS)
            brought = isinstance(received, dict) and received.get("task_id") == task_id
            if job not in self.first_model:
                # the model the job's first weights result trained from, not the first model any task
                # brought: a task that returns no weights cannot pick the factors of later ones
                if not brought:
                    raise ValueError("the job's first weights result comes from a task that brought no model to "
                                     "tie the factors to (is UpdateMask in this scope's task_data_filters?)")
                self.first_model[job] = model_digest(received["weights"])
            start = self.first_model[job]
            if dxo.data_kind == DataKind.WEIGHT_DIFF:
                dxo.data = masked_diff(dxo.data, key, self.spread, start)
            else:
                if dxo.data_kind != DataKind.WEIGHTS or not brought:
                    raise ValueError(f"a {dxo.data_kind} result of a task that brought no global model to mask "
                                     f"against (is UpdateMask in this scope's task_data_filters?)")
                dxo.data = masked_weights(received["weights"], dxo.data, key, self.spread, start)
        except Exception as e:
            self.log_error(fl_ctx, f"site '{site}': result withheld, the update mask could not be applied: {e}")
            return make_reply(ReturnCode.EMPTY_RESULT)
        return dxo.update_shareable(shareable)


class FedEventGuard(FLComponent):
    """privacy.json component: lets out only the federated events the site allows.

    Args:
        allowed_events: event types (after the ``fed.`` prefix is added) that may leave, e.g.
            ``["fed.analytix_log_stats"]``; every other outgoing event is withheld.
        allowed_tags: for analytics events: the scalar tags that may leave; ``fnmatch`` patterns
            (``val/*``) are allowed. Non-scalar analytics (images, text, ...) never leave.
        analytics_event: the analytics event type (FLARE's ``analytix_log_stats`` + prefix).
    """

    def __init__(self, allowed_events: Optional[List[str]] = None, allowed_tags: Optional[List[str]] = None,
                 analytics_event: str = "fed." + ANALYTIC_EVENT_TYPE):
        super().__init__()
        for name, value in (("allowed_events", allowed_events), ("allowed_tags", allowed_tags)):
            if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
                raise ValueError(f"FedEventGuard {name} must be a list of strings, got {value!r}")
        self.allowed_events = list(allowed_events or [])
        self.allowed_tags = list(allowed_tags or [])
        self.analytics_event = analytics_event
        self.withheld = {}  # (event, tag) -> times, for one log line per new kind

    def allows(self, event_type: str, data: Shareable) -> tuple:
        """``(allowed, tag)`` for an outgoing federated event."""
        if event_type not in self.allowed_events:
            return False, ""
        if event_type != self.analytics_event:
            return True, ""
        try:
            dxo = from_shareable(data)
            tag = str(dxo.data.get(TrackConst.TRACK_KEY, ""))
            kind = dxo.get_meta_prop(TrackConst.DATA_TYPE_KEY)
        except Exception:
            return False, "?"
        kind = getattr(kind, "value", kind)
        if kind != AnalyticsDataType.SCALAR.value:
            return False, tag
        return any(fnmatch.fnmatchcase(tag, p) for p in self.allowed_tags), tag

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        if event_type in (EventType.START_RUN, EventType.END_RUN):
            return
        if fl_ctx.get_prop(FLContextKey.EVENT_SCOPE, EventScope.LOCAL) != EventScope.FEDERATION:
            return
        data = fl_ctx.get_prop(FLContextKey.EVENT_DATA, None)
        if not isinstance(data, Shareable) or data.get_header(FedEventHeader.DIRECTION, "out") != "out":
            return  # incoming events (server -> site) and events already withheld
        ok, tag = self.allows(event_type, data)
        if ok:
            return
        data.set_header(FedEventHeader.DIRECTION, WITHHELD)
        key = (event_type, tag)
        self.withheld[key] = self.withheld.get(key, 0) + 1
        if self.withheld[key] == 1:
            what = f"analytics '{tag}'" if tag else "event"
            self.log_info(fl_ctx, f"{what} ({event_type}) withheld: not on this site's allow-list")
