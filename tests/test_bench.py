"""bench reports on hand-made run folders (no simulator): pseudo-label quality per round,
segmentation overlays, the README results section, and which jobs get ``reference_file``."""
import argparse
import csv
import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from fedpartial_tools.bench import cli as bench, overlays, pseudo_labels, tables
from fedpartial_tools.bench import readme as bench_readme
from fedpartial_tools.bench import runner as bench_run, suites as bench_suites
from fedpartial_tools.cli import build_parser
from fedpartial_tools.jobs.folders import find_job

REPO = Path(__file__).resolve().parents[1]


def _write_metrics(path, rounds):
    """metrics.json of a workspace: ``rounds`` = [{site: {key: value}}] in round order."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = {"rounds": [{"round": i, "rejected": {}, "sites": sites} for i, sites in enumerate(rounds)]}
    with open(path, "w") as f:
        json.dump(data, f)


def _lsm(n, p, r):
    return {"num_pseudo_positive": n, "pseudo_precision": p, "pseudo_recall": r, "loss": 0.1,
            "val": {"auc": 0.5}}


# --- pseudo-label quality --------------------------------------------------------------------
# FedLSM, 2 seeds x 3 rounds x 2 sites. FedLSM logs precision 0 when it made no pseudo label
# (n = 0): undefined, left out. site-2 of round 0 logged no diagnostic key at all.
#   round 1: precision seed0 0.8 (site-2 n=0 out), seed1 (1.0+0.5)/2 = 0.75 -> 0.775 ± 0.035
#            recall    seed0 (0.2+0)/2 = 0.1,   seed1 (0.1+0.3)/2 = 0.2      -> 0.150 ± 0.071
#            count     seed0 10 (1 site > 0),  seed1 4+6 = 10 (2 sites)      -> 10 ± 0 (1.5/2)
#   round 2: precision seed0 (0.9+0.6)/2 = 0.75, seed1 (0.7+0.5)/2 = 0.6    -> 0.675 ± 0.106
#            recall    seed0 0.25, seed1 0.4                                  -> 0.325 ± 0.106
#            count     seed0 25, seed1 11                                     -> 18 ± 10 (2/2)
# (± is the sample std, ddof 1: for two values |a - b| / sqrt(2))
LSM_SEEDS = {
    0: [{"site-1": _lsm(0, 0.0, 0.0), "site-2": {"loss": 0.2}},
        {"site-1": _lsm(10, 0.8, 0.2), "site-2": _lsm(0, 0.0, 0.0)},
        {"site-1": _lsm(20, 0.9, 0.4), "site-2": _lsm(5, 0.6, 0.1)}],
    1: [{"site-1": _lsm(0, 0.0, 0.0), "site-2": {"loss": 0.2}},
        {"site-1": _lsm(4, 1.0, 0.1), "site-2": _lsm(6, 0.5, 0.3)},
        {"site-1": _lsm(8, 0.7, 0.3), "site-2": _lsm(3, 0.5, 0.5)}],
}


@pytest.fixture
def lsm_out(tmp_path):
    for seed, rounds in LSM_SEEDS.items():
        _write_metrics(str(tmp_path / "fedlsm-ham" / f"seed{seed}" / "fedlsm" / "metrics.json"), rounds)
        # a baseline's workspace: never read for pseudo labels
        _write_metrics(str(tmp_path / "fedlsm-ham" / f"seed{seed}" / "fedavg" / "metrics.json"),
                       [{"site-1": {"pseudo_precision": 0.123}}])
    (tmp_path / "fedlsm-ham" / "seed7").mkdir()  # a seed without a workspace yet
    return tmp_path


def _table_rows(md):
    rows = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].isdigit():
            rows[int(cells[0])] = cells[1:]
    return rows


def test_pseudo_label_records_and_csv(lsm_out):
    md = pseudo_labels.write_pseudo_label_report(str(lsm_out), "fedlsm-ham", log=lambda *_: None)
    assert md
    with open(lsm_out / "fedlsm-ham_pseudo_labels.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == pseudo_labels.PSEUDO_FIELDS
    # 2 seeds x (round 0: site-1 only, rounds 1-2: both sites) x 2 keys
    assert len(rows) == 2 * (1 + 2 + 2) * 2
    assert {r["job"] for r in rows} == {"fedlsm"}
    undefined = [r for r in rows if r["key"] == "pseudo_precision" and r["value"] == ""]
    assert {(r["seed"], r["round"], r["site"]) for r in undefined} == {("0", "0", "site-1"), ("1", "0", "site-1"),
                                                                       ("0", "1", "site-2")}
    at = {(r["seed"], r["round"], r["site"], r["key"]): r for r in rows}
    hit = at[("1", "2", "site-2", "pseudo_recall")]
    assert float(hit["value"]) == 0.5 and hit["count_key"] == "num_pseudo_positive" and float(hit["count"]) == 3
    # a recall of 0 with no pseudo label is a real 0 (none of the hidden positives found)
    assert at[("0", "1", "site-2", "pseudo_recall")]["value"] == "0.0"


def test_pseudo_label_table_numbers(lsm_out):
    md = pseudo_labels.write_pseudo_label_report(str(lsm_out), "fedlsm-ham", log=lambda *_: None)
    assert (lsm_out / "fedlsm-ham_pseudo_labels.md").read_text() == md
    assert "| round | pseudo_precision | pseudo_recall | num_pseudo_positive: sum of sites (sites > 0) |" in md
    table = _table_rows(md)
    assert sorted(table) == [0, 1, 2]
    assert table[0] == ["–", "0.000 ± 0.000", "0 ± 0 (0/1)"]
    assert table[1] == ["0.775 ± 0.035", "0.150 ± 0.071", "10 ± 0 (1.5/2)"]
    assert table[2] == ["0.675 ± 0.106", "0.325 ± 0.106", "18 ± 10 (2/2)"]
    assert "seeds [0, 1]" in md


def test_pseudo_label_report_absent_diagnostics(tmp_path):
    _write_metrics(str(tmp_path / "fedirm-ham" / "seed0" / "fedirm" / "metrics.json"), [{"site-1": {"loss": 1.0}}])
    notes = []
    assert pseudo_labels.write_pseudo_label_report(str(tmp_path), "fedirm-ham", log=notes.append) is None
    assert not list(tmp_path.glob("*_pseudo_labels.*")) and "--diagnostics" in notes[0]


def test_fedirm_precision_without_reliable_labels_is_undefined(tmp_path):
    _write_metrics(str(tmp_path / "fedirm-ham" / "seed0" / "fedirm" / "metrics.json"),
                   [{"site-1": {"reliable_fraction": 0.0, "pseudo_precision": 0.0},
                     "site-2": {"reliable_fraction": 0.5, "pseudo_precision": 0.6}}])
    records = [r for r in pseudo_labels.pseudo_label_records(str(tmp_path), "fedirm-ham") if r["key"] == "pseudo_precision"]
    assert [(r["site"], r["value"]) for r in records] == [("site-1", None), ("site-2", 0.6)]
    assert _table_rows(pseudo_labels.pseudo_label_table(records))[0] == ["0.600"]
    # the share of reliable pseudo labels is shown beside it, zero included: (0 + 0.5) / 2
    table = pseudo_labels.pseudo_label_table(pseudo_labels.pseudo_label_records(str(tmp_path), "fedirm-ham"))
    assert _table_rows(table)[0] == ["0.600", "0.250"]


def test_report_without_reference_labels_does_not_claim_them(tmp_path):
    # a FedIRM run without --diagnostics logs reliable_fraction only: no comparison with hidden labels
    _write_metrics(str(tmp_path / "fedirm-ham" / "seed0" / "fedirm" / "metrics.json"),
                   [{"site-1": {"reliable_fraction": 0.5}}])
    md = pseudo_labels.write_pseudo_label_report(str(tmp_path), "fedirm-ham", log=lambda *_: None)
    assert "no hidden labels" in md and "against the hidden complete labels" not in md
    assert _table_rows(md)[0] == ["0.500"]
    _write_metrics(str(tmp_path / "fedirm-ham" / "seed0" / "fedirm" / "metrics.json"),
                   [{"site-1": {"reliable_fraction": 0.5, "pseudo_precision": 0.9}}])
    assert "against the hidden complete labels" in pseudo_labels.write_pseudo_label_report(str(tmp_path), "fedirm-ham")


def test_fedmlp_macro_over_classes_not_over_tag_kinds(tmp_path):
    # per-class keys: macro tag_precision = mean over the classes present at a site, then over sites:
    #   site-1 (0.5 + 1.0)/2 = 0.75, site-2 0.7 -> 0.725; tag_recall: site-1 0.2 only -> 0.2.
    # pos / neg are tag kinds: shown as they are, never averaged into the macro.
    _write_metrics(str(tmp_path / "fedmlp-nih" / "seed0" / "fedmlp" / "metrics.json"), [
        {"site-1": {"tag_precision_Atelectasis": 0.5, "tag_precision_Mass": 1.0, "tag_recall_Atelectasis": 0.2,
                    "tag_precision_pos": 0.9, "tags_total_pos": 12.0},
         "site-2": {"tag_precision_Atelectasis": 0.7, "tag_precision_pos": 0.5, "tags_total_pos": 0.0}}])
    records = pseudo_labels.pseudo_label_records(str(tmp_path), "fedmlp-nih")
    md = pseudo_labels.pseudo_label_table(records)
    assert "| round | tag_precision | tag_recall | tag_precision_pos | tags_total_pos: sum of sites (sites > 0) |" in md
    assert _table_rows(md)[0] == ["0.725", "0.200", "0.700", "12 (1/2)"]


def test_shown_rounds():
    assert pseudo_labels.shown_rounds(range(20)) == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 19]
    assert pseudo_labels.shown_rounds(range(20), every=5) == [0, 5, 10, 15, 19]
    assert pseudo_labels.shown_rounds([2, 0, 1]) == [0, 1, 2]
    assert pseudo_labels.shown_rounds([]) == []


def test_bad_metrics_files_name_the_file(tmp_path):
    path = tmp_path / "fedlsm-ham" / "seed0" / "fedlsm" / "metrics.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="metrics.json is not valid JSON"):
        pseudo_labels.pseudo_label_records(str(tmp_path), "fedlsm-ham")
    path.write_text(json.dumps({"round": []}))
    with pytest.raises(ValueError, match="metrics.json has no 'rounds' list"):
        pseudo_labels.pseudo_label_records(str(tmp_path), "fedlsm-ham")


# --- which jobs read the reference copies ----------------------------------------------------
def test_diagnostics_reach_the_method_job_only(tmp_path, monkeypatch):
    import fedpartial_tools.data.partition as partition
    import fedpartial_tools.data.sites as sites
    import fedpartial_tools.run.simulator as simulator

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "ham10000_28.npz").write_bytes(b"")
    calls = []
    monkeypatch.setattr(partition, "split_file", lambda *a, **k: None)
    monkeypatch.setattr(sites, "dataset_overrides", lambda root: ["model.task=single-label"])
    monkeypatch.setattr(simulator, "simulate", lambda job, root, ws, sets, log=None, **kw: calls.append(
        (os.path.basename(job), list(sets))))
    monkeypatch.setattr(bench_run, "_evaluate_row", lambda name, suite, job, seed, *a: {
        "suite": name, "method": job, "seed": seed, **{k: 0.5 for k in suite.metrics}})
    rows = bench_run.run_suite("fedlsm-ham", str(tmp_path / "out"), seeds=[3], data_dir=str(tmp_path / "data"),
                               extra=["rule_args.lr=0.01"], diagnostics=True, log=lambda *_: None)
    with_ref = [job for job, sets in calls if bench_run.REFERENCE_SET in sets]
    # 3 baselines, FedAvg matched in compute (the fedavg job), the method and its two variants (which run
    # the method's job folder)
    assert with_ref == ["fedlsm", "fedlsm", "fedlsm"] and len(calls) == 7
    compute = [sets for job, sets in calls if any(s.startswith("rule_args.steps_of=") for s in sets)]
    assert [job for job, sets in calls].count("fedavg") == 2 and len(compute) == 1
    assert all("seed=3" in sets and "rule_args.lr=0.01" in sets for _, sets in calls)
    assert json.loads(rows[0]["bench_args"]) == {"profile": "cpu", "rounds": None, "sets": ["rule_args.lr=0.01"],
                                                 "diagnostics": True}
    calls.clear()
    bench_run.run_suite("fedlsm-ham", str(tmp_path / "out"), seeds=[3], data_dir=str(tmp_path / "data"),
                        log=lambda *_: None)
    assert not any(bench_run.REFERENCE_SET in sets for _, sets in calls)
    with pytest.raises(ValueError, match="use --diagnostics"):
        bench_run.run_suite("fedlsm-ham", str(tmp_path / "out"), seeds=[3], data_dir=str(tmp_path / "data"),
                            extra=["client.reference_file=reference/{site}_full.npz"])


def test_user_command_line_offers_no_developer_command():
    user = build_parser()
    with pytest.raises(SystemExit):
        user.parse_args(["bench", "--suite", "fedlsm-ham", "--out", "x"])
    def commands(parser):
        return set(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)

    developer_only = {"bench", "bench-report", "throughput", "timing", "bench-summary", "jobs", "harmonise"}
    assert commands(build_parser(developer=True)) - commands(user) == developer_only
    assert {"import", "split", "simulate", "evaluate", "package-job"} <= commands(user)
    assert user.parse_args(["simulate", "jobs/fedavg", "--data-root", "d", "--workspace", "w"]).command == "simulate"


def test_cli_flags_parse():
    args = build_parser(developer=True).parse_args(["bench", "--suite", "fedlsm-ham", "--out", "x", "--diagnostics", "--readme",
                                                    "R.md", "--copy-plots", "docs/results", "--every", "5"])
    assert args.diagnostics and args.readme == "R.md" and args.copy_plots == "docs/results" and args.every == 5
    assert args.overlay_images == 4
    args = build_parser(developer=True).parse_args(["bench-report", "--out", "x", "--overlays", "--overlay-images", "2"])
    assert args.func is bench._cmd_bench_report and args.overlays and args.overlay_images == 2 and args.suite is None


# --- segmentation overlays -------------------------------------------------------------------
def _masks():
    truth = np.zeros((4, 4), bool)
    truth[0:2, 0:2] = True                              # 4 true pixels
    pred = np.zeros((4, 4), bool)
    pred[0, 0:2] = True                                 # 2 TP (row 0), 2 FN (row 1)
    pred[3, 3] = True                                   # 1 FP
    return truth, pred


def test_overlay_colours_on_a_drawn_mask():
    truth, pred = _masks()
    rgb = overlays.overlay_rgb(np.zeros((4, 4), np.uint8), truth, pred, alpha=1.0)
    green, red, blue, black = [0, 1, 0], [1, 0, 0], [0, 0, 1], [0, 0, 0]
    assert rgb[0, 0].tolist() == green and rgb[0, 1].tolist() == green      # TP
    assert rgb[1, 0].tolist() == red and rgb[1, 1].tolist() == red          # FN
    assert rgb[3, 3].tolist() == blue                                       # FP
    assert rgb[2, 2].tolist() == black                                      # TN: the image
    # blended over an RGB image of grey 102/255 = 0.4 (mean of the channels): TN keeps 0.4
    img = np.full((4, 4, 3), 102, np.uint8)
    rgb = overlays.overlay_rgb(img, truth, pred, alpha=0.5)
    np.testing.assert_allclose(rgb[0, 0], [0.2, 0.7, 0.2])
    np.testing.assert_allclose(rgb[1, 0], [0.7, 0.2, 0.2])
    np.testing.assert_allclose(rgb[3, 3], [0.2, 0.2, 0.7])
    np.testing.assert_allclose(rgb[2, 2], [0.4, 0.4, 0.4])
    with pytest.raises(ValueError, match="same"):
        overlays.overlay_rgb(np.zeros((4, 5)), truth, pred)


def test_plot_overlays_dice_per_panel(tmp_path):
    import matplotlib.image as mpimg

    truth, pred = _masks()
    images = np.zeros((2, 4, 4), np.uint8)
    truths = np.stack([truth, np.zeros_like(truth)])
    preds = {"a": np.stack([pred, np.zeros_like(pred)]), "b": np.stack([truth, pred])}
    path = str(tmp_path / "grid.png")
    dice = overlays.plot_overlays(images, truths, preds, path, title="t")
    # a: image 0 Dice 2*2/(4+3) = 4/7; image 1 empty vs empty = 1. b: perfect, then 1 FP px on empty = 0
    np.testing.assert_allclose(dice["a"], [4 / 7, 1.0])
    np.testing.assert_allclose(dice["b"], [1.0, 0.0])
    assert mpimg.imread(path).ndim == 3


def test_write_overlays_uses_the_evaluation_path(tmp_path):
    import torch

    from fedpartial.data.npz import load_npz, save_npz
    from fedpartial_tools.data.synthetic import make_segmentation
    from fedpartial.data.transforms import resize_dataset
    from fedpartial.evaluation import predict_split
    from fedpartial.metrics import segmentation_metrics
    from fedpartial.models import build_model, load_model_file, save_model_file

    source = str(tmp_path / "seg.npz")
    save_npz(make_segmentation(n_train=2, n_val=2, n_test=5, size=16, seed=0), source)
    meta = {"class_names": ["lesion"], "task": "segmentation", "input_size": [8, 8],  # resized like the bench
            "normalisation": {"mean": 0.3, "std": 0.2}}
    name = "fedia-dsb-m0"
    for i, job in enumerate(bench_suites.SUITES[name].jobs):
        torch.manual_seed(i)
        model = build_model("unet", 1, 1, channels=(4, 8), strides=(2,), num_res_units=0)
        save_model_file(tmp_path / name / "seed0" / job / "global_model.pt", model, meta)
    path, dice = overlays.write_overlays(name, str(tmp_path), 0, source, n_images=10, device="cpu")
    assert path == str(tmp_path / f"{name}_overlays_seed0.png") and os.path.isfile(path)
    assert list(dice) == ["fedavg_seg", "fedavg_seg_full", "fedia", "fedia_no_correction", "fedia_keep_weighting",
                          "fedia_paper_threshold", "fedia_lesionwise", "fedia_lesionwise_late_retry"]
    test = resize_dataset(load_npz(source), (8, 8)).splits["test"]
    for job in dice:
        model, meta_read = load_model_file(tmp_path / name / "seed0" / job / "global_model.pt")
        probs = predict_split(model, test, "segmentation", meta_read["normalisation"], "cpu")
        expected = segmentation_metrics(probs > 0.5, test.labels > 0)["dice"]
        assert len(dice[job]) == 5 and np.mean(dice[job]) == pytest.approx(expected)
    assert overlays.overlay_indices(133, 4).tolist() == [0, 44, 88, 132]


# --- README section --------------------------------------------------------------------------
def _rows(suite, seeds, bench_args=None, jobs=None):
    out = []
    for seed in seeds:
        for job in jobs or bench_suites.SUITES[suite].jobs:
            r = {"suite": suite, "method": job, "seed": seed, "rounds": 20, "per_class_auc": json.dumps({"a": 0.7}),
                 "curve": json.dumps([0.5, 0.6]), "dataset": "d", "scenario": "s", "split_options": "{}"}
            r.update({k: 0.5 + 0.1 * (job == bench_suites.SUITES[suite].upper) for k in bench_suites.SUITES[suite].metrics})
            if bench_args is not None:
                r["bench_args"] = json.dumps(bench_args)
            out.append(r)
    return out


def test_bench_commands(tmp_path):
    cpu = {"profile": "cpu", "rounds": None, "sets": ["rule_args.lr=0.01"], "diagnostics": True}
    rows = (_rows("fedlsm-ham", [0, 1], cpu) + _rows("fedlsm-ham", [2], {**cpu, "rounds": 5, "sets": []}, ["fedlsm"])
            + _rows("fedirm-ham", [0]))  # no bench_args: rows from before bench recorded them
    for r in rows[-len(bench_suites.SUITES["fedirm-ham"].jobs):]:
        r["rounds"] = 30.0
    out = os.path.join(bench_suites.REPO, "runs", "b")
    cmds = bench_readme.bench_commands(rows, out)
    assert cmds["fedlsm-ham"] == [
        "python -m fedpartial_tools bench --suite fedlsm-ham --seeds 0,1 --profile cpu --diagnostics "
        "--set rule_args.lr=0.01 --out runs/b",
        "python -m fedpartial_tools bench --suite fedlsm-ham --seeds 2 --profile cpu --rounds 5 --jobs fedlsm --diagnostics "
        "--out runs/b --append"]
    assert cmds["fedirm-ham"] == ["# reconstructed (these rows predate the recorded command)\n"
                                  "python -m fedpartial_tools bench --suite fedirm-ham --seeds 0 --profile cpu "
                                  "--out runs/b --append"]
    # quoting of settings with shell characters
    rows = _rows("fedlsm-ham", [0], {"profile": "gpu", "rounds": None, "sets": ['model.arch_args={"a": 1}'],
                                     "diagnostics": False})
    assert "--profile gpu --set 'model.arch_args={\"a\": 1}' --out /elsewhere" in bench_readme.bench_commands(
        rows, "/elsewhere")["fedlsm-ham"][0]


def test_replace_between_markers(tmp_path):
    readme = tmp_path / "R.md"
    readme.write_text(f"head\n{bench_readme.README_BEGIN}\nold\n{bench_readme.README_END}\ntail\n")
    bench_readme.replace_between_markers(str(readme), "new table\n")
    assert readme.read_text() == f"head\n{bench_readme.README_BEGIN}\nnew table\n{bench_readme.README_END}\ntail\n"
    bench_readme.replace_between_markers(str(readme), "again")  # idempotent frame
    assert readme.read_text() == f"head\n{bench_readme.README_BEGIN}\nagain\n{bench_readme.README_END}\ntail\n"
    for text, msg in ((f"{bench_readme.README_BEGIN}\n", "found 0"), (f"{bench_readme.README_BEGIN}{bench_readme.README_BEGIN}"
                                                                      f"{bench_readme.README_END}", "found 2"),
                      (f"{bench_readme.README_END}\n{bench_readme.README_BEGIN}", "comes before")):
        readme.write_text(text)
        with pytest.raises(ValueError, match=msg):
            bench_readme.replace_between_markers(str(readme), "x")
        assert readme.read_text() == text  # untouched on error


def test_update_readme_links_copies(tmp_path, lsm_out):
    out = lsm_out  # holds the FedLSM workspaces of the pseudo-label tests
    rows = _rows("fedlsm-ham", [0, 1], {"profile": "cpu", "rounds": None, "sets": [], "diagnostics": True})
    tables.write_reports(rows, str(out))
    pseudo_labels.write_pseudo_label_report(str(out), "fedlsm-ham", log=lambda *_: None)
    (tmp_path / "repo").mkdir()
    readme = tmp_path / "repo" / "README.md"
    readme.write_text(f"# x\n\n{bench_readme.README_BEGIN}\n{bench_readme.README_END}\n")
    section = bench_readme.update_readme(str(out), str(readme), copy_plots=str(tmp_path / "repo" / "docs" / "results"))
    text = readme.read_text()
    assert section.strip() in text
    copied = sorted(os.listdir(tmp_path / "repo" / "docs" / "results"))
    assert copied == ["fedlsm-ham_curves.png", "fedlsm-ham_per_class_auc.png", "fedlsm-ham_pseudo_labels.csv",
                      "fedlsm-ham_pseudo_labels.md", "results.csv", "results.md"]
    assert "![fedlsm-ham: validation auc per round](docs/results/fedlsm-ham_curves.png)" in text
    assert "(docs/results/results.csv)" in text
    assert "| fedlsm | 0.500 ± 0.000 |" in text and "| fedavg_full | 0.600 ± 0.000 |" in text
    assert "python -m fedpartial_tools bench --suite fedlsm-ham --seeds 0,1 --profile cpu --diagnostics --out " in text
    assert "pseudo-label quality of `fedlsm`" in text and "| 1 | 0.775 ± 0.035 |" in text
    # without copies the links point into the bench folder, relative to the README
    bench_readme.update_readme(str(out), str(readme))
    rel = os.path.relpath(str(out / "fedlsm-ham_curves.png"), str(tmp_path / "repo"))
    assert f"]({rel})" in readme.read_text()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="results.csv"):
        bench_readme.update_readme(str(tmp_path / "empty"), str(readme))


def test_variants_run_the_method_job_with_their_settings(monkeypatch, tmp_path):
    """A suite variant runs the method's job folder with its extra settings (and the diagnostics
    reference), under its own workspace and row name; an unknown job is refused by name."""
    calls = []
    monkeypatch.setattr("fedpartial_tools.run.simulator.simulate", lambda job, root, ws, sets, log=None, **kw: calls.append((job, ws, sets)))
    monkeypatch.setattr("fedpartial_tools.data.partition.split_file", lambda *a, **k: None)
    monkeypatch.setattr("fedpartial_tools.data.sites.dataset_overrides", lambda d: [])
    monkeypatch.setattr(bench_run, "_evaluate_row", lambda name, suite, job, seed, ws, source, sec, *scored: {"method": job})
    src = tmp_path / "dsb2018_nuclei_256.npz"
    src.write_bytes(b"")
    rows = bench_run.run_suite("fedia-dsb-m2", str(tmp_path), seeds=[0], data_dir=str(tmp_path),
                               jobs=["fedia_no_correction"], diagnostics=True, overlay_images=0, log=lambda *_: None)
    (job, ws, sets), = calls
    assert job.endswith(os.path.join("jobs", "fedia")) and ws.endswith(os.path.join("seed0", "fedia_no_correction"))
    assert "rule_args.use_correction=false" in sets and bench_run.REFERENCE_SET in sets
    assert rows[0]["method"] == "fedia_no_correction"
    with pytest.raises(ValueError, match="no job.*fedia_typo"):
        bench_run.run_suite("fedia-dsb-m2", str(tmp_path), seeds=[0], data_dir=str(tmp_path), jobs=["fedia_typo"])


def test_auc_axis_floor_keeps_low_bars_visible():
    from fedpartial_tools.bench.plots import auc_axis_floor

    assert auc_axis_floor([0.9, 0.55]) == 0.4  # the usual floor
    assert auc_axis_floor([0.9, 0.376, float("nan")]) == pytest.approx(0.3)  # CT-ICH Subdural, 0.376
    assert auc_axis_floor([0.298]) == pytest.approx(0.2)
    assert auc_axis_floor([float("nan")]) == 0.4


_SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.mark.skipif(not _SHARED.is_dir(), reason=f"real data folder {_SHARED} is absent")
@pytest.mark.parametrize("name", sorted(bench_suites.SUITES))
def test_every_profile_builds_a_model_that_runs_on_its_data(name):
    """Each profile's settings (the GPU one does not run in CI) give every job of the suite a model
    that takes the profile's data at its image size (e.g. DenseNet-121 on HAM10000 at 64 px)."""
    import torch

    from fedpartial.flare.common import build_model_from_settings, model_settings
    from fedpartial_tools.jobs.settings import _config_paths, apply_overrides

    suite = bench_suites.SUITES[name]
    for profile, sets in suite.overrides.items():
        if suite.generator:  # made by the bench, not in ../shared/data
            from fedpartial_tools.data import synthetic
            images, names = getattr(synthetic, suite.generator)(n_train=2, n_val=2, n_test=2).splits["test"].images, \
                ["lesion"]
        else:
            with np.load(_SHARED / suite.dataset_for(profile), allow_pickle=True) as raw:
                images = raw["test_images"][:2]
                names = [str(n) for n in raw["label_names"]] if "label_names" in raw.files else ["lesion"]
        size = list(images.shape[1:3])
        channels = 1 if images.ndim == 3 else images.shape[-1]
        for job in suite.jobs:
            folder = find_job(suite.job_folder(job))
            configs = {side: json.load(open(path)) for side, path in _config_paths(str(folder)).items()}
            apply_overrides(configs, [f"model.input_size={json.dumps(size)}", f"model.in_channels={channels}",
                                      *([] if "dice" in suite.metrics else [f"model.class_names={json.dumps(names)}"]),
                                      *sets, *suite.variants.get(job, [])])
            settings = model_settings(configs["server"]["model"])
            model = build_model_from_settings(settings).eval()
            h, w = [s or d for s, d in zip(settings["input_size"], size)]
            with torch.no_grad():
                out = model(torch.zeros(2, channels, h, w))
            logits = out[1] if isinstance(out, tuple) else out
            assert logits.shape[0] == 2 and logits.shape[1] == settings["num_classes"], (name, profile, job)


