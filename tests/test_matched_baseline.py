"""A baseline matched to its method (``--matched-to``): the method's model, local recipe and rounds,
and its optimizer steps per round and site weights, so that a user's own comparison is of rules, as
the bench's rows are. Steps and weights are read from what two jobs record when they run
(metrics.json) on a split of the real HAM10000 file; every setting a baseline takes is checked to
change what it trains."""
import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedpartial.algorithms.base import ClientContext, RoundInput
from fedpartial.algorithms.fedavg import SupervisedClient
from fedpartial.algorithms.registry import rule_class
from fedpartial.data.types import MULTI_LABEL, SINGLE_LABEL, Dataset, Split
from fedpartial.models import build_model
from fedpartial_tools.jobs.folders import find_job
from fedpartial_tools.jobs.matching import compute_of, matched_sets, recipe_of
from fedpartial_tools.jobs.settings import job_settings

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


def test_matched_sets_are_what_the_two_job_files_differ_in():
    # read off jobs/fedmlp and jobs/fedavg: 30 vs 20 rounds, small_cnn depth 4 vs its default, grey 64 px vs
    # RGB 28 px, Adam betas (0.9, 0.999) vs (0.9, 0.99), batch 32 vs 64, two views per batch vs one, the logit
    # adjustment by local positive rates; lr 1e-3, weight decay 5e-4, one epoch and flips in both (nothing to set)
    fedmlp_recipe = ["num_rounds=30", 'model.arch_args={"width": 32, "depth": 4}', "model.in_channels=1",
                     "model.input_size=[64, 64]", "rule_args.betas=[0.9, 0.999]", "rule_args.batch_size=32",
                     "rule_args.num_views=2", "rule_args.logit_adjustment=true"]
    assert matched_sets(find_job("fedmlp"), find_job("fedavg"), compute=False) == fedmlp_recipe
    # matched in compute and weighting too: FedMLP's steps (its rule and the settings the job changes) and
    # every train row counted as a sample
    assert matched_sets(find_job("fedmlp"), find_job("fedavg")) == fedmlp_recipe + [
        'rule_args.steps_of={"rule": "fedmlp", "rule_args": {"warmup_rounds": 5, "lr": 0.001}}',
        'rule_args.weight_by="all_rows"']
    # FedLSM's 1.3 local epochs and its student's strong view are its recipe: the baseline takes both; its
    # steps are those of 1.3 epochs over D_l and D_m of every row, which the baseline makes from its own rows
    fedlsm_recipe = ["num_rounds=50", 'model.arch_args={"width": 32, "depth": 3}', "rule_args.local_epochs=1.3",
                     'rule_args.augmentation="strong"']
    assert matched_sets(find_job("fedlsm"), find_job("fedavg"), compute=False) == fedlsm_recipe
    assert matched_sets(find_job("fedlsm"), find_job("fedavg")) == fedlsm_recipe + [
        'rule_args.steps_of={"rule": "fedlsm", "rule_args": {"lr": 0.001, "local_epochs": 1.3, '
        '"confident_fraction": 0.143, "uncertain_fraction": 0.036, "class_weighted_bce": false}}',
        'rule_args.weight_by="all_rows"']
    # multi-label FedLSM's class-weighted BCE is imbalance handling a FedAvg site can have: the baseline takes it
    assert "rule_args.class_weighted_bce=true" in matched_sets(find_job("fedlsm:multilabel"), find_job("fedavg"),
                                                               compute=False)
    # FedIRM's label smoothing 0.1 and rotation + shift + flip at the labelled sites, batch 48; its labelled
    # sites weigh their labelled rows, as FedAvg's do (no weight_by to set)
    fedirm_recipe = ["num_rounds=30", 'model.arch_args={"width": 32, "depth": 3, "dropout": 0.2}',
                     "rule_args.label_smoothing=0.1", "rule_args.batch_size=48", 'rule_args.augmentation="affine"']
    assert matched_sets(find_job("fedirm"), find_job("fedavg_full"), compute=False) == fedirm_recipe
    assert matched_sets(find_job("fedirm"), find_job("fedavg_full")) == fedirm_recipe + [
        'rule_args.steps_of={"rule": "fedirm", "rule_args": {"reliable_fraction": 0.5, "unlabelled_start_round": 20, '
        '"lr": 0.001}}']
    # settings applied to both first (a profile, the data's size) are not repeated
    assert "model.input_size=[64, 64]" not in matched_sets(find_job("fedmlp"), find_job("fedavg"),
                                                           ["model.input_size=[64,64]"])
    assert matched_sets(find_job("fedia"), find_job("fedavg_seg")) == []


