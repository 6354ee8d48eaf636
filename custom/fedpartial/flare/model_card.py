"""The model card written beside a job's result models: ``model_card.md`` and ``model_card.json``
in the server's run folder (next to ``global_model.pt``).

It says what the models are and how far to trust them, from what the server holds: the method and
its settings (and which depart from the method's defaults), the rounds and sites, each site's
census as the server saw it (what the site policy withheld shown as withheld), the validation of
every round, the decision thresholds stored in the model files, the runtime, and the method's
intended use and known limits as measured in docs/RESULTS.md. ``python -m fedpartial evaluate``
appends its test metrics (:func:`append_evaluation`).

Plain functions over files; :class:`fedpartial.flare.persistor.FedPartialPersistor` calls
:func:`write_model_card` at the end of the run. The JSON is the card; the Markdown is rendered from it.
"""
from __future__ import annotations

import datetime
import inspect
import json
import os
import re
from typing import Dict, List, Optional, Sequence

from fedpartial.flare.common import atomic_write_json, jsonable

CARD_MD = "model_card.md"
CARD_JSON = "model_card.json"
FORMAT = "fedpartial-model-card/1"
EXECUTOR_PATH = "fedpartial.flare.executors.FedPartialExecutor"
AGGREGATOR_PATH = "fedpartial.flare.aggregators.RuleAggregator"

#: Intended use and known limits of each registered method. The limits say what kind of limit was
#: measured and name where (``source``: README's "Results" from the committed rows, and the
#: docs/RESULTS.md sections of what is not yet in committed rows and of the readings);
#: the numbers stay in those committed rows, never here, so a re-measurement cannot leave the card behind.
METHOD_NOTES: Dict[str, Dict[str, str]] = {
    "fedavg": {
        "intended_use": "Baseline: FedAvg on the labels each site holds; the reference a partial-label method "
                        "must beat on the same model, recipe, steps and site weights (--matched-to).",
        "known_limits": "It does not learn a class from the sites that do not annotate it: in the README suites it "
                        "ends below FedAvg on full labels. Measured values: see source.",
        "source": "README.md#results (column FedAvg (partial))"},
    "fedavg_seg": {
        "intended_use": "Segmentation baseline: FedAvg on the (incomplete) masks each site holds; the reference "
                        "for FedIA.",
        "known_limits": "Missed lesions are learnt as background (below FedAvg on complete masks on DSB2018); on "
                        "six real MS patients held out in turn, what decides a held-out patient is the patient, "
                        "not the completeness of the training masks. Measured values: see source.",
        "source": "README.md#results (rows fedia-dsb-*, group ms6); "
                  "docs/SMALL_LESIONS.md#six-patients-two-sources-leave-one-out-bench-suites-ms6"},
    "fedlsm": {
        "intended_use": "Single- or multi-label classification where each site annotates a different subset of "
                        "the classes (label-set mismatch).",
        "known_limits": "Whether it beats FedAvg depends on the data: measured on HAM10000 and NIH ChestX-ray14 "
                        "with different outcomes. Compare it with FedAvg matched to it in recipe, steps and site "
                        "weights (--matched-to) on your data before relying on it. Measured values: see source.",
        "source": "README.md#results (rows fedlsm-ham, fedlsm-nih); docs/RESULTS.md#reading-the-results"},
    "fedmlp": {
        "intended_use": "Multi-label classification where each site lacks the labels of some classes.",
        "known_limits": "Above FedAvg only where its premise holds (frequent positives that other sites train as "
                        "negatives, synthetic shapes); on CT-ICH and ChestX-ray14 not above FedAvg. Measured "
                        "values: see source.",
        "source": "README.md#results (rows fedmlp-ctich, fedmlp-nih, fedmlp-premise); "
                  "docs/RESULTS.md#fedmlp-premise-under-the-committed-rows-protocol-committed-rows"},
    "fedirm": {
        "intended_use": "Semi-supervised federations: a few labelled sites, the others unlabelled.",
        "known_limits": "On HAM10000, FedAvg with FedIRM's recipe on the labelled sites reached what FedIRM did: "
                        "the unlabelled sites added nothing measurable. Measured values: see source.",
        "source": "README.md#results (rows fedirm-ham, fedirm-ham-1l); "
                  "docs/RESULTS.md#fedirm-where-the-labelled-sites-cannot-learn-alone"},
    "fedia": {
        "intended_use": "Segmentation where sites leave whole lesions unannotated (incomplete masks).",
        "known_limits": "On DSB2018 nuclei it helped where much of the annotation is missing and not where masks "
                        "are nearly complete; on six real MS patients held out in turn it was below FedAvg on half "
                        "of them: it can be worse than FedAvg. Measured values: see source.",
        "source": "README.md#results (rows fedia-dsb-m0 ... m3, group ms6); "
                  "docs/SMALL_LESIONS.md#six-patients-two-sources-leave-one-out-bench-suites-ms6"},
}
WITHHELD = "withheld"


