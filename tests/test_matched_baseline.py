"""A baseline matched to its method (``--matched-to``): the method's model, local recipe and rounds,
so that a user's own comparison is of rules, as the bench's rows are."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedpartial_tools.jobs.folders import find_job
from fedpartial_tools.jobs.matching import matched_sets
from fedpartial_tools.jobs.settings import job_settings

REPO = Path(__file__).resolve().parents[1]


def test_matched_sets_are_what_the_two_job_files_differ_in():
    # read off jobs/fedmlp and jobs/fedavg: 30 vs 20 rounds, small_cnn depth 4 vs its default, grey 64 px vs
    # RGB 28 px, Adam betas (0.9, 0.999) vs (0.9, 0.99), batch 32 vs 64, two views per batch vs one;
    # lr 1e-3, weight decay 5e-4, one epoch and flips in both (nothing to set)
    assert matched_sets(find_job("fedmlp"), find_job("fedavg")) == [
        "num_rounds=30", 'model.arch_args={"width": 32, "depth": 4}', "model.in_channels=1",
        "model.input_size=[64, 64]", "rule_args.betas=[0.9, 0.999]", "rule_args.batch_size=32",
        "rule_args.num_views=2"]
    # FedLSM's 1.3 local epochs and its student's strong view are its recipe: the baseline takes both
    assert matched_sets(find_job("fedlsm"), find_job("fedavg")) == [
        "num_rounds=50", 'model.arch_args={"width": 32, "depth": 3}', "rule_args.local_epochs=1.3",
        'rule_args.augmentation="strong"']
    # FedIRM's label smoothing 0.1 and rotation + shift + flip at the labelled sites, batch 48
    assert matched_sets(find_job("fedirm"), find_job("fedavg_full")) == [
        "num_rounds=30", 'model.arch_args={"width": 32, "depth": 3, "dropout": 0.2}', "rule_args.label_smoothing=0.1",
        "rule_args.batch_size=48", 'rule_args.augmentation="affine"']
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