def test_a_profile_on_other_data_refuses_a_split_made_from_another_file(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "ham10000_64.npz").write_bytes(b"")  # only its name matters before the check
    sites = tmp_path / "out" / "fedlsm-ham" / "seed0" / "sites"
    sites.mkdir(parents=True)
    (sites / "split_summary.json").write_text(json.dumps({"source": "/data/ham10000_28.npz"}))
    with pytest.raises(ValueError, match=r"split from ham10000_28.npz, but the gpu profile .* ham10000_64.npz"):
        bench_run.run_suite("fedlsm-ham", str(tmp_path / "out"), seeds=[0], profile="gpu", data_dir=str(data_dir),
                            log=lambda *_: None)


def test_reports_list_suites_in_suite_order_whatever_the_row_order():
    rows = [{"suite": "fedia-dsb-m2"}, {"suite": "fedlsm-ham"}, {"suite": "fedirm-ham"}, {"suite": "fedlsm-ham"}]
    assert bench_suites.suites_of(rows) == ["fedlsm-ham", "fedirm-ham", "fedia-dsb-m2"]


def test_rows_from_before_a_suite_scored_a_metric_show_a_dash(tmp_path):
    """A results.csv written before fedirm-ham scored best_global_model.pt (no auc_best / f1_best
    column), appended to by a run that scores it: the old rows show "–", the new ones their values."""
    old = _rows("fedirm-ham", [0], jobs=["fedavg", "fedavg_full", "fedirm", "fedirm_labelled_only"])
    for r in old:
        del r["auc_best"], r["f1_best"]
    tables.write_reports(old, str(tmp_path))
    rows = tables.read_rows(str(tmp_path / "results.csv"))
    new = _rows("fedirm-ham", [1], jobs=["fedavg", "fedavg_full", "fedirm"])
    for r in new:
        r["auc_best"] = {"fedavg": 0.8, "fedavg_full": 0.9, "fedirm": 0.86}[r["method"]]
    md = tables.write_reports(rows + new, str(tmp_path))
    head = next(line for line in md.splitlines() if line.startswith("| job"))
    fedirm = next(line for line in md.splitlines() if line.startswith("| fedirm |"))
    column = head.split(" | ").index("auc_best")
    assert fedirm.split(" | ")[column] == "0.860"  # seed 1 only: seed 0 never scored it
    alone = next(line for line in md.splitlines() if line.startswith("| fedirm_labelled_only |"))
    assert alone.split(" | ")[column] == "–" and alone.split(" | ")[1] == "0.500"  # old rows only
    fedirm_best = {r["seed"]: r["auc_best"] for r in tables.read_rows(str(tmp_path / "results.csv"))
                   if r["method"] == "fedirm"}
    assert fedirm_best == {0: "", 1: pytest.approx(0.86)}  # the old row's cell stays empty


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_every_baseline_runs_with_its_methods_model_and_recipe(profile):
    """A row compares rules: in every suite each baseline gets the method's network, image size,
    rounds and whole local recipe (the bench's matched_sets)."""
    from fedpartial_tools.bench.suites import job_settings, matched_sets
    from fedpartial_tools.jobs.matching import SHARED_MODEL_KEYS, recipe_of

    for name, suite in bench_suites.SUITES.items():
        method_task = job_settings(suite.method)["model"]["task"]
        # what dataset_overrides would set from the site files: the same for every job of a suite
        data_sets = ['model.class_names=["a","b","c"]', f"model.task={method_task}", "model.in_channels=1",
                     "model.input_size=[32,32]"]
        sets = data_sets + list(suite.overrides.get(profile, [])) + ["seed=0"]
        method = job_settings(suite.method, sets)
        for job in suite.jobs:
            got = job_settings(suite.job_folder(job), sets + matched_sets(suite, job, sets) + suite.variants.get(job, []))
            assert got["num_rounds"] == method["num_rounds"], (name, job)
            for key in SHARED_MODEL_KEYS:
                assert got["model"].get(key) == method["model"].get(key), (name, profile, job, key)
            if got["rule"] == method["rule"]:
                continue  # the method itself or one of its variants
            for key, theirs in recipe_of(method["rule"], method["rule_args"]).items():
                assert got["rule_args"][key] == theirs, (name, profile, job, key, got["rule_args"][key], theirs)
    # the check has teeth: without matching, fedmlp's baselines would run a shallower network
    suite = bench_suites.SUITES["fedmlp-ctich"]
    assert any(s.startswith("model.arch_args=") for s in matched_sets(suite, "fedavg", suite.overrides["cpu"]))


