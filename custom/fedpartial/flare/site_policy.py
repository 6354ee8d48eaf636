"""Site-side guards that a site's ``local/privacy.json`` applies to every job (see
provisioning/privacy.json and docs/DEPLOYMENT.md "What leaves a site").

* :class:`LocalModelGate` (a scope result filter): a site's locally trained model goes to the server
  (and from there to its peers for cross-site evaluation) only when the site allows it.
* :class:`FedEventGuard` (a privacy.json component): only allowed federated events leave the site,
  and of the analytics events (TensorBoard curves) only scalars whose tag is on the site's list.

FLARE's scope filters see task data and task results only; analytics travel as federated events
(``ConvertToFedEvent`` -> ``ClientFedEventRunner`` -> aux message), which no filter sees. A
privacy.json component is added to every job's run after the job's own components and before
FLARE's ``ClientFedEventRunner`` widget, so it sees each outgoing federated event first; it stops one
by marking it as not outgoing (the runner sends only events whose direction header is ``out``).
"""
from __future__ import annotations

import fnmatch
from typing import List, Optional

from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE, AnalyticsDataType, TrackConst
from nvflare.apis.dxo import from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.filter import Filter
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import EventScope, FedEventHeader, FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.app_common.app_constant import AppConstants

#: the direction header value that keeps an event on the site (anything but "out" is not sent)
WITHHELD = "withheld_by_site_policy"


class LocalModelGate(Filter):
    """Scope result filter: answers the ``submit_model`` task (the local model for cross-site
    evaluation) with EMPTY_RESULT unless the site shares its local model. Other tasks pass.

    Args:
        share_local_model: False (default): the local model never leaves the site.
        submit_model_task: the task name of the local-model request.
    """

    def __init__(self, share_local_model: bool = False, submit_model_task: str = AppConstants.TASK_SUBMIT_MODEL):
        super().__init__()
        if not isinstance(share_local_model, bool):
            raise ValueError(f"LocalModelGate share_local_model must be true or false, got {share_local_model!r}")
        self.share_local_model = share_local_model
        self.submit_model_task = submit_model_task

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        task = fl_ctx.get_prop(FLContextKey.TASK_NAME, "")
        if task != self.submit_model_task or self.share_local_model:
            return shareable
        self.log_info(fl_ctx, f"local model withheld: this site's policy does not share it (task '{task}')")
        return make_reply(ReturnCode.EMPTY_RESULT)


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
