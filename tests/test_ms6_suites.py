"""The ms6 bench suites: six MS patients of two sources brought to the input agreement, one held
out in turn (test), a seeded share of the others' slices as val, the rest at 4 sites; the jobs'
agreement; the native-resolution Dice; the second rater. Built on tiny hand-made sources with
the shared files' names (the simulator is mocked: nothing trains)."""
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from fedpartial.data.grid import AGREEMENT_KEY, InputAgreement, load_agreement
from fedpartial.data.npz import load_npz
from fedpartial.data.types import DataError
from fedpartial_tools.bench import cli as bench, runner as bench_run, sources as bench_sources, suites as bench_suites
from fedpartial_tools.bench.suites import MS6_PATIENTS, SUITE_GROUPS, SUITES, job_settings, suite_names
from fedpartial_tools.cli import build_parser
from fedpartial_tools.data.harmonise import harmonise_arrays
from fedpartial_tools.data.combine import (ROW_ID_BASE, StatedSource, back_to_native, combine_sources, dice_pooled_native,
                                           hold_out_patient, rater_agreement, rater_agreement_file)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
AGREEMENT = load_agreement(str(REPO / "provisioning" / "input_agreement.json"))
MNI, ISBI = "ms_flair_2patients.npz", "ms_flair_isbi2015_4patients.npz"
SLICES = 10  # per tiny patient: round(0.15 * 10) = 2 val slices


# ---- tiny sources with the shared files' names and geometry ---------------------------------------
def _disc(shape, cy, cx, r):
    yy, xx = np.mgrid[:shape[0], :shape[1]]
    return ((yy - cy) ** 2 + (xx - cx) ** 2 <= r * r).astype(np.uint8)


def _patient(p, shape, rng):
    """SLICES slices: a bright 'head' block, a lesion disc on every other slice (placed by the
    patient id, so each patient differs)."""
    images = np.zeros((SLICES, *shape), np.uint8)
    images[:, 4:shape[0] - 4, 4:shape[1] - 4] = 90 + rng.integers(0, 20, (SLICES, shape[0] - 8, shape[1] - 8))
    masks = np.zeros((SLICES, *shape), np.uint8)
    for s in range(0, SLICES, 2):
        masks[s] = _disc(shape, 10 + p % 7 + s, 12 + s, 3)
    images[masks > 0] = 200
    return images, masks


def _write_sources(folder: Path):
    """MNI-like: patients 7, 19, 30 x 34 at 1 mm (LAS); ISBI-like: patients 2-5, 36 x 36 at
    0.83 mm (PLS) with a second rater whose lesion is the first rater's shifted by 2 columns."""
    rng = np.random.default_rng(0)
    for name, patients, shape, second in ((MNI, (7, 19), (30, 34), False), (ISBI, (2, 3, 4, 5), (36, 36), True)):
        parts = {"train_images": [], "train_masks": [], "train_masks_rater2": [], "train_patient_ids": [],
                 "train_slice_ids": []}
        for p in patients:
            images, masks = _patient(p, shape, rng)
            parts["train_images"].append(images)
            parts["train_masks"].append(masks)
            parts["train_masks_rater2"].append(np.roll(masks, 2, axis=2))
            parts["train_patient_ids"].append(np.full(SLICES, p, np.int16))
            parts["train_slice_ids"].append(np.arange(SLICES, dtype=np.int16)[::-1])  # stored out of order
        arrays = {k: np.concatenate(v) for k, v in parts.items()}
        if not second:
            del arrays["train_masks_rater2"]
        arrays["class_names"] = np.array(["background", "lesion"])
        np.savez_compressed(folder / name, **arrays)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shared")
    _write_sources(folder)
    return folder


