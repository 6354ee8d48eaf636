"""The FLARE recipes (fedpartial_tools.jobs.recipes): jobs/ is their export, constructor defaults stay in
the constructors, profiles replace the per-dataset folders, a baseline is matched to its method
with one call, and a recipe runs through FLARE's own SimEnv."""
import json
import shutil
from pathlib import Path

import pytest

from fedpartial_tools.jobs import folders, profiles, recipes
from fedpartial_tools.jobs.folders import find_job
from fedpartial_tools.jobs.settings import apply_overrides, job_settings

REPO = Path(__file__).resolve().parents[1]


def _client_rule_args(job_dir):
    config = json.loads((Path(job_dir) / "app/config/config_fed_client.json").read_text())
    return config["executors"][0]["executor"]["args"].get("rule_args", {})


def test_every_job_folder_is_its_recipes_export():
    assert folders.drift() == []
    assert sorted(p.name for p in (REPO / "jobs").iterdir()) == sorted(recipes.RECIPES)


def test_a_hand_edit_or_a_stray_folder_is_reported_and_write_repairs_it(tmp_path):
    jobs = tmp_path / "jobs"
    shutil.copytree(REPO / "jobs", jobs)
    server = jobs / "fedlsm/app/config/config_fed_server.json"
    server.write_text(server.read_text().replace('"num_rounds": 50', '"num_rounds": 7'))
    (jobs / "fedlsm_ham").mkdir()
    problems = folders.drift(str(jobs))
    assert any(p.startswith("jobs/fedlsm/app/config/config_fed_server.json differs") for p in problems), problems
    assert any(p.startswith("jobs/fedlsm_ham: no recipe") for p in problems), problems
    shutil.rmtree(jobs / "fedlsm_ham")
    folders.write_all(str(jobs))
    assert folders.drift(str(jobs)) == []


def test_jobs_hold_only_what_departs_from_the_constructors():
    # FedLSM's constructor has the paper's lr 1e-4 and EMA decay 0.999: the CPU profile departs in lr only
    args = _client_rule_args(REPO / "jobs/fedlsm")
    assert args["lr"] == 0.001 and "renormalise_missing" not in args  # the paper's rule, chosen on val
    assert "ema_decay" not in args and "tau" not in args
    # FedIA's server rule runs on its defaults: nothing written
    server = json.loads((REPO / "jobs/fedia/app/config/config_fed_server.json").read_text())
    aggregator = next(c for c in server["components"] if c["id"] == "aggregator")
    assert aggregator["args"]["rule_args"] == {}
    # ... but the effective settings still name every argument, with its default
    assert job_settings(str(REPO / "jobs/fedlsm"))["rule_args"]["ema_decay"] == 0.999


def test_a_set_reaches_a_default_argument_on_every_rule_that_takes_it_and_a_typo_fails():
    configs = {side: json.loads((REPO / f"jobs/fedia/app/config/config_fed_{side}.json").read_text())
               for side in ("server", "client")}
    apply_overrides(configs, ["rule_args.warmup_rounds=20", "max_norm_ratio=5.0", "num_rounds=3"])
    client = configs["client"]["executors"][0]["executor"]["args"]
    aggregator = next(c for c in configs["server"]["components"] if c["id"] == "aggregator")["args"]
    assert client["rule_args"]["warmup_rounds"] == 20 and aggregator["rule_args"]["warmup_rounds"] == 20
    assert aggregator["max_norm_ratio"] == 5.0
    assert configs["server"]["num_rounds"] == 3  # the variable; the workflow reads "{num_rounds}"
    workflow = configs["server"]["workflows"][0]["args"]
    assert workflow["num_rounds"] == "{num_rounds}"
    with pytest.raises(ValueError, match="rule_args.warmup_round"):
        apply_overrides(configs, ["rule_args.warmup_round=20"])
    # the server's rule takes no lr: only the client's gets it
    apply_overrides(configs, ["rule_args.lr=0.5"])
    assert client["rule_args"]["lr"] == 0.5 and "lr" not in aggregator["rule_args"]


def test_profiles_replace_the_dataset_folders(tmp_path):
    ctich = job_settings(find_job("fedmlp:ctich"))
    assert ctich["model"]["class_names"] == profiles.CT_ICH
    assert ctich["rule_args"]["lr"] == 0.001 and ctich["num_rounds"] == 30
    lesions = job_settings(find_job("fedia", "lesions"))["rule_args"]
    assert (lesions["loss"], lesions["lr"], lesions["use_correction"]) == ("dice_focal", 0.01, False)
    # the paper's profile is the constructors' defaults: the paper's lr, threshold and schedule
    paper = recipes.FedMLPRecipe("paper")
    assert paper.settings["rule_args"] == {} and paper.settings["num_rounds"] == 500
    assert job_settings(find_job("fedmlp:paper"))["rule_args"]["lr"] == 3e-5
    # FedIRM's multi-label profile sends relation vectors: its own privacy preset
    assert recipes.FedIRMRecipe("multilabel").preset() == "fedirm_multilabel"
    with pytest.raises(ValueError, match="no profile 'ctich'"):
        recipes.FedLSMRecipe("ctich")
    with pytest.raises(ValueError, match="takes no argument"):
        recipes.FedLSMRecipe(rule_args={"learning_rate": 0.1})
    # an argument both of FedIA's rules take reaches both; the server's own wins
    fedia = recipes.FedIARecipe(rule_args={"warmup_rounds": 4, "lr": 0.01}).settings
    assert fedia["rule_args"]["warmup_rounds"] == 4 and fedia["server_rule_args"] == {"warmup_rounds": 4}
    fedia = recipes.FedIARecipe(rule_args={"warmup_rounds": 4}, server_rule_args={"warmup_rounds": 5}).settings
    assert fedia["server_rule_args"] == {"warmup_rounds": 5}