def _method_profiles():
    from fedpartial_tools.jobs.recipes import RECIPES

    for name in ("fedlsm", "fedmlp", "fedirm", "fedia"):
        for profile in RECIPES[name].PROFILES:
            yield name, profile


@pytest.mark.parametrize("method,profile", list(_method_profiles()))
def test_a_matched_baseline_differs_from_its_method_only_in_the_declared_contribution(method, profile):
    """Every exported method profile against every baseline of its task: after matching, each client
    setting of the method that is not declared its contribution has the same value in the baseline."""
    from fedpartial.algorithms.registry import rule_class

    job = f"{method}:{profile}"
    got_method = job_settings(find_job(job))
    cls = rule_class("client", got_method["rule"])
    segmentation = got_method["model"]["task"] == "segmentation"
    baselines = ["fedavg_seg", "fedavg_seg_full"] if segmentation else ["fedavg", "fedavg_partial_loss", "fedavg_full"]
    for baseline in baselines:
        matched = job_settings(find_job(baseline), matched_sets(find_job(job), find_job(baseline)))
        assert matched["num_rounds"] == got_method["num_rounds"], baseline
        for key in ("arch", "arch_args", "in_channels", "input_size", "normalisation"):
            assert matched["model"].get(key) == got_method["model"].get(key), (baseline, key)
        differing = {k: (v, matched["rule_args"].get(cls.RECIPE_NAMES.get(k, k), "<not taken>"))
                     for k, v in got_method["rule_args"].items()
                     if k not in cls.CONTRIBUTION and matched["rule_args"].get(cls.RECIPE_NAMES.get(k, k), "<not taken>") != v}
        assert not differing, f"{job} vs matched {baseline}: {differing}"


def test_a_recipe_setting_the_baseline_cannot_take_is_refused_by_name(monkeypatch):
    from fedpartial.algorithms.fedirm import FedIRMClient

    # mc_passes is FedIRM's own (MC-dropout passes of the teacher); undeclared it would be recipe
    monkeypatch.setattr(FedIRMClient, "CONTRIBUTION", FedIRMClient.CONTRIBUTION - {"mc_passes"})
    with pytest.raises(ValueError, match=r"'fedavg' cannot take \['mc_passes'\] of the local recipe of 'fedirm'"):
        matched_sets(find_job("fedirm"), find_job("fedavg"))


def test_each_method_declares_only_its_own_arguments():
    import inspect

    from fedpartial.algorithms.registry import CLIENT_RULES, rule_class

    for name in CLIENT_RULES:
        cls = rule_class("client", name)
        arguments = set(inspect.signature(cls.__init__).parameters) - {"self"}
        assert cls.CONTRIBUTION <= arguments, (name, sorted(cls.CONTRIBUTION - arguments))
        assert set(cls.RECIPE_NAMES) <= arguments - cls.CONTRIBUTION, name