# ---- suite definitions ----------------------------------------------------------------------------
def test_ms6_group_is_six_patients_by_two_completeness_settings():
    names = SUITE_GROUPS["ms6"]
    assert len(names) == 12 and set(MS6_PATIENTS) == {7, 19, 2, 3, 4, 5}
    assert {(SUITES[n].holdout_patient, n[-1]) for n in names} == {(p, m) for p in MS6_PATIENTS for m in "23"}
    files = {s.file for s in bench_suites.MS6_SOURCES}
    assert files == {MNI, ISBI}
    for name in names:
        suite = SUITES[name]
        m = int(name[-1])
        assert suite.split_options == {"completeness": {2: [0.2, 0.4, 0.6, 0.8], 3: [0.1, 0.3, 0.5, 0.7]}[m]}
        assert suite.sites == 4 and suite.scenario == "incomplete-masks"
        assert suite.jobs == ["fedavg_seg_lesions", "fedavg_seg_full_lesions", "fedia_lesions",
                              "fedia_lesions_correction", "fedia_lesions_paper_weighting", "fedia_lesions_paper"]
        assert suite.combine == bench_suites.MS6_SOURCES and suite.val_fraction == 0.15 and not suite.rater2_sites
        assert {"dice_pooled", "dice_pooled_native", "dice_pooled_native_best"} <= set(suite.metrics)
    # every source gives at least two folds
    mni = {SUITES[n].holdout_patient for n in names} & {7, 19}
    isbi = {SUITES[n].holdout_patient for n in names} & {2, 3, 4, 5}
    assert len(mni) == 2 and len(isbi) == 4
    assert SUITE_GROUPS["ms6-r2"] == [f"ms6-p{p}-r2" for p in MS6_PATIENTS]
    assert all(SUITES[n].rater2_sites == ("site-1", "site-2") and SUITES[n].split_options == {"completeness": [1.0] * 4}
               for n in SUITE_GROUPS["ms6-r2"])


def test_ms6_jobs_carry_the_agreement_on_server_and_client():
    """Every job gets model.input_agreement on both sides and model.input_size = the agreement's
    size; fedia_lesions_paper is the correction with the paper's weighting; the baselines still
    share the method's model and recipe; the departures from the shipped job are declared."""
    import torch

    from fedpartial.flare.common import build_model_from_settings, model_settings
    from fedpartial_tools.jobs.folders import find_job
    from fedpartial_tools.jobs.matching import recipe_of
    from fedpartial_tools.jobs.settings import _components as settings_components
    from fedpartial_tools.jobs.settings import _config_paths, apply_overrides

    suite = SUITES["ms6-p3-m2"]
    sets = suite.agreement_sets()
    assert sets[2] == "model.input_size=[192,224]"
    data_sets = ['model.class_names=["lesion"]', "model.task=segmentation", "model.in_channels=1",
                 "model.input_size=[192,224]", "seed=0"]
    method = job_settings(suite.method, data_sets + sets)
    for job in suite.jobs:
        job_sets = (data_sets + sets + bench_suites.matched_sets(suite, job, data_sets + sets)
                    + suite.variants.get(job, []))
        got = job_settings(suite.job_folder(job), job_sets)  # the server's model block
        assert got["model"][AGREEMENT_KEY] == AGREEMENT.to_dict() and got["model"]["input_size"] == [192, 224]
        configs = {side: json.load(open(path)) for side, path in _config_paths(find_job(suite.job_folder(job))).items()}
        apply_overrides(configs, job_sets)
        assert configs["client"]["model"][AGREEMENT_KEY] == AGREEMENT.to_dict(), job
        settings = model_settings(configs["client"]["model"])  # the executor's check passes
        if job != suite.method:
            for key in ("arch", "arch_args", "input_size", "normalisation"):
                assert got["model"][key] == method["model"][key], (job, key)
            if got["rule"] != method["rule"]:
                for key, theirs in recipe_of(method["rule"], method["rule_args"]).items():
                    assert got["rule_args"][key] == theirs, (job, key)
    with torch.no_grad():
        out = build_model_from_settings(settings).eval()(torch.zeros(1, 1, 192, 224))
    assert (out[1] if isinstance(out, tuple) else out).shape[-2:] == (192, 224)
    paper = job_settings("fedia_lesions", sets + suite.variants["fedia_lesions_paper"])["rule_args"]
    assert paper["use_correction"] is True and paper["completeness_cap"] is None and paper["min_predicted_ratio"] == 0
    configs = {side: json.load(open(path)) for side, path in _config_paths(find_job("fedia:lesions")).items()}
    apply_overrides(configs, sets + suite.variants["fedia_lesions_paper"])
    server = next(a for c, a in settings_components(configs["server"]) if c.endswith("RuleAggregator"))["rule_args"]
    assert server["completeness_max"] is None and server["max_weight_ratio"] is None  # the server's guards off
    assert job_settings("fedia_lesions", sets)["rule_args"]["use_correction"] is False  # as shipped
    assert bench_suites.profile_departures(suite) == ["model.input_agreement", "model.input_size"]
    assert set(suite.cpu_departures) == {"model.input_agreement", "model.input_size"}