def test_every_profile_exports(tmp_path):
    for name, cls in recipes.RECIPES.items():
        for profile in cls.PROFILES:
            out = recipes.export_job(name, str(tmp_path / f"{name}_{profile}"), profile)
            meta = json.loads((Path(out) / "meta.json").read_text())
            assert meta["name"] == f"{name}_{profile}" and meta["description"]
            assert meta["min_clients"] == cls.PROFILES[profile]["min_clients"]


def test_a_baseline_matched_to_its_method_takes_model_recipe_and_rounds():
    # FedMLP (CPU profile): small_cnn depth 4 on grey 64 px, lr 1e-3, batch 32, 1 epoch, Adam betas
    # (0.9, 0.999), two views per batch, 30 rounds: all of it the baseline's too
    matched = recipes.FedAvgRecipe.matched_to(recipes.FedMLPRecipe())
    s = matched.settings
    assert s["num_rounds"] == 30
    assert s["model"]["arch_args"] == {"width": 32, "depth": 4}
    assert s["model"]["in_channels"] == 1 and s["model"]["input_size"] == [64, 64]
    assert s["model"]["class_names"] == profiles.HAM10000  # classes come from the data, not the method
    assert {k: s["rule_args"][k] for k in ("lr", "batch_size", "local_epochs")} == {
        "lr": 0.001, "batch_size": 32, "local_epochs": 1}
    assert list(s["rule_args"]["betas"]) == [0.9, 0.999] and s["rule_args"]["num_views"] == 2
    assert "warmup_rounds" not in s["rule_args"]  # FedMLP's own: the FedAvg rule has no such setting
    # a recipe's job names the runtime it needs; jobs/ (exported) names none: package-job writes it
    client = json.loads((REPO / "jobs/fedavg/app/config/config_fed_client.json").read_text())
    assert "runtime_version" not in client["executors"][0]["executor"]["args"]
    # FedLSM's 1.3 local epochs and its student's strong view are its recipe: the baseline's too
    lsm = recipes.FedAvgFullRecipe.matched_to(recipes.FedLSMRecipe()).settings
    assert lsm["rule_args"]["local_epochs"] == 1.3 and lsm["rule_args"]["augmentation"] == "strong"
    assert lsm["num_rounds"] == 50
    assert lsm["data_file"] == profiles.FULL_LABELS


def _sites_for(recipe_name, root):
    """Tiny site files of the recipe's kind of data (the end-to-end tests' writers)."""
    root.mkdir()
    if recipe_name in ("fedia", "fedavg_seg", "fedavg_seg_full"):
        from tests.test_e2e_fedia import write_sites
        write_sites(root)
    elif recipe_name in ("fedmlp", "fedavg_full"):  # multi-label, with the reference copies the full bound reads
        from tests.test_e2e_fedmlp import _write_split
        _write_split(root)
    elif recipe_name == "fedirm":
        from tests.test_e2e_fedirm import _write_split
        _write_split(root, "single-label", 4, 3)
    else:
        from tests.test_e2e_fedlsm import _write_split
        _write_split(root, "single-label", 3)


_TINY_CNN = {"arch_args": {"width": 8, "depth": 2}}
_TINY_UNET = {"arch_args": {"channels": [4, 8], "strides": [2], "num_res_units": 0}}
# recipe -> (constructor arguments that make one round tiny, the key metric the sites report)
_TINY = {
    "fedavg": ({"model": _TINY_CNN, "rule_args": {"batch_size": 16}}, "auc"),
    "fedlsm": ({"model": _TINY_CNN, "rule_args": {"batch_size": 16, "strong_view": "flip", "confident_fraction": 0.25,
                                                  "uncertain_fraction": 0.25}}, "auc"),
    "fedmlp": ({"model": _TINY_CNN, "rule_args": {"batch_size": 16, "warmup_rounds": 1}}, "auc"),
    "fedirm": ({"model": _TINY_CNN, "rule_args": {"batch_size": 16, "mc_passes": 2, "augmentation": "flip",
                                                  "unlabelled_start_round": 0}}, "auc"),
    "fedia": ({"model": _TINY_UNET, "rule_args": {"lr": 0.01, "warmup_rounds": 2}}, "dice_pooled"),
    "fedavg_partial_loss": ({"model": _TINY_CNN, "rule_args": {"batch_size": 16}}, "auc"),
    "fedavg_full": ({"model": _TINY_CNN, "rule_args": {"batch_size": 16}}, "auc"),
    "fedavg_seg": ({"model": _TINY_UNET, "rule_args": {"lr": 0.01}}, "dice_pooled"),
    "fedavg_seg_full": ({"model": _TINY_UNET, "rule_args": {"lr": 0.01}}, "dice_pooled"),
}