def test_shipped_method_jobs_are_the_cpu_profile_of_their_tables():
    """The CPU-profile figures (README's results, docs/RESULTS.md) are what the jobs do as shipped
    (docs/METHODS.md): the bench's CPU profile changes nothing on a suite's method job except the
    departures the suite names, with a reason."""
    from fedpartial_tools.bench.suites import profile_departures

    for name, suite in bench_suites.SUITES.items():
        changed = profile_departures(suite, "cpu")
        undeclared = [k for k in changed if k not in suite.cpu_departures]
        assert not undeclared, f"{name}: the CPU profile changes {undeclared} of jobs/{suite.method} without a reason"
        assert all(suite.cpu_departures[k] for k in changed)
    # the check has teeth: the GPU profile (a bigger network) does change the shipped job
    assert "model.arch" in profile_departures(bench_suites.SUITES["fedlsm-ham"], "gpu")


def test_shifted_test_metrics_come_from_the_shifted_images(tmp_path, monkeypatch):
    """fedlsm-ham reports auc_shift / f1_shift: the final model scored on acquisition_shift(test)."""
    import torch

    from fedpartial.data.npz import save_npz
    from fedpartial.evaluation import evaluate_split
    from fedpartial.models import build_model, save_model_file
    from fedpartial_tools.data import synthetic

    suite = bench_suites.SUITES["fedlsm-ham"]
    assert suite.shifted_test == "acquisition_shift" and {"auc_shift", "f1_shift"} <= set(suite.metrics)
    data = synthetic.make_classification("single-label", num_classes=3, n_train=8, n_val=4, n_test=40,
                                         size=8, channels=3, seed=0)
    source = str(tmp_path / "d.npz")
    save_npz(data, source)
    torch.manual_seed(0)
    model = build_model("small_cnn", 3, 3, width=4, depth=1)
    norm = {"mean": 0.5, "std": 0.25}
    save_model_file(tmp_path / "global_model.pt", model, {"class_names": data.class_names, "task": "single-label",
                                                          "input_size": [8, 8], "normalisation": norm})
    (tmp_path / "metrics.json").write_text(json.dumps({"rounds": [{"round": 0, "sites": {}}]}))
    called = []
    real = synthetic.acquisition_shift
    monkeypatch.setattr(synthetic, "acquisition_shift", lambda x: called.append(x.shape) or real(x))
    row = bench_run._evaluate_row("fedlsm-ham", suite, "fedlsm", 0, str(tmp_path), source, 1.0)
    assert called == [(40, 8, 8, 3)]
    test = data.splits["test"]
    shifted = dataclasses.replace(test, images=real(np.asarray(test.images)))
    expect = evaluate_split(model, shifted, "single-label", data.class_names, norm, "cpu")
    plain = evaluate_split(model, test, "single-label", data.class_names, norm, "cpu")
    assert row["auc_shift"] == pytest.approx(expect["auc"]) and row["f1_shift"] == pytest.approx(expect["f1"])
    assert row["auc"] == pytest.approx(plain["auc"]) and row["auc"] != row["auc_shift"]