def test_package_job_matched_to_a_method_takes_its_settings_and_a_set_still_wins(tmp_path):
    def package(*args):
        return subprocess.run([sys.executable, "-m", "fedpartial", "package-job", str(REPO / "jobs" / "fedavg"),
                               "--out", str(tmp_path / "job"), *args], capture_output=True, text=True)

    done = package("--matched-to", "fedmlp", "--set", "rule_args.batch_size=16")
    assert done.returncode == 0, done.stderr
    assert "matched to fedmlp: num_rounds=30" in done.stderr
    got = job_settings(str(tmp_path / "job"))
    assert got["num_rounds"] == 30
    assert got["model"]["arch_args"] == {"width": 32, "depth": 4} and got["model"]["input_size"] == [64, 64]
    assert got["rule_args"]["batch_size"] == 16  # the user's --set, not FedMLP's 32
    assert got["rule_args"]["lr"] == 0.001
    assert json.loads((tmp_path / "job" / "meta.json").read_text())["name"] == "fedavg"

    unknown = package("--matched-to", "fedlsmm")
    assert unknown.returncode == 2 and "job 'fedlsmm' is neither a folder nor a job of" in unknown.stderr


def test_find_job_takes_a_folder_or_a_name_of_jobs(tmp_path):
    assert find_job("fedlsm") == str(REPO / "jobs" / "fedlsm")
    assert find_job(str(tmp_path)) == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a folder"):
        find_job("jobs/no_such_job")


@pytest.mark.parametrize("method,baseline", [("fedlsm", "fedavg"), ("fedmlp", "fedavg"), ("fedirm", "fedavg"),
                                             ("fedia", "fedavg_seg")])
def test_a_contribution_is_nothing_its_baseline_can_take(method, baseline):
    """A setting the baseline's rule takes too is recipe: declared the method's contribution, the matched
    baseline would keep its own value (an lr, an augmentation) and the comparison would credit the rule."""
    takes = set(inspect.signature(rule_class("client", baseline).__init__).parameters) - {"self"}
    assert not rule_class("client", method).CONTRIBUTION & takes