# ---------------------------------------------------------------------------------------------
# pieces of the card
# ---------------------------------------------------------------------------------------------
def constructor_defaults(cls) -> Dict:
    """``{argument: default}`` of ``cls.__init__`` (None where there is none)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name: None if p.default is p.empty else p.default for p in params
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def rule_settings(side: str, rule: str, args: Optional[dict]) -> Dict:
    """A rule's effective settings and those that depart from the method's defaults.

    Args:
        side: ``client`` or ``server``.
        rule: the registered rule name (:mod:`fedpartial.algorithms.registry`).
        args: the job's ``rule_args`` for that side.

    Returns:
        ``{"rule", "class", "settings": {name: value}, "departures": {name: {"value", "default"}}}``.
    """
    from fedpartial.algorithms.registry import rule_class, rule_path

    defaults = jsonable(constructor_defaults(rule_class(side, rule)))
    given = jsonable(dict(args or {}))
    departures = {k: {"value": v, "default": defaults.get(k)} for k, v in sorted(given.items())
                  if k not in defaults or v != defaults[k]}
    return {"rule": rule, "class": rule_path(side, rule), "settings": {**defaults, **given}, "departures": departures}


def _resolve(value, config: dict):
    """A ``"{name}"`` placeholder of a FLARE config replaced by the config's top-level ``name``."""
    if isinstance(value, str):
        m = re.fullmatch(r"\{(\w+)\}", value)
        if m and m.group(1) in config:
            return config[m.group(1)]
    return value


def _component_args(config: dict, path: str) -> Optional[dict]:
    """The args of the first component / executor / workflow of ``config`` with class ``path``."""
    entries = list(config.get("components", [])) + list(config.get("workflows", []))
    entries += [e.get("executor", {}) for e in config.get("executors", [])]
    for entry in entries:
        if entry.get("path") == path:
            return {k: _resolve(v, config) for k, v in (entry.get("args") or {}).items()}
    return None


def _load_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def method_section(rule: str, rule_args: Optional[dict], client_config: Optional[dict]) -> Dict:
    """The method: the aggregator's rule and settings, and the sites' rule and settings as the job's
    client config (deployed to the server's app folder too) gives them.

    Args:
        rule: the aggregator's registered rule name (None = the job has no ``RuleAggregator``).
        rule_args: the aggregator's ``rule_args``.
        client_config: ``config_fed_client.json`` of the job's app (None = not in the server's app, or
            the sites ran another app).
    """
    out = {"rule": rule, "server": rule_settings("server", rule, rule_args) if rule else None, "client": None,
           "client_note": "the sites' settings are unknown: the server's app is not the one the sites ran"}
    executor = _component_args(client_config, EXECUTOR_PATH) if client_config else None
    if executor is not None:
        client_rule = executor.get("rule", "fedavg")
        out["client"] = rule_settings("client", client_rule, executor.get("rule_args"))
        out["client_note"] = "" if client_rule == rule else f"the sites run '{client_rule}', the server '{rule}'"
        out["rule"] = rule or client_rule
        out["key_metric"] = executor.get("key_metric", "")
    return out


def weighting_section(aggregator_args: Optional[dict]) -> Optional[Dict]:
    """How the server combined the sites' updates: the ``RuleAggregator``'s weighting arguments, with
    those that depart from the shipped defaults (a reader of ``metrics.json``'s ``server.weights``
    must know whether they were applied: ``median`` / ``trimmed_mean`` combine unweighted).

    Args:
        aggregator_args: the aggregator's arguments in the job's server config (None = no ``RuleAggregator``).
    """
    from fedpartial.flare.site_config import AGGREGATOR_WEIGHTING

    if aggregator_args is None:
        return None
    settings = {k: aggregator_args.get(k, default) for k, default in AGGREGATOR_WEIGHTING.items()}
    return {"settings": settings,
            "departures": {k: {"value": v, "default": AGGREGATOR_WEIGHTING[k]}
                           for k, v in settings.items() if v != AGGREGATOR_WEIGHTING[k]}}


