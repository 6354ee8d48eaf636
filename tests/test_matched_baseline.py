"""A baseline matched to its method (``--matched-to``): the method's model, local recipe and rounds,
so that a user's own comparison is of rules, as the bench's rows are."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedpartial_tools.jobtools import find_job, job_settings, matched_sets

REPO = Path(__file__).resolve().parents[1]


def test_matched_sets_are_what_the_two_job_files_differ_in():
    # read off jobs/fedmlp and jobs/fedavg: 30 vs 20 rounds, small_cnn depth 4 vs its default, grey 64 px vs
    # RGB 28 px, batch 32 vs 64; lr 1e-3 and weight decay 5e-4 in both (nothing to set); FedMLP's
    # betas are not a key of the FedAvg rule's arguments
    assert matched_sets(find_job("fedmlp"), find_job("fedavg")) == [
        "num_rounds=30", 'model.arch_args={"width": 32, "depth": 4}', "model.in_channels=1",
        "model.input_size=[64, 64]", "rule_args.batch_size=32"]
    # FedLSM's 1.3 local epochs are its iteration budget: the whole-epoch FedAvg keeps its own
    assert matched_sets(find_job("fedlsm"), find_job("fedavg")) == [
        "num_rounds=50", 'model.arch_args={"width": 32, "depth": 3}']
    # settings applied to both first (a profile, the data's size) are not repeated
    assert "model.input_size=[64, 64]" not in matched_sets(find_job("fedmlp"), find_job("fedavg"),
                                                           ["model.input_size=[64,64]"])
    assert matched_sets(find_job("fedia"), find_job("fedavg_seg")) == []


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