# ---- every setting a baseline takes changes what it trains --------------------------------------------
def _tiny(task: str, n: int = 48) -> Dataset:
    """8 px RGB images, 3 classes; the site annotates classes 0 and 1. Multi-label: class 2 is never
    positive here, so its positive rate is clipped (la_eps) and class weights exceed 1."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(n, 8, 8, 3)).astype(np.uint8)
    if task == SINGLE_LABEL:
        full = np.eye(3, dtype=np.float32)[rng.integers(0, 3, n)]
    else:
        full = (rng.random((n, 3)) < 0.3).astype(np.float32)
        full[:, 2] = 0
    mask = np.zeros((n, 3), bool)
    mask[:, :2] = True
    return Dataset(task, ["a", "b", "c"], {"train": Split(images, full * mask, mask)}, source="tiny", site="site-1")


def _train(args: dict, task: str, tmp_path):
    """(weights, num_samples, train_steps) of one round of ``SupervisedClient(**args)`` from a fixed start."""
    torch.manual_seed(0)
    model = build_model("small_cnn", 3, 3, width=4, depth=2)
    rule = SupervisedClient(**{"lr": 0.01, "batch_size": 16, **args})
    rule.setup(ClientContext(site="site-1", data=_tiny(task), device=torch.device("cpu"), state_dir=str(tmp_path)))
    result = rule.train_round(model, RoundInput(0, 1))
    return ({k: v.detach().clone() for k, v in model.state_dict().items()}, result.num_samples,
            result.metrics.get("train_steps"))


#: every setting a method's recipe or compute gives its FedAvg baseline: (other settings it needs to act,
#: another value, task). A setting taken but ignored would leave the baseline unmatched unseen.
TAKEN = {
    "lr": ({}, 0.05, SINGLE_LABEL), "weight_decay": ({}, 0.5, SINGLE_LABEL), "betas": ({}, [0.5, 0.9], SINGLE_LABEL),
    "batch_size": ({}, 8, SINGLE_LABEL), "local_epochs": ({}, 2, SINGLE_LABEL),
    "local_iterations": ({}, 5, SINGLE_LABEL), "augmentation": ({}, "strong", SINGLE_LABEL),
    "rotate_deg": ({"augmentation": "affine"}, 45.0, SINGLE_LABEL),
    "translate": ({"augmentation": "affine"}, 0.25, SINGLE_LABEL),
    "label_smoothing": ({}, 0.3, SINGLE_LABEL), "num_views": ({}, 2, SINGLE_LABEL),
    "class_weighted_bce": ({}, True, MULTI_LABEL),
    "max_pos_weight": ({"class_weighted_bce": True}, 1.2, MULTI_LABEL),
    "logit_adjustment": ({}, True, MULTI_LABEL), "la_tau": ({"logit_adjustment": True}, 2.0, MULTI_LABEL),
    "la_eps": ({"logit_adjustment": True}, 0.1, MULTI_LABEL),
    "steps_of": ({}, {"rule": "fedlsm", "rule_args": {"local_iterations": 7}}, SINGLE_LABEL),
    "weight_by": ({}, "all_rows", SINGLE_LABEL),
}


def _taken_by_fedavg():
    """Every setting some method profile gives the FedAvg baseline."""
    from fedpartial_tools.jobs.recipes import RECIPES

    taken = set()
    for name in ("fedlsm", "fedmlp", "fedirm"):
        for profile in RECIPES[name].PROFILES:
            got = job_settings(find_job(f"{name}:{profile}"))
            taken |= set(recipe_of(got["rule"], got["rule_args"]))
            taken |= set(compute_of(got["rule"], got["rule_args"], {"steps_of": None, "weight_by": None}))
    return taken


def test_every_setting_taken_from_a_method_is_in_the_table():
    assert _taken_by_fedavg() <= set(TAKEN), sorted(_taken_by_fedavg() - set(TAKEN))


@pytest.mark.parametrize("key", sorted(TAKEN))
def test_every_setting_a_baseline_takes_changes_what_it_trains(key, tmp_path):
    context, other, task = TAKEN[key]
    base = _train(context, task, tmp_path)
    again = _train(context, task, tmp_path)
    changed = _train({**context, key: other}, task, tmp_path)

    def same(a, b):
        return a[1:] == b[1:] and all(torch.equal(a[0][k], b[0][k]) for k in a[0])

    assert same(base, again)  # seeded: a difference is the setting's
    assert not same(base, changed), f"{key}={other!r} left the baseline's training unchanged"


# ---- what each method states it does is what it does -------------------------------------------------
def _site(task: str, labelled: bool = True, n: int = 48) -> Dataset:
    data = _tiny(task, n)
    if not labelled:
        train = data.splits["train"]
        data.splits["train"] = Split(train.images, 0 * train.labels, np.zeros_like(train.label_mask))
    return data


@pytest.mark.parametrize("rule,args,task,labelled", [
    ("fedlsm", {"local_epochs": 1.3, "batch_size": 16, "ude_pairs": 4, "confident_fraction": 0.25,
                "uncertain_fraction": 0.25, "strong_view": "flip"}, SINGLE_LABEL, True),
    ("fedlsm", {"local_epochs": 2.0, "batch_size": 16, "ude_pairs": 4, "use_ue": False, "strong_view": "flip"},
     MULTI_LABEL, True),
    ("fedlsm", {"local_epochs": 1.3, "batch_size": 16, "use_ude": False, "strong_view": "flip"}, SINGLE_LABEL, True),
    ("fedlsm", {"local_iterations": 3, "batch_size": 16, "strong_view": "flip"}, SINGLE_LABEL, True),
    ("fedmlp", {"warmup_rounds": 2, "batch_size": 10, "local_epochs": 2}, MULTI_LABEL, True),
    ("fedirm", {"batch_size": 10, "mc_passes": 1}, SINGLE_LABEL, True),
    ("fedirm", {"batch_size": 10, "mc_passes": 1}, SINGLE_LABEL, False),
])
def test_round_steps_is_what_the_rule_makes_and_steps_of_makes_as_many(rule, args, task, labelled, tmp_path):
    """A rule's ``round_steps`` is the count its round makes (so the compute-matched baseline copies what
    happens), and a baseline with ``steps_of`` makes that count from its own (fewer) labelled rows."""
    from fedpartial.algorithms.registry import build_rule

    data = _site(task, labelled)
    method = build_rule("client", rule, args)
    stated = method.round_steps(data)
    torch.manual_seed(0)
    model = build_model("small_cnn", 3, 3, width=4, depth=2, dropout=0.2)
    method.setup(ClientContext(site="site-1", data=data, device=torch.device("cpu"), state_dir=str(tmp_path)))
    made = method.train_round(model, RoundInput(0, 2)).metrics["train_steps"]
    assert made == stated > 0
    if labelled:
        assert _train({"steps_of": {"rule": rule, "rule_args": args}}, task, tmp_path)[2] == stated


def test_steps_of_refuses_a_rule_that_states_no_steps():
    with pytest.raises(ValueError, match="'fedavg_seg' states no steps per round"):
        SupervisedClient(steps_of={"rule": "fedavg_seg"})
    with pytest.raises(ValueError, match="steps_of must be"):
        SupervisedClient(steps_of={"rule": "fedlsm", "lr": 0.1})


# ---- the two jobs, run ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.realdata
def test_fedlsm_and_its_matched_fedavg_make_the_same_steps_with_the_same_site_weights(tmp_path):
    """One round of jobs/fedlsm and of jobs/fedavg matched to it (what ``package-job --matched-to fedlsm``
    sets) on a split of real HAM10000 (28 px, 3 sites x 3 classes): each site's optimizer steps and the
    weight the server gave it, as both jobs recorded them in metrics.json, are the same. FedAvg on its own
    epochs would make fewer steps and weigh the sites by their labelled rows: the check can tell."""
    from fedpartial.data.npz import load_npz, save_npz
    from fedpartial_tools.data.partition import split_file
    from fedpartial_tools.data.sites import dataset_overrides
    from fedpartial_tools.run.simulator import simulate

    source = SHARED / "ham10000_28.npz"
    if not source.is_file():
        pytest.skip(f"needs {source}")
    data = load_npz(str(source))
    small = tmp_path / "ham10000_28_first600.npz"  # the first 600 train / 90 val images: a fast round
    save_npz(Dataset(data.task, data.class_names, {"train": data.splits["train"].subset(np.arange(600)),
                                                   "val": data.splits["val"].subset(np.arange(90))}, str(source)),
             str(small))
    sites = tmp_path / "sites"
    split_file(str(small), "label-set-mismatch", sites=3, seed=0, out=str(sites), classes_per_site=3)
    common = dataset_overrides(str(sites)) + ["num_rounds=1", 'model.arch_args={"width": 8, "depth": 2}',
                                              "device=cpu"]
    matched = matched_sets(find_job("fedlsm"), find_job("fedavg"), common)
    assert any(m.startswith("rule_args.steps_of=") for m in matched)
    recorded = {}
    for job, sets in (("fedlsm", common), ("fedavg", common + matched)):
        summary = simulate(find_job(job), str(sites), str(tmp_path / job), sets, timeout=300, log=lambda m: None)
        assert summary["ok"], summary
        (first,) = json.loads((Path(summary["workspace"]) / "metrics.json").read_text())["rounds"]
        recorded[job] = ({s: float(v["train_steps"]) for s, v in first["sites"].items()}, first["server"]["weights"])
    (method_steps, method_weights), (base_steps, base_weights) = recorded["fedlsm"], recorded["fedavg"]
    assert base_steps == method_steps and len(method_steps) == 3
    assert base_weights == pytest.approx(method_weights) and len(method_weights) == 3
    # the baseline's own epochs: 1.3 over its labelled rows, 64 a batch; its weights those rows
    labelled = {s: int(((d.splits["train"].labels * d.splits["train"].label_mask) > 0.5).any(1).sum())
                for s, d in ((p.stem, load_npz(str(p))) for p in sorted(sites.glob("site-*.npz")))}
    own_steps = {s: float(max(1, math.ceil(1.3 * n / 64))) for s, n in labelled.items()}
    own_weights = {s: n / sum(labelled.values()) for s, n in labelled.items()}
    assert own_steps != method_steps and own_weights != pytest.approx(method_weights)