def test_fedia_lesions_job_is_what_the_real_lesion_suites_measure():
    """The leave-one-patient-out MS suites run jobs/fedia_lesions and its FedAvg baselines exactly
    as shipped (only classes and size fitted to the data), and the baselines share its model,
    rounds and recipe; fedia_lesions_paper is the same job with the paper's weighting."""
    from fedpartial_tools.bench.suites import job_settings

    for name in ("ms-p7-m2", "ms-p7-m3", "ms-p19-m2", "ms-p19-m3"):
        suite = bench_suites.SUITES[name]
        assert (suite.method, suite.lower, suite.upper) == ("fedia_lesions", "fedavg_seg_lesions",
                                                            "fedavg_seg_full_lesions")
        assert not suite.overrides and not suite.method_overrides and suite.holdout_patient in (7, 19)
        paper = job_settings("fedia_lesions", suite.variants["fedia_lesions_paper"])["rule_args"]
        assert paper["completeness_cap"] is None and paper["min_predicted_ratio"] == 0
    shipped = job_settings("fedia_lesions")
    assert shipped["model"]["arch_args"]["foreground_prior"] == 0.01
    assert shipped["rule_args"]["completeness_cap"] == 1.0 and shipped["rule_args"]["min_predicted_ratio"] == 0.5
    for baseline in ("fedavg_seg_lesions", "fedavg_seg_full_lesions"):
        base = job_settings(baseline)
        assert base["num_rounds"] == shipped["num_rounds"] and base["model"] == shipped["model"]
        assert all(base["rule_args"][k] == shipped["rule_args"][k]
                   for k in ("lr", "loss", "lesion_fraction", "batch_size", "weight_decay"))
    assert job_settings("fedia_lesions")["rule_args"]["correction_rule"] == "lesions"
    assert job_settings("fedia")["rule_args"]["correction_rule"] == "pixels"  # DSB2018's winner stays


