"""The model user's commands: ``import`` (a site's own images -> site file), ``evaluate``,
``predict`` and ``export`` of a result model. They are the whole of ``python -m fedpartial`` (and the
``fedpartial`` command) where the tools wheel is installed (``build-tools``: a site's or a
workstation's venv, no checkout); the checkout's :mod:`fedpartial_tools.cli` adds the research
commands (split, simulate, package-job, ...). Imports only :mod:`.evaluate`, :mod:`.data` and
:mod:`.model`, which is what the tools wheel ships."""
from __future__ import annotations

import argparse
import json
import os
import sys

DESCRIPTION = ("a result model's commands: import a site's own images into a site file, evaluate a model on "
               "labelled data, predict on a site's images, export it for MONAI")

_CLASSIFICATION_KEYS = ("auc", "map", "bacc", "accuracy", "f1", "precision", "recall")
_SEGMENTATION_KEYS = ("dice_per_image", "dice_pooled", "iou_per_image", "iou_pooled", "n_empty_both",
                     "predicted_lesion_share")


def _cmd_evaluate(args):
    from fedpartial_tools.evaluate import evaluate_data, record_in_model_card
    from fedpartial.flare.common import jsonable
    from fedpartial.models.io import load_model_file
    from fedpartial.training.common import select_device

    device = select_device(args.device)
    model, meta = load_model_file(args.model, device=device)
    result = evaluate_data(model.to(device), meta, args.data, split=args.split, device=device,
                           threshold=args.threshold)
    out = {"model": os.path.abspath(args.model), **result}
    if args.json or args.compact:
        print(json.dumps(jsonable(out), indent=None if args.compact else 1))
    else:
        print(format_evaluation(out, meta))
    card = record_in_model_card(args.model, result, args.threshold)
    if card:
        print(f"evaluation added to {card}", file=sys.stderr)


def _cell(value) -> str:
    """A metric for the table: 4 decimals, ints as they are, undefined (NaN / None) as '-'."""
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.4f}"


def _table(rows) -> list:
    """Aligned text columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def format_evaluation(out: dict, meta: dict) -> str:
    """The short human-readable report of ``evaluate`` (``--json`` prints ``out`` itself).

    Args:
        out: :func:`fedpartial_tools.evaluate.evaluate_data`'s result plus ``model``.
        meta: the model's meta (task, classes, input size for the header).
    """
    from fedpartial.models.io import model_input_size

    seg = meta["task"] == "segmentation"
    size = model_input_size(meta)
    what = meta["task"] + ("" if seg else f", {len(meta['class_names'])} classes") + (
        f", input {size[0]}x{size[1]}" if size else "")
    sites = out.get("sites")
    lines = [f"model  {out['model']} ({what})",
             f"data   {out['data']}" + (f" ({len(sites)} sites)" if sites else ""),
             f"split  {out['split']}", f"n      {out['n']}"]
    metrics = out["pooled"] if sites else out
    if seg:
        lines.append(f"resolution  {metrics['resolution']} (model input {metrics['model_input']})")
    lines += [f"note   {n}" for n in out.get("notes", [])]
    keys = _SEGMENTATION_KEYS if seg else _CLASSIFICATION_KEYS
    lines.append("")
    if sites:
        rows = [["site", "split", "n", *keys]]
        rows += [[name, r["split"], str(r["n"]), *(_cell(r[k]) for k in keys)] for name, r in sites.items()]
        rows.append(["pooled", "", str(out["n"]), *(_cell(metrics[k]) for k in keys)])
        lines += _table(rows)
    else:
        lines += _table([["metric", "value"], *([k, _cell(metrics[k])] for k in keys)])
    if seg:
        lines += ["", f"per image: {metrics['empty_rule']}", "pooled: Dice / IoU over all pixels together"]
    else:
        per_class = metrics["per_class"]
        masked = any("n" in v for v in per_class.values())
        head = ["class" + (" (pooled)" if sites else ""), "auc", "ap", "f1", "n_pos"]
        head += ["annotated"] if masked else []
        rows = [head] + [[name, _cell(v["auc"]), _cell(v["ap"]), _cell(v["f1"]), str(v["n_pos"])]
                         + ([str(v["n"])] if masked else []) for name, v in per_class.items()]
        lines += [""] + _table(rows)
        if masked:
            lines.append("per class: only the samples where the class is annotated (label_mask)")
    return "\n".join(lines)


def add_model_commands(subparsers) -> None:
    """Register ``import``, ``evaluate``, ``predict`` and ``export`` on a parser's sub-parsers.

    Args:
        subparsers: the ``add_subparsers()`` object of ``python -m fedpartial``.
    """
    from fedpartial_tools.data.importer import add_import_parser
    from fedpartial_tools.model.export import add_export_parser
    from fedpartial_tools.model.predict import add_predict_parser

    add_import_parser(subparsers)
    s = subparsers.add_parser("evaluate", help="metrics of a saved model on a .npz file or a folder of site files "
                                        "(a table; --json for the full JSON)")
    s.add_argument("--model", required=True, help="a fedpartial model file (global_model.pt)")
    s.add_argument("--data", required=True,
                   help="a .npz: source layout with any of train/val/test (e.g. a test-only MedMNIST-layout file) "
                        "or a site file; a site folder; or a folder of site files / site folders, scored per site "
                        "and pooled")
    s.add_argument("--split", default=None,
                   help="split to score (default: 'val' for site files, which without one need --split train; "
                        "else 'test', or the only split present)")
    s.add_argument("--threshold", type=float, default=None,
                   help="probability threshold of multi-label and segmentation decisions (default: the model "
                        "file's decision_thresholds, else 0.5)")
    s.add_argument("--device", default="auto")
    s.add_argument("--json", action="store_true", help="print the full result as JSON instead of the table")
    s.add_argument("--compact", action="store_true", help="one line of JSON (implies --json)")
    s.set_defaults(func=_cmd_evaluate)

    add_predict_parser(subparsers)
    add_export_parser(subparsers)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedpartial", description=DESCRIPTION)
    add_model_commands(p.add_subparsers(dest="command", required=True))
    return p


def run(parser: argparse.ArgumentParser, argv=None) -> None:
    """Parse ``argv`` and run the command; a user error prints one line and exits 2."""
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, PermissionError, RuntimeError) as e:  # an OSError's text names its file
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)


def main(argv=None):
    run(build_parser(), argv)


if __name__ == "__main__":
    main()