#: recipes run through FLARE's SimEnv: a classification method with server statistics, the
#: segmentation method, and the one baseline no other test runs end to end. Every recipe shares
#: FedPartialRecipe's execute path, and every other recipe's export (jobs/, checked above) runs in
#: the simulator in tests/test_e2e_*.py, test_privacy.py and test_import.py.
SIMENV_RECIPES = ["fedlsm", "fedia", "fedavg_partial_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name", SIMENV_RECIPES)
def test_a_recipe_runs_in_flares_simenv(tmp_path, recipe_name):
    """RECIPE(...).execute(SimEnv(...)), with the code carried in the job: 3 sites, 2 rounds, FLARE's
    own simulator environment; the global model is fitted to the data and every round aggregated."""
    from nvflare.recipe import SimEnv

    from fedpartial.models.io import load_model_file

    sites = tmp_path / "sites"
    _sites_for(recipe_name, sites)
    kwargs, key_metric = _TINY[recipe_name]
    recipe = recipes.recipe(recipe_name, num_rounds=2, min_clients=3, fit_to=str(sites), data_root=str(sites),
                            with_code=True, **kwargs)
    names = sorted(p.stem for p in sites.glob("site-*.npz"))
    run = recipe.execute(SimEnv(clients=names, workspace_root=str(tmp_path / "sim")))
    result = Path(run.get_result())
    job = result / "server" / "simulate_job" if (result / "server").is_dir() else result
    _, meta = load_model_file(str(next(job.rglob("global_model.pt"))))
    assert meta["class_names"] == recipe.settings["model"]["class_names"] and meta["round"] == 1
    rounds = json.loads(next(job.rglob("metrics.json")).read_text())["rounds"]
    assert [r["round"] for r in rounds] == [0, 1]
    assert all(sorted(r["sites"]) == names for r in rounds), rounds
    assert any(key_metric in site.get("val", {}) for site in rounds[-1]["sites"].values()), rounds[-1]


@pytest.mark.slow
def test_a_recipe_runs_in_flares_pocenv(tmp_path, monkeypatch):
    """FedAvgRecipe(...).execute(PocEnv(...)): FLARE prepares and starts a 3-site POC system, the job
    (code in app/custom) runs 1 round, the result comes back, and the system is stopped."""
    from nvflare.recipe import PocEnv

    from fedpartial_tools.deploy import processes
    from tests.test_e2e_fedlsm import _write_split

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NVFLARE_POC_WORKSPACE", str(tmp_path / "poc"))
    (tmp_path / "home").mkdir()
    sites = tmp_path / "sites"
    sites.mkdir()
    _write_split(sites, "single-label", 3)
    recipe = recipes.FedAvgRecipe(num_rounds=1, fit_to=str(sites), data_root=str(sites), with_code=True,
                                  model={"arch_args": {"width": 8}}, rule_args={"batch_size": 16})
    env = PocEnv(num_clients=3, clients=["site-1", "site-2", "site-3"])
    try:
        run = recipe.execute(env)
        result = Path(run.get_result(timeout=300, clean_up=False))  # keep the download to look at
        assert run.get_status() == "FINISHED:COMPLETED"
        assert list(result.rglob("global_model.pt")), sorted(str(p) for p in result.rglob("*"))[:50]
    finally:
        env.stop(clean_up=True)
        processes.kill_workspace_processes(str(tmp_path))
    assert not processes.live_workspace_processes(str(tmp_path))


@pytest.mark.slow
def test_package_job_takes_a_profile_and_a_typo_names_the_profiles(tmp_path):
    import subprocess
    import sys

    def package(*args):
        return subprocess.run([sys.executable, "-m", "fedpartial", "package-job", "fedmlp", "--out",
                               str(tmp_path / "job"), *args], capture_output=True, text=True)

    done = package("--profile", "ctich", "--name", "fedmlp_ctich")
    assert done.returncode == 0, done.stderr
    settings = job_settings(str(tmp_path / "job"))
    assert settings["model"]["class_names"] == profiles.CT_ICH
    assert json.loads((tmp_path / "job/meta.json").read_text())["min_clients"] == 5
    assert (tmp_path / "job/app/custom/fedpartial").is_dir()  # the code travels, as for every packaged job
    typo = package("--profile", "ctih")
    assert typo.returncode != 0 and "no profile 'ctih'" in typo.stderr and "ctich" in typo.stderr