def test_selection_scores_the_val_split_only_and_reuse_scores_the_saved_model(monkeypatch, tmp_path):
    """``--select-on val-complete`` scores each job's final model on the source's curated val split,
    never reading the test split; ``--reuse`` then scores the same saved model on test without
    training again."""
    from fedpartial.data.npz import save_npz
    from fedpartial.evaluation import evaluate_split
    import torch

    from fedpartial.models import build_model, save_model_file
    from fedpartial_tools.data import synthetic

    data = synthetic.make_classification("single-label", num_classes=3, n_train=8, n_val=30, n_test=40,
                                         size=8, channels=3, seed=0)
    (tmp_path / "data").mkdir()
    save_npz(data, str(tmp_path / "data" / "ham10000_28.npz"))
    norm = {"mean": 0.5, "std": 0.25}
    torch.manual_seed(0)
    model = build_model("small_cnn", 3, 3, width=4, depth=1)
    trained = []

    def fake_simulate(job, root, ws, sets, log=None, **kw):
        trained.append(os.path.basename(ws))
        os.makedirs(ws, exist_ok=True)
        save_model_file(os.path.join(ws, "global_model.pt"), model, {"class_names": data.class_names,
                                                                     "task": "single-label", "input_size": [8, 8],
                                                                     "normalisation": norm})
        with open(os.path.join(ws, "metrics.json"), "w") as f:
            json.dump({"rounds": [{"round": 0, "sites": {}}]}, f)

    scored = []
    real_evaluate = evaluate_split
    monkeypatch.setattr("fedpartial.evaluation.evaluate_split",
                        lambda m, split, *a, **k: scored.append(len(split)) or real_evaluate(m, split, *a, **k))
    monkeypatch.setattr("fedpartial_tools.data.partition.split_file", lambda *a, **k: None)
    monkeypatch.setattr("fedpartial_tools.data.sites.dataset_overrides", lambda root: ["model.task=single-label"])
    monkeypatch.setattr("fedpartial_tools.run.simulator.simulate", fake_simulate)
    run = lambda **kw: bench_run.run_suite("fedlsm-ham", str(tmp_path / "out"), seeds=[0], jobs=["fedavg", "fedlsm"],
                                           data_dir=str(tmp_path / "data"), log=lambda *_: None, **kw)  # noqa: E731
    rows = run(score_on="val-complete")
    assert trained == ["fedavg", "fedlsm"] and set(scored) == {30}  # 30 val images, never the 40 test images
    expect = real_evaluate(model, data.splits["val"], "single-label", data.class_names, norm, "cpu")
    assert rows[0]["scored_on"] == "val-complete" and rows[0]["auc"] == pytest.approx(expect["auc"])
    assert rows[0]["selection_metric"] == "auc"
    scored.clear()
    rows = run(reuse=True)
    assert trained == ["fedavg", "fedlsm"] and set(scored) == {40}  # nothing trained again; test scored
    assert rows[0]["scored_on"] == "test"
    rows = run(reuse=True, extra=["rule_args.lr=0.5"])  # other settings: trained again
    assert trained[2:] == ["fedavg", "fedlsm"]
    with pytest.raises(ValueError, match="score_on must be one of"):
        run(score_on="train")


