"""FLARE 2.9 logs two harmless races as ERROR; this filter writes them as WARNING, with a pointer
to docs/FAILURE_BEHAVIOUR.md, so that monitoring that alerts on ERROR (and ``error_log.txt``) sees
only real errors. ``fedpartial-site start`` puts it into the kit's ``local/log_config.json``.

Both follow an admin's job query (``nvflare system status``, ``show_stats``: ``get_run_info`` to
the job's own process) that reaches a job whose process is starting or has just ended, while the
job store still says RUNNING:

* the job's server process answers before its engine is attached (its first seconds):
  ``blob_cb threw: 'NoneType' object has no attribute 'get_widget'`` (the traceback ends in
  ``server_commands.py``) and ``Stream error: blob_cb threw AttributeError: ...``, in the job's log;
* the job's process has not connected yet or has already ended: ``cannot send to 'server.<job
  id>': target_unreachable`` (sub-topic ``get_run_info``), in the server's log.

The query gets no answer for that job; the job itself is untouched. Any other message of these
loggers, and the same message in another context, keeps its level.
"""
from __future__ import annotations

import logging
import re

NOTE = " [fedpartial: a known FLARE race of an admin's job query, harmless: docs/FAILURE_BEHAVIOUR.md]"
#: logger name -> what its ERROR message must match to be one of the known races
KNOWN = {
    "nvflare.fuel.f3.streaming.blob_streamer":
        re.compile(r"blob_cb threw: 'NoneType' object has no attribute 'get_widget'\n.*server_commands\.py", re.S),
    "nvflare.fuel.f3.streaming.byte_receiver":
        re.compile(r"Stream error: blob_cb threw AttributeError: 'NoneType' object has no attribute 'get_widget'$"),
    "nvflare.fuel.f3.cellnet.core_cell.CoreCell":
        re.compile(r"STP=get_run_info\b.*cannot send to '[^']+': target_unreachable$", re.S),
}
#: the loggers the kit's log configuration attaches the filter to
LOGGERS = tuple(KNOWN)


class KnownRaces(logging.Filter):
    """Attached to the loggers of :data:`KNOWN`: their known-race ERROR records become WARNING."""

    def filter(self, record: logging.LogRecord) -> bool:
        pattern = KNOWN.get(record.name)
        if record.levelno == logging.ERROR and pattern is not None and pattern.search(record.getMessage()):
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
            if not record.args and isinstance(record.msg, str):  # the note on the first line, before a traceback
                first, newline, rest = record.msg.partition("\n")
                record.msg = f"{first}{NOTE}{newline}{rest}"
        return True


def with_known_races(config: dict) -> dict:
    """A FLARE log configuration (``dictConfig``) with :class:`KnownRaces` on its loggers; a logger
    the configuration already names keeps its settings."""
    out = dict(config)
    out["filters"] = dict(out.get("filters") or {}, fedpartial_known_races={"()": f"{__name__}.KnownRaces"})
    loggers = dict(out.get("loggers") or {})
    for name in LOGGERS:
        entry = dict(loggers.get(name) or {})
        entry["filters"] = sorted(set(entry.get("filters") or []) | {"fedpartial_known_races"})
        loggers[name] = entry
    out["loggers"] = loggers
    return out