def training_section(rounds: List[dict]) -> Dict:
    """Rounds run (0-based, as the model files' ``round``) and the sites whose updates were aggregated.

    Args:
        rounds: ``metrics.json``'s ``rounds``.
    """
    sites = sorted({s for r in rounds for s in r.get("sites", {})})
    return {"rounds_run": len(rounds), "rounds": [r.get("round") for r in rounds], "sites": sites,
            "sites_per_round": {str(r.get("round")): sorted(r.get("sites", {})) for r in rounds},
            "rejected": {str(r.get("round")): r.get("rejected") for r in rounds if r.get("rejected")}}


def census_section(rounds: List[dict], class_names: List[str]) -> Dict:
    """Each site as the server saw it: train size, sample count per round, aggregation weight,
    validation images per class; what the site policy withheld is ``"withheld"``.

    A train size below the policy's minimum count is removed at the site, a sample count below it
    is sent as 0, and a class's validation histograms with fewer than that many positives or
    negatives leave as zero rows (also what a class the site does not annotate sends).

    Args:
        rounds: ``metrics.json``'s ``rounds``.
        class_names: the job's classes (classification; [] for segmentation).
    """
    out = {}
    last_trust = ((rounds[-1].get("server") or {}).get("trust") or {}) if rounds else {}
    sizes = last_trust.get("train_sizes") or {}
    for site in sorted({s for r in rounds for s in r.get("sites", {})} | {s for r in rounds
                                                                           for s in (r.get("rejected") or {})}):
        samples, weights, rejected, val_counts = {}, {}, {}, None
        for r in rounds:
            key = str(r.get("round"))
            entry = (r.get("sites") or {}).get(site)
            if entry is not None:
                samples[key] = entry.get("num_samples")
                weight = ((r.get("server") or {}).get("weights") or {}).get(site)
                if weight is not None:
                    weights[key] = weight
                if entry.get("val_counts"):
                    val_counts = entry["val_counts"]
            if site in (r.get("rejected") or {}):
                rejected[key] = r["rejected"][site]
        val = None
        if val_counts is not None and class_names:
            val = {}
            for c, name in enumerate(class_names):
                pos, neg = int(val_counts["pos"][c]), int(val_counts["neg"][c])
                val[name] = {"pos": pos, "neg": neg} if pos or neg else WITHHELD
        # a site with no accepted update never reported one; one without a size had it withheld
        size = sizes.get(site, WITHHELD if samples else None)
        out[site] = {"train_size": size, "samples": samples, "weights": weights,
                     "zero_sample_rounds": [k for k, v in samples.items() if v == 0], "rejected": rejected,
                     "val_images": val}
    return out


def validation_section(rounds: List[dict], key_metric: str) -> Dict:
    """Per round: each site's ``key_metric`` on its val split for the global model it received
    (the model of the round before), and the pooled value: the Dice pooled over every site's val
    pixels for segmentation (``server.val_received_model``), else the mean over the sites (what
    ``IntimeModelSelector`` compares to pick the best model).

    Args:
        rounds: ``metrics.json``'s ``rounds``.
        key_metric: the job's key metric.
    """
    rows = []
    for r in rounds:
        rnd = int(r.get("round", 0))
        per_site = {s: (e.get("val") or {}).get(key_metric) for s, e in sorted((r.get("sites") or {}).items())}
        pooled_seg = (r.get("server") or {}).get("val_received_model")
        if pooled_seg:
            pooled, how = pooled_seg.get("dice_pooled"), "Dice pooled over every site's val pixels"
        else:
            values = [float(v) for v in per_site.values() if isinstance(v, (int, float))]
            pooled, how = (sum(values) / len(values) if values else None), "mean over sites"
        rows.append({"round": rnd, "model": "initial" if rnd == 0 else f"round {rnd - 1}", "sites": per_site,
                     "pooled": pooled, "pooled_how": how})
    curated = sorted({s for r in rounds for s, e in (r.get("sites") or {}).items()
                      if (e.get("val") or {}).get("val_curated") == 1})
    reporting = sorted({s for row in rows for s, v in row["sites"].items() if isinstance(v, (int, float))})
    labels = ("each site's val split, scored on the labels the site holds there (annotated as its train split)"
              + (f"; complete (curated) val labels at {', '.join(curated)}" if curated else "")
              + f"; sites that reported a score: {', '.join(reporting) or 'none'} (a site whose val split "
                "annotates nothing reports none)")
    return {"key_metric": key_metric, "labels": labels, "curated_sites": curated, "rounds": rows}