def test_selection_table_ranks_the_methods_settings_by_val_mean():
    rows = [{"suite": "fedlsm-ham", "method": m, "seed": s, "auc": v, "scored_on": "val"}
            for m, values in (("fedlsm", (0.80, 0.84)), ("fedlsm_renormalised", (0.85, 0.87)), ("fedavg", (0.90, 0.90)))
            for s, v in zip((0, 1), values)]
    md = tables.selection_table("fedlsm-ham", rows)
    lines = [line for line in md.splitlines() if line.startswith("| ")][1:]
    # fedlsm_renormalised 0.86 ranks above fedlsm 0.82; the baseline is listed but never chosen, whatever its score
    assert lines[0].startswith("| 1 | fedlsm_renormalised | rule_args.renormalise_missing=true | val | 0.8600 ± 0.0141 |")
    assert lines[1].startswith("| 2 | fedlsm | as shipped | val | 0.8200 ± 0.0283 |")
    assert lines[2].startswith("|  | fedavg | baseline | val | 0.9000 ± 0.0000 |")
    assert "sites' own val, their labels" in md
    assert "Chosen on val: **fedlsm_renormalised**" in md
    assert "--jobs fedavg,fedavg_full,fedlsm_renormalised --reuse" in md
    # rows ranked on the curated complete val split get a table of their own, marked in every row
    curated = [dict(r, method="fedlsm_tau80" if r["method"] == "fedlsm" else r["method"], scored_on="val-complete",
                    auc=r["auc"] - 0.1) for r in rows]
    md = tables.selection_table("fedlsm-ham", rows + curated)
    assert md.count("Chosen on ") == 2 and "curated complete val (no site holds it)" in md
    assert "| 2 | fedlsm_tau80 | rule_args.tau=0.8 rule_args.tau_l=0.7 | val-complete | 0.7200 ± 0.0283 |" in md