# ---- the data: combined, held out, split --------------------------------------------------------
def _fake_run(monkeypatch):
    calls = []
    monkeypatch.setattr("fedpartial_tools.run.simulator.simulate",
                        lambda job, root, ws, sets, log=None: calls.append((os.path.basename(job), root, list(sets))))
    monkeypatch.setattr(bench_run, "_evaluate_row", lambda name, suite, job, seed, ws, source, sec, *scored: {
        "suite": name, "method": job, "seed": seed})
    return calls


def _site_ids(split_dir, key="ids"):
    out = {}
    for f in sorted(os.listdir(split_dir)):
        if f.endswith(".npz"):
            with np.load(os.path.join(split_dir, f)) as z:
                out[f[:-4]] = {s: z[f"{s}_{key}"] for s in ("train", "val") if f"{s}_{key}" in z.files}
    return out


def test_held_out_patient_is_never_in_training_or_val(sources, tmp_path, monkeypatch):
    calls = _fake_run(monkeypatch)
    out = tmp_path / "out"
    bench_run.run_suite("ms6-p3-m2", str(out), seeds=[0], data_dir=str(sources), overlay_images=0,
                        log=lambda *_: None)
    combined = load_npz(str(out / "_data" / "ms6_flair_agreed.npz"))
    assert sorted(set(combined.splits["train"].groups.tolist())) == [2, 3, 4, 5, 7, 19]
    assert combined.splits["train"].images.shape[1:] == (192, 224)
    held = load_npz(str(out / "_data" / "ms6_flair_agreed_holdout3_val15.npz"))
    patient = {s: np.asarray(held.splits[s].ids) // ROW_ID_BASE for s in ("train", "val", "test")}
    assert set(patient["test"].tolist()) == {3} and len(patient["test"]) == SLICES
    assert list(np.asarray(held.splits["test"].ids) % ROW_ID_BASE) == list(range(SLICES))  # slice-id order
    for split in ("train", "val"):
        assert 3 not in set(patient[split].tolist()) and held.splits[split].groups is None
    # val: 2 of each training patient's 10 slices; train: the other 8
    assert {p: int((patient["val"] == p).sum()) for p in (2, 4, 5, 7, 19)} == {p: 2 for p in (2, 4, 5, 7, 19)}
    assert {p: int((patient["train"] == p).sum()) for p in (2, 4, 5, 7, 19)} == {p: 8 for p in (2, 4, 5, 7, 19)}
    assert held.info[AGREEMENT_KEY] == AGREEMENT.to_dict() and held.info["held_out_patient"] == 3
    assert held.info["native"]["file"] == ISBI and held.info["native"]["orientation"] == "PLS"
    # the site files: no row of patient 3, every training and val row somewhere, the agreement recorded
    sites = _site_ids(str(out / "ms6-p3-m2" / "seed0" / "sites"))
    references = _site_ids(str(out / "ms6-p3-m2" / "seed0" / "sites" / "reference"))
    assert len(sites) == 4 and len(references) == 4
    assert all(np.array_equal(references[f"{k}_full"][s], v[s]) for k, v in sites.items() for s in ("train", "val"))
    seen = {s: np.concatenate([v[s] for v in sites.values()]) for s in ("train", "val")}
    for split in ("train", "val"):
        assert not any(i // ROW_ID_BASE == 3 for i in seen[split].tolist())
        assert sorted(seen[split].tolist()) == sorted(np.asarray(held.splits[split].ids).tolist())
    site = load_npz(str(out / "ms6-p3-m2" / "seed0" / "sites" / "site-1.npz"))
    assert site.info[AGREEMENT_KEY] == AGREEMENT.to_dict() and site.splits["train"].images.shape[1:] == (192, 224)
    # every job ran with the agreement on both sides, after the data's own size
    assert len(calls) == len(SUITES["ms6-p3-m2"].jobs)
    for _, _, sets in calls:
        assert set(SUITES["ms6-p3-m2"].agreement_sets()) <= set(sets)
    # a patient's val slices do not depend on which patient is held out
    bench_sources.suite_source(SUITES["ms6-p7-m3"], "cpu", str(sources), str(out))
    other = load_npz(str(out / "_data" / "ms6_flair_agreed_holdout7_val15.npz"))
    def val_ids(data, p):
        return sorted(i for i in np.asarray(data.splits["val"].ids).tolist() if i // ROW_ID_BASE == p)

    assert all(val_ids(held, p) == val_ids(other, p) for p in (2, 4, 5, 19))
    assert not any(i // ROW_ID_BASE == 7 for s in ("train", "val") for i in np.asarray(other.splits[s].ids).tolist())


def test_selection_on_val_never_reads_the_held_out_patient(sources, tmp_path, monkeypatch):
    """The selection's own scoring (``_evaluate_row``, not replaced here): ``--select-on val-complete``
    scores the held-out file's val split, which holds no slice of the patient, and never its test
    split; ``--select-on val`` reads no source split at all, only what the sites' validation sent."""
    import fedpartial.evaluation as evaluation
    from fedpartial.metrics import validation_metrics

    def fake_simulate(job, root, ws, sets, log=None):
        os.makedirs(ws, exist_ok=True)
        Path(ws, "metrics.json").write_text(json.dumps({"rounds": [{"round": 0, "sites": {}}]}))
        site = {"tp": 5, "fp": 1, "fn": 4, "n_images": 3, "predicted_lesion_share": 1.0, "dice_pooled": 10 / 15}
        Path(ws, "cross_site_val.json").write_text(json.dumps(
            {f"site-{k}": {"SRV_global_model": site, "SRV_best_global_model": site} for k in range(1, 5)}))

    monkeypatch.setattr("fedpartial_tools.run.simulator.simulate", fake_simulate)
    scored = []
    monkeypatch.setattr(evaluation, "predict_split", lambda m, split, *a, **k: (np.asarray(split.labels) > 0) * 1.0)
    monkeypatch.setattr(evaluation, "evaluate_split", lambda m, split, *a, **k: scored.append(split.ids) or
                        validation_metrics(np.asarray(split.labels) > 0, np.asarray(split.labels) > 0))
    monkeypatch.setattr(bench_run, "load_for_eval", lambda ws, data, device: (None, {"normalisation": {}}, data))
    rows = bench_run.run_suite("ms6-p19-m3", str(tmp_path), seeds=[1], jobs=["fedia_lesions"], data_dir=str(sources),
                               score_on="val-complete", log=lambda *_: None)
    (ids,) = scored
    assert len(ids) == 10 and not any(i // ROW_ID_BASE == 19 for i in np.asarray(ids).tolist())
    assert rows[0]["scored_on"] == "val-complete" and rows[0]["dice_pooled"] == 1.0
    scored.clear()
    monkeypatch.setattr(bench_run, "load_npz", lambda *a: pytest.fail("read a source split"), raising=False)
    rows = bench_run.run_suite("ms6-p19-m3", str(tmp_path), seeds=[1], jobs=["fedia_lesions"], data_dir=str(sources),
                               score_on="val", log=lambda *_: None)
    assert not scored and rows[0]["scored_on"] == "val" and rows[0]["selection_metric"] == "dice_pooled"
    assert rows[0]["dice_pooled"] == pytest.approx(2 * 20 / (2 * 20 + 4 + 16))  # pooled over the 4 sites' pixels


def test_combining_refuses_a_patient_id_in_two_sources(sources, tmp_path):
    twice = (StatedSource(MNI, (1.0, 1.0), "LAS"), StatedSource(str(sources / MNI), (1.0, 1.0), "LAS"))
    with pytest.raises(DataError, match="patient id 7 is in both"):
        combine_sources(twice, AGREEMENT, str(sources))
    with pytest.raises(DataError, match="patient 6 is not one of several patients"):
        path = tmp_path / "c.npz"
        from fedpartial.data.arrays import atomic_savez
        atomic_savez(str(path), combine_sources(bench_suites.MS6_SOURCES[:1], AGREEMENT, str(sources))[0])
        hold_out_patient(str(path), 6, str(tmp_path / "h.npz"))


def test_a_file_made_with_another_agreement_is_refused(sources, tmp_path):
    suite = SUITES["ms6-p2-m2"]
    made = bench_sources.suite_source(suite, "cpu", str(sources), str(tmp_path))
    other = InputAgreement.from_dict({"size": [160, 192]})
    from fedpartial_tools.data.combine import combine_npz

    combine_npz(suite.combine, other, str(tmp_path / "_data" / suite.dataset), str(sources))
    os.remove(made)
    with pytest.raises(ValueError, match=r"another input agreement .*size.*give another --out"):
        bench_sources.suite_source(suite, "cpu", str(sources), str(tmp_path))


# ---- the one command --------------------------------------------------------------------------------
def test_suite_group_expands_to_its_suites(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(bench, "plan_suite", lambda name, out, seeds, **kw: ran.append((name, tuple(seeds))) or ([], "{}"))
    monkeypatch.setattr(bench, "run_trainings", lambda trainings, **kw: [])
    monkeypatch.setattr(bench, "write_reports", lambda rows, out: "")
    monkeypatch.setattr(bench, "_readme_and_copies", lambda args: None)
    parser = build_parser(developer=True)
    args = parser.parse_args(["bench", "--suite-group", "ms6", "--seeds", "0,1,2", "--out", str(tmp_path)])
    args.func(args)
    assert [n for n, _ in ran] == SUITE_GROUPS["ms6"] and {s for _, s in ran} == {(0, 1, 2)}
    ran.clear()
    args = parser.parse_args(["bench", "--suite", "ms6-p3-m2", "--suite-group", "ms6", "--suite-group", "ms6-r2",
                              "--out", str(tmp_path)])
    args.func(args)
    assert [n for n, _ in ran] == ["ms6-p3-m2"] + [n for n in SUITE_GROUPS["ms6"] if n != "ms6-p3-m2"] + \
        SUITE_GROUPS["ms6-r2"]
    args = parser.parse_args(["bench", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--suite NAME or --suite-group"):
        args.func(args)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--suite-group", "ms7", "--out", "x"])
    with pytest.raises(ValueError, match="unknown suite group"):
        suite_names([], ["ms7"])
    assert suite_names(["fedlsm-ham"]) == ["fedlsm-ham"]


# ---- the native-resolution Dice ---------------------------------------------------------------------
def _harmonised(images, masks, spacing, orientation, patient=1):
    arrays = {"train_images": images, "train_masks": masks, "train_patient_ids": np.full(len(images), patient),
              "train_slice_ids": np.arange(len(images))}
    return harmonise_arrays(arrays, AGREEMENT, spacing, orientation)[0]


def test_native_dice_by_hand_on_the_mni_grid():
    """1 mm LAS, 182 x 218: the agreed grid is the native one flipped in rows (R <- L) and padded
    by 5 rows / 3 columns on each side, so the way back is exact. A 4 x 4 lesion predicted
    perfectly scores 1; predicted one column to the side (on the agreed grid) it overlaps 4 x 3:
    Dice = 2 * 12 / (16 + 16) = 0.75."""
    images = np.full((3, 182, 218), 10, np.uint8)
    images[:, 20:160, 20:200] = 100
    masks = np.zeros((3, 182, 218), np.uint8)
    masks[1, 50:54, 60:64] = 1
    grid = _harmonised(images, masks, (1.0, 1.0), "LAS")["train_masks"].astype(np.float32)
    rows, cols = np.nonzero(grid[1])
    assert (rows.min(), rows.max(), cols.min(), cols.max()) == (181 - 53 + 5, 181 - 50 + 5, 63, 66)
    assert dice_pooled_native(grid, images, masks, (1.0, 1.0), "LAS", AGREEMENT) == 1.0
    shifted = np.roll(grid, 1, axis=2)
    assert dice_pooled_native(shifted, images, masks, (1.0, 1.0), "LAS", AGREEMENT) == pytest.approx(0.75)
    back = back_to_native(shifted, images, (1.0, 1.0), "LAS", AGREEMENT)
    assert back.shape == masks.shape and np.array_equal(np.argwhere(back[1] > 0.5)[[0, -1]], [[50, 61], [53, 64]])
    # two rows off in the other slice direction: 4 x 2 overlap -> 2 * 8 / 32 = 0.5
    assert dice_pooled_native(np.roll(grid, 2, axis=1), images, masks, (1.0, 1.0), "LAS", AGREEMENT) == \
        pytest.approx(0.5)


def test_native_dice_at_0_83_mm_and_with_reversed_slices():
    """A drawn ISBI-like mask (0.83 mm, PLS) brought to the grid (nearest neighbour) and back
    (bilinear, threshold 0.5) is the same mask up to interpolation: a perfect prediction scores
    ~1. The same slices stored with slice ids running downwards (PLI: the agreement reverses the
    stack) still score ~1 slice for slice; the slices in the wrong order score ~0."""
    images = np.full((4, 256, 256), 10, np.uint8)
    images[:, 30:220, 40:210] = 100
    masks = np.stack([_disc((256, 256), cy, cx, r) for cy, cx, r in ((100, 100, 8), (120, 150, 6), (80, 60, 10),
                                                                      (150, 120, 5))])
    for orientation in ("PLS", "PLI"):
        grid = _harmonised(images, masks, (0.83, 0.83), orientation)["train_masks"].astype(np.float32)
        assert grid.shape == (4, 192, 224)
        assert grid.sum() == pytest.approx(masks.sum() * 0.83 ** 2, rel=0.05)
        perfect = dice_pooled_native(grid, images, masks, (0.83, 0.83), orientation, AGREEMENT)
        assert 0.95 < perfect <= 1.0, orientation
        assert dice_pooled_native(grid[::-1], images, masks, (0.83, 0.83), orientation, AGREEMENT) < 0.05
    assert np.isnan(dice_pooled_native(np.zeros((4, 192, 224)), images, 0 * masks, (0.83, 0.83), "PLS", AGREEMENT))


def test_rows_scored_natively_are_the_held_out_patients_slices(sources, tmp_path, monkeypatch):
    """_evaluate_row adds dice_pooled_native (and _best) on the test split: a perfect prediction
    on the agreed grid scores 1 at 1 mm (MNI patient 7) and ~1 at 0.83 mm (ISBI patient 3); on
    val it is NaN (val holds parts of patients). Rows out of order are refused."""
    import fedpartial.evaluation as evaluation
    import fedpartial.models.io as model_io
    from fedpartial.metrics import validation_metrics

    perfect = lambda model, split, *a, **k: (np.asarray(split.labels) > 0).astype(np.float32)  # noqa: E731
    monkeypatch.setattr(evaluation, "predict_split", perfect)
    monkeypatch.setattr(evaluation, "evaluate_split", lambda m, split, *a, **k: validation_metrics(
        np.asarray(split.labels) > 0, np.asarray(split.labels) > 0))
    monkeypatch.setattr(bench_run, "load_for_eval", lambda ws, data, device: (None, {"normalisation": {}}, data))
    monkeypatch.setattr(model_io, "load_model_file", lambda path, device=None: (None, {}))
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "metrics.json").write_text(json.dumps({"rounds": [{"round": 0, "sites": {}}]}))
    (ws / "best_global_model.pt").write_bytes(b"")
    for name, low in (("ms6-p7-m2", 1.0), ("ms6-p3-m2", 0.9)):
        source = bench_sources.suite_source(SUITES[name], "cpu", str(sources), str(tmp_path))
        row = bench_run._evaluate_row(name, SUITES[name], "fedia_lesions", 0, str(ws), source, 1.0)
        assert low <= row["dice_pooled_native"] <= 1.0 and row["dice_pooled_native_best"] == row["dice_pooled_native"]
        assert row["dice_pooled"] == 1.0
        val = bench_run._evaluate_row(name, SUITES[name], "fedia_lesions", 0, str(ws), source, 1.0, "val-complete")
        assert np.isnan(val["dice_pooled_native"])
    test = load_npz(source).splits["test"]
    shuffled = test.subset(np.arange(len(test))[::-1])
    with pytest.raises(DataError, match="not the slices of patient 3"):
        bench_run.native_scorer(load_npz(source).info, shuffled, source)
    assert bench_run.native_scorer({}, test, source) is None


# ---- the second rater ---------------------------------------------------------------------------------
def test_rater_agreement_by_hand():
    """Patient 1: rater A 4 pixels, rater B 3 of which 2 are A's -> 2*2 / (4+3) = 4/7.
    Patient 2: both empty -> NaN. Patient 3: the same 2 pixels -> 1.
    Pooled: TP 4, A 6, B 5 -> 8 / 11."""
    a = np.zeros((3, 4, 4), np.uint8)
    b = np.zeros_like(a)
    a[0, 0:2, 0:2] = 1
    b[0, 0, 0:2] = 1
    b[0, 3, 3] = 1
    a[2, 1, 1:3] = b[2, 1, 1:3] = 1
    got = rater_agreement(a, b, np.array([1, 2, 3]))
    assert got["per_patient"][1] == {"dice": pytest.approx(4 / 7), "pixels_a": 4, "pixels_b": 3}
    assert np.isnan(got["per_patient"][2]["dice"]) and got["per_patient"][3]["dice"] == 1.0
    assert got["pooled"] == {"dice": pytest.approx(8 / 11), "pixels_a": 6, "pixels_b": 5}
    with pytest.raises(DataError, match="do not match"):
        rater_agreement(a, b[:2], np.array([1, 2, 3]))


@pytest.mark.skipif(not (SHARED / ISBI).is_file(), reason=f"real data file {SHARED / ISBI} is absent")
def test_the_two_isbi_raters_on_the_real_file():
    """The shared file's two raters at native resolution (pixels pooled over each patient's slices)."""
    started = time.time()
    got = rater_agreement_file(str(SHARED / ISBI))
    dice = {p: round(v["dice"], 3) for p, v in got["per_patient"].items()}
    assert dice == {2: 0.864, 3: 0.657, 4: 0.658, 5: 0.569}
    assert round(got["pooled"]["dice"], 3) == 0.817 and got["pooled"]["pixels_a"] == 17926 + 1874 + 810 + 1402
    assert time.time() - started < 10


def test_rater2_sites_train_and_validate_on_the_second_raters_masks(sources, tmp_path, monkeypatch):
    """ms6-p7-r2: sites 1 and 2 carry rater 2's mask on every slice that has one (the ISBI
    patients), sites 3 and 4 and every reference copy rater 1's; MNI slices keep rater 1's."""
    _fake_run(monkeypatch)
    bench_run.run_suite("ms6-p7-r2", str(tmp_path), seeds=[0], data_dir=str(sources), overlay_images=0,
                        log=lambda *_: None)
    held = np.load(tmp_path / "_data" / "ms6_flair_agreed_holdout7_val15.npz")
    truth = {}
    for split in ("train", "val"):
        for i, m1, m2, has in zip(held[f"{split}_image_ids"], held[f"{split}_masks"], held[f"{split}_masks_rater2"],
                                  held[f"{split}_has_rater2"]):
            truth[int(i)] = (m1, m2, bool(has))
    assert sum(h for _, _, h in truth.values()) == 4 * SLICES  # patients 2-5
    split_dir = tmp_path / "ms6-p7-r2" / "seed0" / "sites"
    summary = json.load(open(split_dir / "split_summary.json"))
    assert set(summary["second_rater"]) == {"site-1", "site-2"}
    swapped = 0
    for site in ("site-1", "site-2", "site-3", "site-4"):
        data = load_npz(str(split_dir / f"{site}.npz"))
        ref = load_npz(str(split_dir / "reference" / f"{site}_full.npz"))
        for split in ("train", "val"):
            for i, mask, full in zip(data.splits[split].ids, data.splits[split].labels, ref.splits[split].labels):
                m1, m2, has = truth[int(i)]
                expect = m2 if has and site in ("site-1", "site-2") else m1
                assert np.array_equal(mask > 0, expect > 0) and np.array_equal(full > 0, m1 > 0), (site, split, i)
                swapped += int(has and site in ("site-1", "site-2") and not np.array_equal(m1, m2))
    assert swapped > 0
    # again: nothing changes, and a site that drops lesions is refused
    before = load_npz(str(split_dir / "site-1.npz")).splits["train"].labels.copy()
    bench_sources.use_second_rater(str(split_dir), str(tmp_path / "_data" / "ms6_flair_agreed_holdout7_val15.npz"),
                               ["site-1"])
    assert np.array_equal(load_npz(str(split_dir / "site-1.npz")).splits["train"].labels, before)
    bench_run.run_suite("ms6-p7-m2", str(tmp_path), seeds=[0], data_dir=str(sources), overlay_images=0,
                        log=lambda *_: None)
    with pytest.raises(DataError, match="site 'site-1' .* keeps 20% of its lesions"):
        bench_sources.use_second_rater(str(tmp_path / "ms6-p7-m2" / "seed0" / "sites"),
                                   str(tmp_path / "_data" / "ms6_flair_agreed_holdout7_val15.npz"), ["site-1"])