def model_files_section(run_dir: str, names: Sequence[str]) -> Dict:
    """The model files ``names`` of the run folder (those present): their round and decision thresholds."""
    from fedpartial.models.io import read_model_file

    out = {}
    for name in names:
        path = os.path.join(run_dir, name)
        if not os.path.isfile(path):
            continue
        meta = read_model_file(path)["meta"]
        out[name] = {"round": meta.get("round"), "decision_thresholds": meta.get("decision_thresholds")}
    return out


def build_card(run_dir: str, rule: Optional[str], rule_args: Optional[dict], model: Optional[dict],
               client_config: Optional[dict] = None, job_id: str = "", num_rounds: Optional[int] = None,
               global_file: str = "global_model.pt", best_file: str = "best_global_model.pt",
               aggregator_args: Optional[dict] = None) -> Dict:
    """The model card of the run in ``run_dir`` (a dict; :func:`render_markdown` prints it).

    Args:
        run_dir: the server's run folder (the model files, ``metrics.json``).
        rule: the aggregator's registered rule name.
        rule_args: the aggregator's ``rule_args``.
        model: the job's model block (``fedpartial.flare.common.model_settings``), None = read it from
            the global model file.
        client_config: the job's ``config_fed_client.json`` (None = unknown).
        job_id: the job's id.
        num_rounds: the rounds the job asked for (None = unknown).
        global_file / best_file: the persistor's file names of the last and the best global model.
        aggregator_args: the ``RuleAggregator``'s arguments (its weighting; None = unknown).
    """
    from fedpartial.data.types import SEGMENTATION
    from fedpartial.flare.aggregators import METRICS_FILE
    from fedpartial.flare.common import runtime_identity

    rounds = (_load_json(os.path.join(run_dir, METRICS_FILE)) or {}).get("rounds", [])
    files = model_files_section(run_dir, (global_file, best_file))
    if model is None and global_file in files:
        from fedpartial.models.io import read_model_file

        payload = read_model_file(os.path.join(run_dir, global_file))
        model = {**payload["meta"], "arch": payload["spec"]["arch"], "arch_args": payload["spec"]["arch_args"]}
    model = dict(model or {})
    task = model.get("task", "")
    classes = [] if task == SEGMENTATION else list(model.get("class_names", []))
    method = {**method_section(rule, rule_args, client_config), "weighting": weighting_section(aggregator_args)}
    key_metric = method.get("key_metric") or ("dice_pooled" if task == SEGMENTATION else "auc")
    identity = runtime_identity()
    version, _, digest = identity.partition("+")
    card = {
        "format": FORMAT, "job_id": job_id,
        "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {k: model.get(k) for k in ("arch", "arch_args", "task", "class_names", "input_size",
                                            "normalisation", "input_agreement") if k in model},
        "result_model": best_file if task == SEGMENTATION and best_file in files else global_file,
        "method": method,
        "training": {**training_section(rounds), "rounds_asked": num_rounds},
        "census": census_section(rounds, classes),
        "validation": validation_section(rounds, key_metric),
        "models": files,
        "runtime": {"identity": identity, "version": version, "hash": digest},
        "intended_use": METHOD_NOTES.get(method["rule"], {}).get("intended_use", "not stated for this method"),
        "known_limits": METHOD_NOTES.get(method["rule"], {}).get("known_limits", "not stated for this method"),
        "notes_source": METHOD_NOTES.get(method["rule"], {}).get("source", ""),
        "evaluations": [],
    }
    return jsonable(card)


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------
def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def _table(head: List[str], rows: List[List]) -> List[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def _departures(departures: Dict[str, dict], none: str) -> str:
    """``departures`` ({key: {value, default}}) as ```key` = value (default d)``, or ``none``."""
    return ", ".join(f"`{k}` = {json.dumps(v['value'])} (default {json.dumps(v['default'])})"
                     for k, v in departures.items()) or none


def _settings_lines(label: str, part: Optional[dict]) -> List[str]:
    if not part:
        return [f"- {label}: unknown"]
    changed = _departures(part["departures"], "none (the method's defaults)")
    every = ", ".join(f"{k}={json.dumps(v)}" for k, v in part["settings"].items())
    return [f"- {label}: `{part['rule']}` ({part['class']}); departures from the defaults: {changed}",
            f"  - all settings: {every}"]


def _evaluation_lines(evaluations: List[dict]) -> List[str]:
    lines = ["", "## Evaluations", ""]
    if not evaluations:
        return lines + ["None yet: `python -m fedpartial evaluate --model FILE --data DATA` adds one."]
    keys = sorted({k for e in evaluations for k in (e.get("metrics") or {})})
    rows = [[e.get("date"), e.get("model"), e.get("data"), e.get("split"), e.get("n"), e.get("threshold")]
            + [(e.get("metrics") or {}).get(k) for k in keys] for e in evaluations]
    return lines + _table(["date", "model", "data", "split", "n", "threshold", *keys], rows)


def render_markdown(card: Dict) -> str:
    """``model_card.md`` from the card dict."""
    model, method, training = card.get("model", {}), card.get("method", {}), card.get("training", {})
    lines = [f"# Model card: job {card.get('job_id') or '?'}", "",
             f"Written {card.get('written_at')} by the server at the end of the run (runtime fedpartial "
             f"{card['runtime']['version']}, content hash {card['runtime']['hash'] or '-'}). "
             f"The result model is `{card.get('result_model')}`.", "",
             "## Intended use and known limits", "",
             f"- Intended use: {card.get('intended_use')}", f"- Known limits: {card.get('known_limits')}",
             f"- Source: {card.get('notes_source') or '-'}", "",
             "## Model", "",
             f"- {model.get('task')}, {model.get('arch')} {json.dumps(model.get('arch_args', {}))}, input "
             f"{model.get('input_size')}, normalisation {json.dumps(model.get('normalisation'))}",
             f"- classes: {', '.join(model.get('class_names') or []) or '-'}", "",
             "## Method", ""]
    lines += _settings_lines("server rule", method.get("server"))
    lines += _settings_lines("site rule", method.get("client"))
    if method.get("client_note"):
        lines.append(f"- note: {method['client_note']}")
    weighting = method.get("weighting")
    if weighting:
        changed = _departures(weighting["departures"], "none")
        unweighted = weighting["settings"]["weight_rule"] != "mean"
        lines.append(f"- aggregation: `{weighting['settings']['weight_rule']}`"
                     + (" (the sites' updates combined unweighted, coordinate by coordinate: `server.weights` in "
                        "metrics.json are sample shares, not the weights applied)" if unweighted else
                        " (the method's weighted average)") + f"; departures from the defaults: {changed}")
    asked = training.get("rounds_asked")
    lines += ["", "## Training", "",
              f"- rounds run: {training.get('rounds_run')}" + (f" of {asked}" if asked is not None else "")
              + f" (0-based rounds {training.get('rounds')})",
              f"- sites aggregated: {', '.join(training.get('sites') or []) or 'none'}"]
    for rnd, rejected in (training.get("rejected") or {}).items():
        lines.append(f"- round {rnd} rejected: " + "; ".join(f"{s}: {w}" for s, w in rejected.items()))
    lines += ["", "## Sites as the server saw them", "",
              f"'{WITHHELD}': the site policy kept it at the site (a train size or a class's validation counts "
              "below its minimum count; a class the site does not annotate also sends none). A sample count "
              "of 0: the site took no part in that round's average (no usable sample, or fewer than the "
              "minimum count).", ""]
    census = card.get("census", {})
    rows = []
    for site, c in census.items():
        samples = ", ".join(f"{k}: {v}" for k, v in c["samples"].items()) or "-"
        val = c.get("val_images")
        val_text = "-" if val is None else "; ".join(
            f"{name} {v['pos']}/{v['neg']}" if isinstance(v, dict) else f"{name} {v}" for name, v in val.items())
        rejected = "; ".join(f"round {k}: {v}" for k, v in c["rejected"].items()) or "-"
        rows.append([site, c["train_size"], samples, val_text, rejected])
    lines += _table(["site", "train size", "samples per round", "val images per class (pos/neg), last round",
                     "rejected"], rows)
    val = card.get("validation", {})
    sites = sorted({s for r in val.get("rounds", []) for s in r["sites"]})
    lines += ["", f"## Validation per round ({val.get('key_metric')})", "",
              "Each site scores the global model it receives on its val split: round r validates the model of "
              "round r-1.", "", f"What it is scored on: {val.get('labels', 'not recorded')}.", ""]
    how = sorted({r["pooled_how"] for r in val.get("rounds", [])})
    lines += _table(["round", "model validated", *sites, "pooled (" + ", ".join(how) + ")"],
                    [[r["round"], r["model"], *(r["sites"].get(s) for s in sites), r["pooled"]]
                     for r in val.get("rounds", [])])
    lines += ["", "## Decision thresholds", ""]
    models = card.get("models") or {}
    for name in sorted(models, key=lambda n: (n != card.get("result_model"), n)):  # the result model first
        f = models[name]
        dt = f.get("decision_thresholds")
        result = ", the result model" if name == card.get("result_model") else ""
        lines.append(f"`{name}` (model of round {f.get('round')}{result}):")
        if not dt:
            lines += ["- none stored (segmentation, or no classification thresholds were computed)", ""]
            continue
        lines += [f"- rule: {dt.get('rule')}", f"- source: {dt.get('source')}",
                  "- thresholds: " + ", ".join(f"{k} {v:.2f}" for k, v in dt.get("thresholds", {}).items()), ""]
    lines += _evaluation_lines(card.get("evaluations") or [])
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------
def write_card(folder: str, card: Dict) -> tuple:
    """Write ``model_card.json`` and ``model_card.md`` (rendered from it) to ``folder``; returns both paths."""
    json_path, md_path = os.path.join(folder, CARD_JSON), os.path.join(folder, CARD_MD)
    atomic_write_json(json_path, card)
    tmp = f"{md_path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(render_markdown(card))
    os.replace(tmp, md_path)
    return json_path, md_path


def append_evaluation(model_file: str, entry: Dict) -> Optional[str]:
    """Add one evaluation to the model card beside ``model_file`` (both files), when one exists.

    Args:
        model_file: the evaluated model file; the card is ``model_card.json`` in its folder.
        entry: ``{"model", "data", "split", "n", "threshold", "date", "metrics": {name: value}}``.

    Returns:
        the card's Markdown path, or None when there is no card beside the file.
    """
    folder = os.path.dirname(os.path.abspath(model_file))
    card = _load_json(os.path.join(folder, CARD_JSON))
    if card is None or card.get("format") != FORMAT:
        return None
    card.setdefault("evaluations", []).append(jsonable(entry))
    return write_card(folder, card)[1]


def _sites_run_servers_app(run_dir: str) -> bool:
    """Whether the app deployed to the server went to the sites too, from the job's ``meta.json`` in
    the server's run folder (none, as in the simulator: one app). Only then is the client config in
    the server's app folder what the sites ran: a job may give the server an app of its own with a
    client config the sites never saw."""
    from fedpartial.flare.common import app_targets

    meta = _load_json(os.path.join(run_dir, "meta.json"))
    if meta is None:
        return True
    return any(to_server and to_sites for to_server, to_sites in app_targets(meta.get("deploy_map")).values())


def write_model_card(run_dir: str, app_config_dir: str, model: Optional[dict], global_file: str, best_file: str,
                     job_id: str = "") -> tuple:
    """Build and write the card of the run in ``run_dir`` (the server's END_RUN hook).

    The method comes from the job's server config (the ``RuleAggregator``'s ``rule`` and
    ``rule_args``), the sites' settings from its client config, which FLARE deploys to the server's
    app folder too when the job sends one app to every participant (and only then is it read).

    Args:
        run_dir: the server's run folder.
        app_config_dir: the job's app config folder on the server.
        model: the job's model block.
        global_file / best_file: the file names of the last and the best global model.
        job_id: the job's id.

    Returns:
        ``(json path, md path)``.
    """
    server = _load_json(os.path.join(app_config_dir, "config_fed_server.json")) or {}
    client = _load_json(os.path.join(app_config_dir, "config_fed_client.json")) if _sites_run_servers_app(run_dir) \
        else None
    aggregator = _component_args(server, AGGREGATOR_PATH)
    workflow = _component_args(server, "nvflare.app_common.workflows.scatter_and_gather.ScatterAndGather") or {}
    asked = workflow.get("num_rounds", server.get("num_rounds"))
    rule = aggregator.get("rule", "fedavg") if aggregator is not None else None  # "fedavg": the class default
    card = build_card(run_dir, rule, (aggregator or {}).get("rule_args"), model, client, job_id,
                      int(asked) if isinstance(asked, (int, float)) or str(asked).isdigit() else None,
                      global_file, best_file, aggregator)
    return write_card(run_dir, card)