def test_selection_on_the_sites_val_is_what_the_server_received(tmp_path):
    """``--select-on val`` reads no split: each site's score of the final (and best) model from the
    cross-site evaluation, averaged over the sites with a score weighted by their val images (an
    unlabelled site sends none; a NaN says nothing); segmentation ranks on the pooled Dice."""
    seed_dir = tmp_path / "fedirm-ham" / "seed0"
    (seed_dir / "sites").mkdir(parents=True)
    for site, n in (("site-1", 10), ("site-2", 30), ("site-3", 20)):
        np.savez(seed_dir / "sites" / f"{site}.npz", val_labels=np.zeros((n, 7), np.float32))
    ws = seed_dir / "fedirm"
    ws.mkdir()
    (ws / "metrics.json").write_text(json.dumps({"rounds": [{"round": 0, "sites": {}}]}))
    cross = {"site-1": {"SRV_global_model": {"auc": 0.6, "f1": 0.2, "accuracy": 0.5, "bacc": float("nan")},
                        "SRV_best_global_model": {"auc": 0.7, "f1": 0.4}},
             "site-2": {"SRV_global_model": {"auc": 0.8, "f1": 0.6, "accuracy": 0.7, "bacc": 0.5},
                        "SRV_best_global_model": {"auc": 0.9, "f1": 0.8}},
             "site-3": {"SRV_global_model": {}, "SRV_best_global_model": {}}}  # unlabelled: no score
    (ws / "cross_site_val.json").write_text(json.dumps(cross))
    suite = bench_suites.SUITES["fedirm-ham"]
    row = bench_run._evaluate_row("fedirm-ham", suite, "fedirm", 0, str(ws), "ham10000_28.npz", 1.0, "val")
    assert row["scored_on"] == "val" and row["selection_metric"] == "auc"
    assert row["auc"] == pytest.approx((10 * 0.6 + 30 * 0.8) / 40) and row["f1"] == pytest.approx(0.5)
    assert row["auc_best"] == pytest.approx((10 * 0.7 + 30 * 0.9) / 40) and row["bacc"] == 0.5
    os.remove(ws / "cross_site_val.json")
    with pytest.raises(FileNotFoundError, match="fedirm-ham fedirm: .*cross_site_val.json' is missing"):
        bench_run._evaluate_row("fedirm-ham", suite, "fedirm", 0, str(ws), "ham10000_28.npz", 1.0, "val")
    from fedpartial_tools.bench.selection import selection_key

    assert selection_key("fedia-dsb-m2", "val") == "dice_pooled"
    assert selection_key("fedia-dsb-m2", "val-complete") == bench_suites.SUITES["fedia-dsb-m2"].metrics[0]


def test_tables_give_the_sample_std_and_the_gap_share_of_the_means():
    rows = [{"suite": "fedia-dsb-m2", "method": m, "seed": s, "dice_native": v, "iou_native": v, "rounds": 30}
            for m, values in (("fedavg_seg", (0.60, 0.62)), ("fedavg_seg_full", (0.70, 0.70)), ("fedia", (0.64, 0.68)))
            for s, v in zip((0, 1), values)]
    md = tables.suite_table("fedia-dsb-m2", rows)
    assert "mean ± sample std (ddof 1) over seeds" in md
    # gap of the means: (0.66 - 0.61) / (0.70 - 0.61) = 55.6 %; std of (0.64, 0.68) = 0.02 * sqrt(2) = 0.028;
    # rows without the model-size dice / iou show "–" there
    assert "| fedia | 0.660 ± 0.028 | 0.660 ± 0.028 | – | – | 56% | 56% |" in md
    seeds = tables.per_seed_table("fedia-dsb-m2", rows, ["dice_native"])
    assert "| job | dice_native seed 0 | dice_native seed 1 |" in seeds and "| fedia | 0.640 | 0.680 |" in seeds


def test_dsb_dice_is_scored_at_the_files_own_size():
    """The 2 x 2 probabilities of the model's size are upsampled (bilinear) to the file's 4 x 4 masks:
    the upsampled map is above 0.5 on the top-left 2 x 2 only (0.9, 0.7 / 0.7, 0.55), against a 3 x 3
    lesion Dice 2*4 / (4 + 9), IoU 4 / 9; an image empty in truth and prediction scores 1."""
    from fedpartial.data.types import Split
    from fedpartial_tools.bench.native import own_size_metrics

    probs = np.array([[[0.9, 0.1], [0.1, 0.1]], [[0.1, 0.1], [0.1, 0.1]]], np.float32)
    masks = np.zeros((2, 4, 4), np.uint16)
    masks[0, :3, :3] = 7  # an instance id: > 0 is lesion
    got = own_size_metrics(probs, Split(np.zeros((2, 4, 4), np.uint8), masks))
    assert got["dice_native"] == pytest.approx((8 / 13 + 1) / 2) and got["iou_native"] == pytest.approx((4 / 9 + 1) / 2)
    assert bench_suites.SUITES["fedia-dsb-m2"].metrics[:2] == ["dice_native", "iou_native"]


def test_last_rounds_range_and_its_column():
    # last 5 of [0.1, 0.9, 0.3, 0.5, 0.4, nan, 0.6]: 0.3 0.5 0.4 (nan left out) 0.6 -> 0.6 - 0.3
    assert tables.last_rounds_range([0.1, 0.9, 0.3, 0.5, 0.4, float("nan"), 0.6]) == pytest.approx(0.3)
    assert np.isnan(tables.last_rounds_range([0.4]))
    rows = [{"suite": "fedia-dsb-m2", "method": m, "seed": s, "dice_native": 0.6, "iou_native": 0.5, "rounds": 30,
             tables.LAST_ROUNDS_KEY: v}
            for m, values in (("fedavg_seg", (0.10, 0.20)), ("fedavg_seg_full", (0.0, 0.0)), ("fedia", (0.05, 0.05)))
            for s, v in zip((0, 1), values)]
    md = tables.suite_table("fedia-dsb-m2", rows)
    assert "val dice_native range, last 5 rounds |" in md
    assert md.splitlines()[-3].endswith("| 0.150 ± 0.071 |")  # fedavg_seg: mean 0.15, std 0.1/sqrt(2)


def test_group_table_means_per_fold_and_over_folds():
    key = "dice_pooled_native"
    values = {"ms6-p7-m2": {"fedavg_seg_lesions": (0.20, 0.30), "fedavg_seg_full_lesions": (0.50, 0.50),
                            "fedia_lesions": (0.40, 0.40)},
              "ms6-p2-m3": {"fedavg_seg_lesions": (0.30, 0.30), "fedavg_seg_full_lesions": (0.40, 0.40),
                            "fedia_lesions": (0.20, 0.20)}}
    rows = [{"suite": suite, "method": job, "seed": s, key: v, "rounds": 30}
            for suite, jobs in values.items() for job, seeds in jobs.items() for s, v in zip((0, 1), seeds)]
    md = tables.group_table("ms6", rows, key)
    # p7: fedavg 0.25, full 0.5, fedia 0.4 -> gap 0.15 / 0.25 = 60 %; p2: (0.2 - 0.3) / 0.1 = -100 %
    assert "| ms6-p7-m2 | 2 | 0.250 | 0.500 | 0.400 | 60% |" in md
    assert "| ms6-p2-m3 | 2 | 0.300 | 0.400 | 0.200 | -100% |" in md
    # over folds: fedavg 0.275, full 0.45, fedia 0.30 -> 0.025 / 0.175 = 14 %
    assert "| mean of 2 suites |  | 0.275 | 0.450 | 0.300 | 14% |" in md
    # seed by seed: p7 0.4 > 0.2, 0.4 > 0.3; p2 0.2 < 0.3 twice -> 2 of 4 pairs; no device column -> '?'
    assert md.endswith("fedia_lesions below fedavg_seg_lesions (means over seeds): ms6-p2-m3; seed by seed in 2 of 4 "
                       "(fold, seed) pairs; rows from ? (12)")
    assert tables.group_table("ms6-r2", rows, key) == ""
    assert "**ms6**" in tables.markdown_table(rows)


def test_group_table_counts_the_seeds_below_inside_a_fold_whose_mean_is_above():
    # p7: seed 0 fedia 0.30 < fedavg 0.35, seed 1 0.60 > 0.20: the means (0.45 > 0.275) name no fold
    key = "dice_pooled_native"
    values = {"fedavg_seg_lesions": (0.35, 0.20), "fedavg_seg_full_lesions": (0.70, 0.70), "fedia_lesions": (0.30, 0.60)}
    rows = [{"suite": "ms6-p7-m3", "method": job, "seed": s, key: v, "device": d}
            for job, seeds in values.items() for s, v, d in zip((0, 1), seeds, ("NVIDIA H200", "cpu"))]
    md = tables.group_table("ms6", rows, key)
    assert md.endswith("(means over seeds): on no suite; seed by seed in 1 of 2 (fold, seed) pairs; "
                       "rows from NVIDIA H200 (3), cpu (3)")


def test_no_gap_share_where_the_upper_bound_is_not_above_the_lower():
    assert tables.gap_closed(0.60, 0.50, 0.70) == pytest.approx(0.5)
    # FedAvg full 0.632 below FedAvg partial 0.638: (0.573 - 0.638) / (-0.006) would read as 1083 %
    assert np.isnan(tables.gap_closed(0.573, 0.638, 0.632))
    assert np.isnan(tables.gap_closed(0.6, 0.5, 0.5))


def test_group_table_of_a_run_without_the_method():
    # a bench run of the baselines only: the table has their means and no share, and names no fold
    key = "dice_pooled_native"
    rows = [{"suite": "ms6-p7-m2", "method": job, "seed": 0, key: v, "rounds": 30}
            for job, v in (("fedavg_seg_lesions", 0.2), ("fedavg_seg_full_lesions", 0.5))]
    md = tables.group_table("ms6", rows, key)
    assert "| ms6-p7-m2 | 1 | 0.200 | 0.500 | – |" in md
    assert md.endswith("fedia_lesions below fedavg_seg_lesions (means over seeds): on no suite; rows from ? (2)")
