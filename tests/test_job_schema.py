"""A job is typed data (fedpartial.flare.job_schema), checked at deployment by each participant's
job gate (fedpartial.flare.job_gate) against its own limits and floors (fedpartial.flare.site_config).

Without a running system: every job a user can make passes; each config-level attack of the
red-team suite is refused by the gate, naming the file, component, argument and the value as the
job wrote it; the schema stays in step with the constructors it describes; floors hold whatever a
job asks. tests/test_red_team.py submits the same attacks to a provisioned system.
"""
import copy
import inspect
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fedpartial.algorithms import registry
from fedpartial.flare import job_schema
from fedpartial.flare.allowed import CLASS_ALLOW_LIST
from fedpartial.flare.job_gate import GATE_PATH, SUBMISSION_GATE_PATH, JobGate, check_app, gate_error
from fedpartial.flare.job_schema import COMPONENTS, JobRefused, check_config
from fedpartial.flare.site_config import (FLOORS, FRACTION_BOUNDS, LIMITED_ARGS, LIMITS, PARTICIPANT_TABLES,
                                          SUBMISSION_LIMITS, check_limits, site_rules)

REPO = Path(__file__).resolve().parents[1]
SECRET = "{$SECRET}"


def _configs(job: Path) -> dict:
    return {side: json.loads((job / "app" / "config" / f"config_fed_{side}.json").read_text())
            for side in ("server", "client")}


@pytest.fixture(scope="module")
def every_job(tmp_path_factory):
    """Every job folder a user can make: each recipe's every profile, the shipped jobs/, the privacy
    tool's filter variant, and a job packaged for installed-runtime sites."""
    from test_kit_policy import _exported_jobs
    from fedpartial_tools.jobs.packaging import package_job

    root = tmp_path_factory.mktemp("every_job")
    jobs = [Path(j) for j in _exported_jobs(root)]
    jobs.append(Path(package_job(str(REPO / "jobs" / "fedlsm"), str(root / "installed"), with_code=False,
                                 dataset="demo")))
    return jobs


def test_every_job_and_recipe_profile_passes_the_schema_and_the_default_limits(every_job):
    from fedpartial_tools.jobs.recipes import RECIPES

    assert len(every_job) >= sum(len(cls.PROFILES) for cls in RECIPES.values()) + 9
    rules = site_rules(None)
    for job in every_job:
        for side, config in _configs(job).items():
            checked = check_config(config, side)
            check_limits(checked, rules, f"{job.name} {side}", "defaults")


def test_the_schema_names_exactly_the_allow_list_and_each_constructors_arguments():
    import importlib

    assert set(COMPONENTS) == set(CLASS_ALLOW_LIST)
    for path, component in COMPONENTS.items():
        module, _, name = path.rpartition(".")
        params = inspect.signature(getattr(importlib.import_module(module), name).__init__).parameters
        own = {p for p, v in params.items() if p != "self" and v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL)}
        if path.endswith("PooledModelSelector"):  # key_metric + IntimeModelSelector's through **kwargs
            from nvflare.app_common.widgets.intime_model_selector import IntimeModelSelector
            own |= set(inspect.signature(IntimeModelSelector.__init__).parameters) - {"self"}
        assert set(component.args) == own, (path, set(component.args) ^ own)
        for arg, spec in component.args.items():  # every default is a value a job may write
            default = params[arg].default if arg in params else None
            if default is not inspect.Parameter.empty and not isinstance(spec, (job_schema.ByKey,
                                                                                job_schema.ModelBlock)):
                value = list(default) if isinstance(default, tuple) else default
                assert spec.why(value) in ("", "must be a list", "must be a dict") or value is None, (path, arg)


@pytest.mark.parametrize("side", ["client", "server"])
def test_rule_args_are_each_registered_rules_constructor_arguments(side):
    table = job_schema.CLIENT_RULE_ARGS if side == "client" else job_schema.SERVER_RULE_ARGS
    names = registry.CLIENT_RULES if side == "client" else registry.SERVER_RULES
    assert set(table) == set(names)
    for name, args in table.items():
        params = inspect.signature(registry.rule_class(side, name).__init__).parameters
        own = {p for p, v in params.items() if p != "self" and v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL)}
        assert set(args) == own, (name, set(args) ^ own)
        for arg, spec in args.items():
            default = params[arg].default
            value = list(default) if isinstance(default, tuple) else default
            assert spec.why(value) == "", (name, arg, value, spec.why(value))


def test_every_limited_argument_is_in_the_schema_and_every_batch_or_view_argument_is_limited():
    declared = {arg for table in job_schema.CLIENT_RULE_ARGS.values() for arg in table}
    limited = {arg for names in LIMITED_ARGS.values() for arg in names}
    assert limited <= declared
    assert {a for a in declared if a.endswith("batch_size") or a in ("num_views", "ude_pairs", "mc_passes")} <= limited


# ---- attacks on the raw config ----------------------------------------------------------------
def _executor(c):
    return c["executors"][0]["executor"]["args"]


def _component(c, cid):
    return next(x for x in c["components"] if x["id"] == cid)["args"]


def _secret_pairs(c):
    """rule_args.local_iterations from two characters of the site's $SECRET (the issue's attack)."""
    _executor(c)["rule_args"]["local_iterations"] = "{{it_{$SECRET[0]}{$SECRET[1]}}}"
    for a in "ab":
        for b in "ab":
            c[f"it_{a}{b}"] = 10 + ord(a) + ord(b)


def _per_site_gamma(c):
    c["gamma_site-1"], c["gamma_site-2"] = 0, 1e-30
    c["task_result_filters"][0]["filters"].append({
        "path": "nvflare.app_common.filters.percentile_privacy.PercentilePrivacy",
        "args": {"percentile": 100, "gamma": "{{gamma_{SITE_NAME}}}"}})


ATTACKS = [  # (name, side, change, what the refusal must name)
    ("env_in_rule_args", "client", _secret_pairs, "argument 'rule_args.local_iterations' holds "
                                                  "'{{it_{$SECRET[0]}{$SECRET[1]}}}'"),
    ("env_in_class_names", "server", lambda c: c["model"]["class_names"].__setitem__(0, SECRET),
     "top-level 'model.class_names[0]' holds '{$SECRET}'"),
    ("env_in_resume_from", "server", lambda c: _component(c, "persistor").__setitem__("resume_from", SECRET),
     "component 'persistor' (fedpartial.flare.persistor.FedPartialPersistor), argument 'resume_from' holds "
     "'{$SECRET}'"),
    ("secret_ref", "client", lambda c: _executor(c).__setitem__("key_metric", "${secret:API_KEY}"),
     "argument 'key_metric' holds '${secret:API_KEY}'"),
    ("site_name_variables", "client", _per_site_gamma, "argument 'gamma' holds '{{gamma_{SITE_NAME}}}'"),
    ("per_site_variables", "client", lambda c: c.update({"seed_site-1": 1, "seed_site-2": 2}),
     "top-level key 'seed_site-1' is not one a job may set"),
    ("site_name_in_value", "client", lambda c: _executor(c).__setitem__("seed", "{SITE_NAME}"),
     "argument 'seed' holds '{SITE_NAME}'"),
    ("workspace_in_state_dir", "client", lambda c: _executor(c).__setitem__("state_dir", "{WORKSPACE}/local"),
     "argument 'state_dir' holds '{WORKSPACE}/local'"),
    ("unknown_argument", "client", lambda c: _executor(c)["rule_args"].__setitem__("args", ["sh", "-c", "id"]),
     "argument 'rule_args' of rule 'fedlsm' has 'args', which is not one of"),
    ("nested_component", "server", lambda c: _component(c, "aggregator")["rule_args"].__setitem__(
        "use_awpa", {"path": "subprocess.Popen", "args": {"args": ["id"]}}),
     "argument 'rule_args.use_awpa' is a dict FLARE would build as a component"),
    # an allowed class built from a dict argument (FLARE builds any dict naming 'path' / 'name')
    # each component is checked against the site's limits: many persistors just under the model
    # limit kept the server's gate busy for a minute
    ("persistor_twice", "server", lambda c: c["components"].append(
        {**next(x for x in c["components"] if x["id"] == "persistor"), "id": "persistor_2"}),
     "path 'fedpartial.flare.persistor.FedPartialPersistor' is named a second time"),
    # two training workflows (each from its own persistor's model) would keep the sites' UpdateMask
    # factors of the first model while the second's seed changes the signs: an outside attempt's design
    ("workflow_twice", "server", lambda c: c["workflows"].append({**c["workflows"][0], "id": "second"}),
     "path 'nvflare.app_common.workflows.scatter_and_gather.ScatterAndGather' is named a second time"),
    ("nested_allowed_component", "client", lambda c: c["task_result_filters"].append(
        {"tasks": ["train"], "filters": [{"path": "fedpartial.flare.filters.StatisticsPrivacyFilter", "args": {
            "preset": "fedlsm", "guards": {"path": "fedpartial.flare.filters.SendWeightDiff"}}}]}),
     "argument 'guards' is a dict FLARE would build as a component"),
    ("steps_of_nested", "client", lambda c: _executor(c).update(rule="fedavg", rule_args={"steps_of": {
         "rule": "fedavg", "rule_args": {"steps_of": {
         "rule": "fedlsm", "rule_args": {"batch_size": 1}}}}}), "'rule' ('fedavg') must be one of"),
    ("whole_site_pattern", "client", lambda c: _executor(c).__setitem__("data_file", "{site}"),
     "not '{site}' alone"),
    ("selector_weights", "server", lambda c: _component(c, "model_selector").__setitem__(
        "aggregation_weights", {"site-1": 0, "site-2": 1}),
     "argument 'aggregation_weights'"),
    ("component_by_name", "server", lambda c: c["components"].append({"id": "x", "name": "ScatterAndGather"}),
     "must name its class in 'path'"),
    ("fixed_argument", "server", lambda c: _component(c, "tb_receiver").__setitem__("tb_folder", "../../x"),
     "argument 'tb_folder' = '../../x' is fixed to 'tb_events'"),
    ("monai_weights", "server", lambda c: c["model"].update(arch="resnet18", arch_args={"pretrained": True}),
     "'arch_args' of resnet18 has 'pretrained'"),
    # a std of 1e6 makes every image the same input: the sites' losses and accuracies then count
    # their labels per class (an outside attempt decoded both sites' counts exactly)
    ("normalisation_that_erases_the_image", "client",
     lambda c: c["model"]["normalisation"].update(mean=0, std=10 ** 6), "(1000000) must be in [0.01, 1"),
    ("normalisation_offset", "server",
     lambda c: c["model"]["normalisation"].update(mean=[-1000.0]), "(-1000.0) must be in [0.0, 1.0]"),
    ("width_beyond_the_schema", "client", lambda c: c["model"]["arch_args"].__setitem__("width", 10 ** 6),
     "'width' (1000000) must be in [1, 65536]"),
    # each executor loads the site's data and builds its model: four idle ones took a site's job
    # process from 0.49 to 1.2 GB, each within the site's limits
    ("executors_multiply_the_limits", "client",
     lambda c: c["executors"].append({**copy.deepcopy(c["executors"][0]), "tasks": ["idle1"]}),
     "'executors' (2 entries) must hold one executor"),
]


@pytest.mark.parametrize("name, side, change, message", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_config_attacks_are_refused_naming_component_argument_and_raw_value(name, side, change, message):
    config = copy.deepcopy(_configs(REPO / "jobs" / "fedlsm")[side])
    change(config)
    with pytest.raises(JobRefused) as err:
        check_config(config, side)
    assert str(err.value).startswith(f"config_fed_{side}.json: "), err.value
    assert message in str(err.value), err.value
    assert "not-the-secret" not in str(err.value)


# ---- the gate at deployment: a participant's kit and the app FLARE unzipped -------------------------
def _kit(tmp_path: Path, server: bool, **file) -> Path:
    kit = tmp_path / ("server_kit" if server else "site_kit")
    (kit / "local").mkdir(parents=True)
    (kit / "startup").mkdir()
    if server:
        (kit / "startup" / "fed_server.json").write_text("{}")
    (kit / "local" / "fedpartial_site.json").write_text(json.dumps({"format_version": 1, "datasets": {}, **file}))
    return kit


def _deploy(kit: Path, job: Path, name: str) -> Path:
    app = kit / "job-1" / f"app_{name}"
    if app.parent.exists():
        shutil.rmtree(app.parent)
    shutil.copytree(job / "app", app)
    return app


def _job(tmp_path: Path, overrides=(), job="fedavg") -> Path:
    from fedpartial_tools.jobs.packaging import package_job

    out = tmp_path / f"job_{len(list(tmp_path.glob('job_*')))}"
    return Path(package_job(str(REPO / "jobs" / job), str(out), list(overrides), with_code=False, dataset="demo"))


def _edit(job: Path, side: str, change) -> Path:
    path = job / "app" / "config" / f"config_fed_{side}.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))
    return job


def test_the_gate_passes_a_packaged_job_and_refuses_an_attack_before_the_job_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("SECRET", "not-the-secret")
    server, site = _kit(tmp_path, True), _kit(tmp_path, False)
    job = _job(tmp_path)
    assert JobGate().validate(str(_deploy(server, job, "server"))) == ("", {})
    assert JobGate("client").validate(str(_deploy(site, job, "site-1"))) == ("", {})
    _edit(job, "client", _secret_pairs)
    err, _ = JobGate().validate(str(_deploy(server, job, "server")))  # the server sees the client config too
    assert err.startswith("the server refuses the job: config_fed_client.json: ") and "$SECRET[0]" in err, err
    err, _ = JobGate().validate(str(_deploy(site, job, "site-1")))
    assert err.startswith("site 'site-1' refuses the job: config_fed_client.json: "), err
    assert "not-the-secret" not in err


def test_the_gate_refuses_other_config_formats(tmp_path):
    site = _kit(tmp_path, False)
    app = _deploy(site, _job(tmp_path), "site-1")
    (app / "config" / "config_fed_client.conf").write_text('x = ${?SECRET}')
    err, _ = JobGate().validate(str(app))
    assert "its app holds ['config/config_fed_client.conf']; a job's app is its configs" in err, err


@pytest.mark.parametrize("planted", [
    # found by a job process walking the kit: would import every .py of ./drv as a communication driver
    {"config/comm_config.json": '{"comm_driver_path": "drv"}', "drv/probe.py": "import os"},
    {"config/resources.json": '{"allow_log_streaming": true}'},  # would stand for the kit's own
    {"config/log_config.json": "{}"},
    {"probe.py": "import os"},
    {"config/nested/.__nvfl_sig.json.py": "x"},
])
def test_the_gate_refuses_every_file_of_an_app_but_its_configs_and_flares_signature(tmp_path, planted):
    site = _kit(tmp_path, False)
    app = _deploy(site, _job(tmp_path), "site-1")
    for rel, text in planted.items():
        (app / rel).parent.mkdir(parents=True, exist_ok=True)
        (app / rel).write_text(text)
    err, _ = JobGate("client").validate(str(app))
    assert err.startswith(f"site 'site-1' refuses the job: its app holds {sorted(planted)}"), err


def test_the_gate_passes_flares_signature_and_refuses_links(tmp_path):
    site = _kit(tmp_path, False)
    app = _deploy(site, _job(tmp_path), "site-1")
    for folder in (app, app / "config"):  # what FLARE's deployment of a signed job leaves
        (folder / ".__nvfl_sig.json").write_text("{}")
        (folder / ".__nvfl_submitter.crt").write_text("cert")
    assert JobGate("client").validate(str(app)) == ("", {})
    (app / "config" / ".__nvfl_submitter.crt").unlink()
    (app / "config" / ".__nvfl_submitter.crt").symlink_to(site / "local")
    (app / "elsewhere").symlink_to(site / "local", target_is_directory=True)
    err, _ = JobGate("client").validate(str(app))
    assert "its app holds ['config/.__nvfl_submitter.crt', 'elsewhere']" in err, err


LIMIT_ATTACKS = [  # (overrides, side, the limit named, message part)
    (["model.arch_args.width=20000"], "server", "max_model_parameters", "parameters = "),
    (["model.arch_args.width=20000"], "client", "max_model_parameters", "parameters = "),
    (["rule_args.batch_size=100000"], "client", "max_batch_size", "rule_args.batch_size = 100000"),
    (["rule_args.num_views=1000"], "client", "max_views", "rule_args.num_views = 1000"),
    (["rule_args.loader_workers=64"], "client", "max_loader_workers", "rule_args.loader_workers = 64"),
    (["rule_args.local_epochs=5000"], "client", "max_local_epochs", "rule_args.local_epochs = 5000"),
    (["rule_args.local_iterations=10000000"], "client", "max_local_steps", "rule_args.local_iterations = 10000000"),
    (["num_rounds=100000"], "server", "max_rounds", "ScatterAndGather num_rounds = 100000"),
    # activations: a model with few parameters made wide at one layer, at a small batch (16 GiB a tensor)
    (['model.arch_args={"width": 65536, "depth": 1}', "model.input_size=[64,64]", "rule_args.batch_size=16"],
     "client", "max_activation_gib", "activations of a training batch = "),
    # a matched baseline copies the steps of the rule it names: that rule's epochs count as its own
    (['rule_args.steps_of={"rule": "fedlsm", "rule_args": {"local_epochs": 5000}}'], "client", "max_local_epochs",
     "rule_args.steps_of.rule_args.local_epochs = 5000"),
]


@pytest.mark.parametrize("overrides, side, limit, message", LIMIT_ATTACKS,
                         ids=[f"{a[2]}-{a[1]}" for a in LIMIT_ATTACKS])
def test_a_job_beyond_a_participants_limits_is_refused_before_anything_is_built(tmp_path, monkeypatch, overrides,
                                                                               side, limit, message):
    import torch

    from fedpartial.flare import common

    built, real = [], common.build_model_from_settings
    monkeypatch.setattr(common, "build_model_from_settings", lambda s: built.append(torch.get_default_device().type)
                        or real(s))
    kit = _kit(tmp_path, side == "server")
    app = _deploy(kit, _job(tmp_path, overrides), "server" if side == "server" else "site-1")
    err, _ = JobGate(side).validate(str(app))
    # the limit named, the kit's path not (a refusal reaches the submitter)
    assert message in err and f"('{limit}' in local/fedpartial_site.json" in err and str(kit) not in err, err
    assert set(built) <= {"meta"}, built  # counted on the meta device: nothing allocated
    # the participant's file decides: raised there, the same job passes
    # (the activations of a wide model or a large batch are the other limit such a job meets)
    (kit / "local" / "fedpartial_site.json").write_text(json.dumps({"format_version": 1, "datasets": {},
                                                                   "max_activation_gib": 10 ** 6, limit: 10 ** 12}))
    assert JobGate(side).validate(str(app)) == ("", {})


def test_a_site_refuses_adam_betas_that_make_every_step_a_gradient_sign(tmp_path):
    """Adam with beta1 = beta2 = 0 moves each weight by +-lr at every step: an outside attempt
    decoded 99.94 % of both sites' 3-step updates from one 2-site average."""
    kit = _kit(tmp_path, False)
    app = _deploy(kit, _job(tmp_path, ["rule_args.betas=[0, 0]"]), "site-1")
    err, _ = JobGate("client").validate(str(app))
    assert ("site 'site-1' refuses the job: FedPartialExecutor rule_args.betas = [0, 0]: Adam's beta2 below this "
            "participant's floor of 0.9 ('min_adam_beta2' in local/fedpartial_site.json)") in err, err
    app = _deploy(kit, _job(tmp_path, ["rule_args.betas=[0, 0.9]"]), "site-1")
    assert JobGate("client").validate(str(app)) == ("", {})


def test_a_site_refuses_a_weight_decay_that_makes_every_update_predictable(tmp_path):
    """At a tiny lr a decay that outweighs the data's gradient moves each weight by -lr x sign(its
    round-0 value): an outside attempt read the sites' secret UpdateMask factors from such a job
    (weight_decay 1.0) and divided them out of a later one."""
    kit = _kit(tmp_path, False)
    app = _deploy(kit, _job(tmp_path, ["rule_args.weight_decay=1.0"]), "site-1")
    err, _ = JobGate("client").validate(str(app))
    assert ("site 'site-1' refuses the job: FedPartialExecutor rule_args.weight_decay = 1.0 is above this "
            "participant's limit of 0.01 ('max_weight_decay' in local/fedpartial_site.json)") in err, err
    for allowed in ("0.01", "0.0005"):
        app = _deploy(kit, _job(tmp_path, [f"rule_args.weight_decay={allowed}"]), "site-1")
        assert JobGate("client").validate(str(app)) == ("", {})
    # the site's own file decides
    (kit / "local" / "fedpartial_site.json").write_text(json.dumps({"format_version": 1, "datasets": {},
                                                                   "max_weight_decay": 0.5}))
    app = _deploy(kit, _job(tmp_path, ["rule_args.weight_decay=0.3"]), "site-1")
    assert JobGate("client").validate(str(app)) == ("", {})


def test_the_round0_model_comes_from_the_server_kit_never_the_jobs_app_folder(tmp_path):
    server = _kit(tmp_path, True)
    job = _job(tmp_path, ['model.pretrained="crafted.pt"'])
    (job / "app" / "crafted.pt").write_bytes(b"weights the job brings")
    app = _deploy(server, job, "server")
    err, _ = JobGate().validate(str(app))
    assert "the server refuses the job: its app holds ['crafted.pt']" in err, err  # the job cannot bring it
    (app / "crafted.pt").unlink()
    err, _ = JobGate().validate(str(app))  # nor name a file of its own, wherever it is
    assert ("the server refuses the job: its 'model.pretrained' ('crafted.pt') is not in "
            "its kit's pretrained/ folder; the server's operator places the weights") in err, err
    (server / "pretrained").mkdir()
    (server / "pretrained" / "crafted.pt").write_bytes(b"the operator's file")
    assert JobGate().validate(str(app)) == ("", {})
    err, _ = JobGate().validate(str(_deploy(server, _job(tmp_path, ['server.resume_from="run_7"']), "server")))
    assert "its 'resume_from' ('run_7') is not in its kit's resume/ folder" in err and str(server) not in err, err


def test_a_kit_names_the_gate_or_says_so(tmp_path):
    kit = _kit(tmp_path, False)
    assert "cannot be read" in gate_error(str(kit), "site 'site-1'")
    (kit / "local" / "resources.json").write_text(json.dumps({"app_validator": {"path": "other.Validator"}}))
    assert "names no app_validator fedpartial.flare.job_gate.JobGate (has 'other.Validator')" in \
        gate_error(str(kit), "site 'site-1'")
    (kit / "local" / "resources.json").write_text(json.dumps({"app_validator": {"path": job_schema.__name__.replace(
        "job_schema", "job_gate.JobGate")}}))
    assert gate_error(str(kit), "site 'site-1'") == ""
    server = _kit(tmp_path / "s", True)
    (server / "local" / "resources.json").write_text(json.dumps({"app_validator": {"path": GATE_PATH},
                                                                 "components": []}))
    assert "names no component fedpartial.flare.job_gate.SubmissionGate" in gate_error(str(server), "the server")
    (server / "local" / "resources.json").write_text(json.dumps({"app_validator": {"path": GATE_PATH}, "components": [
        {"id": "submission_gate", "path": SUBMISSION_GATE_PATH, "args": {}}]}))
    assert gate_error(str(server), "the server") == ""


def test_check_app_reports_both_configs_at_the_server(tmp_path):
    server = _kit(tmp_path, True)
    job = _job(tmp_path)
    checked = check_app(str(_deploy(server, job, "server")), "server", str(server), "the server")
    assert set(checked) == {"server", "client"}
    rounds = _configs(job)["server"]["num_rounds"]  # "{num_rounds}" filled in as FLARE will
    assert checked["server"].args_of("ScatterAndGather")[0]["num_rounds"] == rounds


# ---- floors: a job may only make them stricter -----------------------------------------------------
def _participant(kit: Path):
    from unittest import mock

    from nvflare.apis.fl_context import FLContext

    fl_ctx = FLContext()
    engine = mock.MagicMock()
    engine.get_workspace.return_value.get_root_dir.return_value = str(kit)
    fl_ctx.set_prop("__engine__", engine, private=True, sticky=False)
    return fl_ctx


def test_a_sites_min_count_holds_whatever_the_jobs_filter_asks(tmp_path):
    from nvflare.apis.dxo import DXO, DataKind

    from fedpartial.flare.common import SITE_STATS
    from fedpartial.flare.filters import StatisticsPrivacyFilter

    stats = {"class_counts": np.array([3.0, 50.0]), "label_pos": np.array([3.0, 20.0]),
             "label_neg": np.array([0.0, 30.0]), "annotated_classes": np.array([1.0, 1.0])}
    site = _kit(tmp_path, False)  # min_count 5 by default
    for fl_ctx, expected in ((_participant(site), [0.0, 50.0]), (None, [3.0, 50.0])):  # None: development site
        dxo = DXO(DataKind.WEIGHTS, data={"w": np.zeros(1)}, meta={SITE_STATS: dict(stats)})
        out = StatisticsPrivacyFilter(preset="fedlsm", min_count=0).process_dxo(dxo, None, fl_ctx)
        assert list(out.get_meta_prop(SITE_STATS)["class_counts"]) == expected


def _aggregator_at_a_server(tmp_path, rule, task):
    """A RuleAggregator of a job asking min_sites_for_shared_stats=0, run in a provisioned server's
    kit (floor 3); ``_in_kit(fl_ctx, folder)`` moves it."""
    from fedpartial.flare.aggregators import RuleAggregator
    from helpers import aggregator_fl_ctx

    fl_ctx = aggregator_fl_ctx(tmp_path)
    _in_kit(fl_ctx, _kit(tmp_path, True))
    agg = RuleAggregator(rule=rule, min_sites_for_shared_stats=0, model={
        "arch": "small_cnn", "arch_args": {"width": 4, "depth": 1}, "in_channels": 1, "class_names": ["a", "b"],
        "task": task})
    return agg, fl_ctx


def _in_kit(fl_ctx, folder):
    fl_ctx.get_engine().get_workspace.return_value.get_root_dir.return_value = str(folder)


def test_a_servers_min_sites_for_shared_stats_holds_whatever_the_job_asks(tmp_path):
    from fedpartial.algorithms.base import SiteUpdate

    agg, fl_ctx = _aggregator_at_a_server(tmp_path, "fedlsm", "single-label")
    agg.rule.summed_stats = ("class_counts",)
    agg.updates = [SiteUpdate(site=s, weights={}, num_samples=10, stats={"class_counts": [1, 2]}, metrics={})
                   for s in ("site-1", "site-2")]
    from fedpartial.algorithms.base import ServerContext

    ctx = ServerContext(round=0, num_rounds=1, classifier_param_names=[], global_weights={}, global_stats={})
    out = agg._withhold_small_sums(fl_ctx, {"class_counts": np.array([2, 4]), "pos_weight": 1.0}, ctx)
    assert "class_counts" not in out and "pos_weight" in out  # the server's floor (3) applies
    assert ctx.report["withheld_from_sites"] == ["class_counts"]
    _in_kit(fl_ctx, tmp_path / "no_kit")
    assert "class_counts" in agg._withhold_small_sums(fl_ctx, {"class_counts": np.array([2, 4])}, ctx)


def test_a_class_one_site_validates_publishes_its_threshold_but_not_its_counts(tmp_path):
    """The server's floor (3) decides: class a from two sites and class b from one publish their
    thresholds, neither its F1 nor its counts; at a development server (the job's 0) both do."""
    from fedpartial.algorithms.base import ServerContext, SiteUpdate

    agg, fl_ctx = _aggregator_at_a_server(tmp_path, "fedavg", "multi-label")
    agg.updates = [SiteUpdate(site=s, weights={}, num_samples=10, stats={}, metrics={}) for s in ("site-1", "site-2")]
    # test_thresholds.py's two sites: a at both, b at site-1 only
    agg.histograms = {"site-1": {"pos": np.array([[0, 1, 0, 4], [1, 2, 1, 0]]),
                                 "neg": np.array([[3, 2, 1, 0], [3, 0, 0, 0]])},
                      "site-2": {"pos": np.array([[0, 0, 1, 2], [0, 0, 0, 0]]),
                                 "neg": np.array([[3, 1, 1, 1], [0, 0, 0, 0]])}}
    ctx = ServerContext(round=1, num_rounds=2, classifier_param_names=[], global_weights={}, global_stats={})
    agg._decision_thresholds(fl_ctx, ctx)
    per_class = ctx.report["decision_thresholds"]["per_class"]
    assert ctx.report["decision_thresholds"]["thresholds"] == {"a": 0.75, "b": 0.25}
    assert [per_class[c]["n_pos"] for c in "ab"] == [None, None] and per_class["b"]["f1"] is None
    _in_kit(fl_ctx, tmp_path / "no_kit")
    agg._decision_thresholds(fl_ctx, ctx)
    assert [ctx.report["decision_thresholds"]["per_class"][c]["n_pos"] for c in "ab"] == [8, 4]


def test_a_site_stops_a_job_past_its_hours(caplog):
    """Within every other limit a job can still ask for days a round: past max_job_hours from its
    first training task the site stops (the rules poll the abort between steps) and answers an error."""
    import time

    from nvflare.apis.dxo import DXO, DataKind
    from nvflare.apis.fl_constant import ReturnCode
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.signal import Signal

    from fedpartial.flare.executors import FedPartialExecutor

    ex = FedPartialExecutor(model={"arch": "small_cnn", "in_channels": 1, "class_names": ["a"], "task": "single-label"})
    ex.ready, ex.site, ex.rules = True, "site-1", {"max_rounds": 10, "max_job_hours": 1}
    task = DXO(DataKind.WEIGHTS, data={}).to_shareable()
    ex.first_train_at = time.time() - 2 * 3600
    assert ex._aborted()  # what a rule's loop sees between steps
    assert ex.execute("train", task, FLContext(), Signal()).get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert ("site 'site-1' stops the job: it has trained for more than this site's 1 hours ('max_job_hours'"
            in caplog.text)
    caplog.clear()
    ex.first_train_at = time.time() - 1800  # within: it goes on to train (and fails here, unset up)
    assert not ex._aborted()
    ex.execute("train", task, FLContext(), Signal())
    assert "stops the job" not in caplog.text


def test_a_site_refuses_rounds_beyond_its_limit(caplog):
    from nvflare.apis.dxo import DXO, DataKind
    from nvflare.apis.fl_constant import ReturnCode
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.signal import Signal
    from nvflare.app_common.app_constant import AppConstants

    from fedpartial.flare.executors import FedPartialExecutor

    ex = FedPartialExecutor(model={"arch": "small_cnn", "in_channels": 1, "class_names": ["a"], "task": "single-label"})
    ex.ready, ex.site, ex.rules = True, "site-1", {"max_rounds": 3}
    task = DXO(DataKind.WEIGHTS, data={}).to_shareable()
    task.set_header(AppConstants.CURRENT_ROUND, 0)
    task.set_header(AppConstants.NUM_ROUNDS, 4)
    assert ex.execute("train", task, FLContext(), Signal()).get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert "site 'site-1' refuses round 0 of 4: beyond this site's limit of 3 rounds ('max_rounds'" in caplog.text
    caplog.clear()
    task.set_header(AppConstants.NUM_ROUNDS, 3)  # within the limit: it goes on to train (and fails here, unset up)
    ex.execute("train", task, FLContext(), Signal())
    assert "refuses round" not in caplog.text


def test_floors_and_limits_have_documented_defaults_and_a_site_may_change_them():
    rules = site_rules({"path": "x", "max_batch_size": 32, "min_count": 10})
    assert rules == {**FLOORS, **FRACTION_BOUNDS, **LIMITS, **SUBMISSION_LIMITS, "max_batch_size": 32, "min_count": 10}
    with pytest.raises(ValueError, match="min_sites_per_round must be an integer >= 1"):
        site_rules({"path": "x", "min_sites_per_round": 0})
    with pytest.raises(ValueError, match=r"min_adam_beta2 must be a number in \[0, 1\), got 1"):
        site_rules({"path": "x", "min_adam_beta2": 1})
    deployment = (REPO / "docs" / "DEPLOYMENT.md").read_text()
    tables = {key: value for server, site, _, _ in PARTICIPANT_TABLES.values()
              for key, value in {**server, **site}.items()}
    for key, value in {**FLOORS, **FRACTION_BOUNDS, **LIMITS, **SUBMISSION_LIMITS, **tables}.items():
        shown = f"{value:,}" if isinstance(value, (int, float)) and not isinstance(value, bool) else \
            json.dumps(value).strip('"')
        assert f"`{key}`" in deployment and (shown in deployment or str(value) in deployment), key


def test_a_gate_that_fails_unexpectedly_refuses_naming_only_the_kind_of_error(tmp_path, monkeypatch):
    """What the gate says reaches the job's submitter: an unexpected failure refuses the job without
    its internals (a path, a library's message)."""
    from fedpartial.flare import job_gate

    site = _kit(tmp_path, False)
    app = _deploy(site, _job(tmp_path), "site-1")
    monkeypatch.setattr(job_gate, "check_app", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError(f"meta tensor failure in {site}/local")))
    err, _ = JobGate().validate(str(app))
    assert err == "site 'site-1' refuses the job: its configs could not be checked (RuntimeError)", err


def test_a_site_refuses_to_resize_its_images_beyond_its_limit(tmp_path):
    """The job sets the input size, the site holds the images: 10,000 RGB images at 1024 px are
    10,000 x 1024 x 1024 x 3 x 4 bytes = 117.2 GiB of float32, refused before anything is resized."""
    from fedpartial.flare.executors import load_site_dataset
    from fedpartial.flare.site_config import check_resized, resized_gib

    assert resized_gib(10_000, (1024, 1024), 3) == pytest.approx(10_000 * 1024 * 1024 * 3 * 4 / 2 ** 30)
    with pytest.raises(ValueError, match=r"site 'site-1' refuses the job: 10,000 images of 'site-1.npz' at "
                                         r"1024x1024 px = 117.2 GiB is beyond this participant's limit of 32 GiB "
                                         r"\('max_resized_gib'"):
        check_resized(10_000, (1024, 1024), 3, LIMITS["max_resized_gib"], "site 'site-1'", "/data/x/site-1.npz")
    check_resized(250, (64, 64), 3, LIMITS["max_resized_gib"], "site 'site-1'", "site-1.npz")  # 12 MiB passes
    # at load time, before resizing: site-1 of tests/test_provisioned.py holds 72 RGB images of 16 px
    # (32 train, 40 val); at 512 px they are 72 x 512 x 512 x 3 x 4 bytes = 0.21 GiB
    import numpy as np

    from test_provisioned import CLASSES, _write_sites

    _write_sites(tmp_path, np.random.default_rng(0))
    settings = {"task": "single-label", "class_names": CLASSES, "in_channels": 3, "input_size": [512, 512]}
    with pytest.raises(ValueError, match=r"72 images of 'site-1.npz' at 512x512 px = 0.2 GiB is beyond this "
                                         r"participant's limit of 0.2 GiB"):
        load_site_dataset(str(tmp_path / "site-1.npz"), "site-1", settings, max_resized_gib=0.2)
    assert load_site_dataset(str(tmp_path / "site-1.npz"), "site-1", settings,
                             max_resized_gib=0.25).splits["train"].images.shape[1:3] == (512, 512)


# ---- the job's meta at submission --------------------------------------------------------------
def test_the_submission_gate_passes_every_shipped_jobs_meta_and_refuses_a_chosen_id_or_other_keys():
    from fedpartial.flare.job_gate import meta_error

    for meta_file in sorted((REPO / "jobs").glob("*/meta.json")):
        meta = json.loads(meta_file.read_text())
        assert meta_error({**meta, "study": "default", "byoc": True}) == "", meta_file
    meta = json.loads((REPO / "jobs" / "fedavg" / "meta.json").read_text())
    assert "its meta sets 'job_id' ('local')" in meta_error({**meta, "job_id": "local"})
    assert "its meta holds ['launcher_spec', 'leak']" in meta_error({**meta, "leak": "x", "launcher_spec": {}})


def test_a_participant_reads_configs_as_json_only_once_its_gate_is_built(monkeypatch):
    from nvflare.fuel.utils.config import ConfigFormat
    from nvflare.fuel.utils.config_factory import ConfigFactory

    from fedpartial.flare.job_gate import SubmissionGate

    from nvflare.private.fed.server import job_cmds

    monkeypatch.setattr(ConfigFactory, "_fmt2Loader", dict(ConfigFactory._fmt2Loader))  # restored after
    monkeypatch.setattr(job_cmds, "JobMetaValidator", job_cmds.JobMetaValidator)
    monkeypatch.setenv("FEDPARTIAL_TEST_SECRET", "s3cr3t")
    hocon = 'name = "x"\nleak = ${?FEDPARTIAL_TEST_SECRET}'
    assert ConfigFactory.get_config_loader(ConfigFormat.PYHOCON).load_config_from_str(hocon).to_dict()["leak"] == \
        "s3cr3t"  # FLARE as installed
    SubmissionGate()
    for fmt in (ConfigFormat.PYHOCON, ConfigFormat.OMEGACONF):
        with pytest.raises(ValueError, match="as JSON only"):
            ConfigFactory.get_config_loader(fmt).load_config_from_str(hocon)
    assert ConfigFactory.get_config_loader(ConfigFormat.JSON).load_config_from_str('{"a": 1}').to_dict() == {"a": 1}


def _zip(job: Path, out: Path, compression) -> Path:
    import os
    import zipfile

    with zipfile.ZipFile(out, "w", compression) as zf:
        for path in sorted(job.rglob("*")):
            zf.write(path, os.path.join(job.name, path.relative_to(job)))
    return out


def test_an_upload_is_measured_before_flare_unpacks_any_of_it(tmp_path, monkeypatch):
    """FLARE unpacks a job's meta and stores the job in the server's process: 1 MB of DEFLATE holding
    1 GiB of zeros took 7 GB of the server's memory, a meta.json of 1 GiB of whitespace 2.4 GB. The
    zip's declared sizes are checked first; a shipped job is a few kB."""
    import zipfile

    from nvflare.private.fed.server import job_cmds

    from fedpartial.flare.job_gate import SubmissionGate, upload_error

    limits = dict(SUBMISSION_LIMITS)
    job = _job(tmp_path)
    assert upload_error(str(_zip(job, tmp_path / "ok.zip", zipfile.ZIP_STORED)), job.name, limits) == ""
    (job / "app" / "pad.bin").write_bytes(bytes(limits["max_job_bytes"]))  # zeros: 64 MiB, ~64 kB deflated
    bomb = _zip(job, tmp_path / "bomb.zip", zipfile.ZIP_DEFLATED)
    assert bomb.stat().st_size < 2 ** 20
    error = upload_error(str(bomb), job.name, limits)
    assert "the server refuses the job: its files unpacked, bytes: 67,1" in error and \
        "is beyond its limit of 67,108,864 ('max_job_bytes' in local/fedpartial_site.json" in error, error
    (job / "app" / "pad.bin").unlink()
    meta = json.loads((job / "meta.json").read_text())
    (job / "meta.json").write_text(json.dumps(meta)[:-1] + " " * limits["max_meta_bytes"] + "}")
    assert "its meta.json, bytes: 65," in upload_error(str(_zip(job, tmp_path / "meta.zip", zipfile.ZIP_DEFLATED)),
                                                        job.name, limits)
    (job / "meta.json").write_text(json.dumps(meta))
    for i in range(limits["max_job_files"]):
        (job / "app" / f"f{i}").write_text("")
    assert "its number of files and folders 1,0" in upload_error(str(_zip(job, tmp_path / "n.zip", zipfile.ZIP_STORED)),
                                                                  job.name, limits)
    # the server's submit command checks before FLARE's validator reads the meta
    monkeypatch.setattr(job_cmds, "JobMetaValidator", job_cmds.JobMetaValidator)
    monkeypatch.setattr("nvflare.fuel.utils.config_factory.ConfigFactory._fmt2Loader",
                        dict(__import__("nvflare.fuel.utils.config_factory", fromlist=["x"]).ConfigFactory._fmt2Loader))
    SubmissionGate()
    valid, error, _ = job_cmds.JobMetaValidator().validate(job.name, str(bomb))
    assert not valid and "('max_job_bytes' in local/fedpartial_site.json of the server's kit)" in error, error


@pytest.mark.parametrize("side, overrides, message", [
    ("server", ['weight_rule="median"'], "RuleAggregator weight_rule = 'median'; how the sites' updates are weighted "
                                         "is this participant's to decide ('mean', 'weight_rule' of 'weighting'"),
    ("server", ["cap_samples=false"], "RuleAggregator cap_samples = False;"),
    ("server", ["rule_args.unlabelled_weight=1.0"], "RuleAggregator rule_args.unlabelled_weight of rule 'fedirm' = 1.0;"),
    ("client", ['rule_args.weight_by="all_rows"'], "FedPartialExecutor rule_args.weight_by of rule 'fedavg' = "
                                                   "'all_rows'; how the sites' updates are weighted"),
], ids=["weight_rule", "cap_samples", "fedirm_unlabelled_weight", "weight_by"])
def test_a_job_leaves_the_weighting_to_each_participant(tmp_path, side, overrides, message):
    """Two jobs that differ only in the server's weight_rule (mean, median) gave a lead the two sites'
    local models, solved from the two downloaded averages. How updates are weighted is the
    participant's; a development site (no kit file) lets the bench vary it."""
    from fedpartial.flare.site_config import check_participant_tables

    job_name = "fedirm" if "unlabelled" in overrides[0] else "fedavg"
    server_side = side == "server"
    target = {"server": "server", "client": "site-1"}[side]
    kit = _kit(tmp_path, server_side)
    base = _job(tmp_path, job=job_name)
    assert JobGate(side).validate(str(_deploy(kit, base, target))) == ("", {})  # the shipped values pass
    sets = [o if side == "client" or o.startswith("rule_args") is False else o for o in overrides]
    job = _edit(_job(tmp_path, job=job_name), side, lambda c: _set_weighting(c, side, sets[0]))
    err, _ = JobGate(side).validate(str(_deploy(kit, job, target)))
    assert message in err and str(kit) not in err, err
    key, _, value = sets[0].partition("=")
    key = key.replace("rule_args.", f"{job_name}." if side == "server" or "weight_by" in key else "")
    (kit / "local" / "fedpartial_site.json").write_text(json.dumps({"format_version": 1, "datasets": {},
                                                                   "weighting": {key: json.loads(value)}}))
    if key == "weight_rule":  # an unweighted server asks every site for the same number of steps
        _edit(job, "client", lambda c: _set_weighting(c, "client", "rule_args.local_iterations=5"))
    assert JobGate(side).validate(str(_deploy(kit, job, target))) == ("", {})  # the participant's own choice
    check_participant_tables(check_config(_configs(job)[side], side), None, side, "dev", "none")  # development: any


def test_an_unweighted_server_asks_every_site_for_the_same_number_of_steps(tmp_path):
    """Under trimmed_mean two sites of 2 and 4 steps (local_epochs 0.55 of 479 and 1861 rows) gave
    an outside attempt 91 % / 96 % of their update signs: each update is about +-steps x lr per
    weight, so its size tells the sites apart. Such a server runs only fixed step counts."""
    unweighted = {"weight_rule": "trimmed_mean", "trim_fraction": 0}
    kit = _kit(tmp_path, True, weighting=unweighted)
    server_sets = ["weight_rule=trimmed_mean", "trim_fraction=0"]

    def refusal(overrides, job="fedavg"):
        return JobGate("server").validate(str(_deploy(kit, _job(tmp_path, server_sets + overrides, job), "server")))[0]

    for overrides, job, rule in (([], "fedavg", "fedavg"), (["rule_args.local_epochs=0.55"], "fedavg", "fedavg"),
                                 (["rule_args.local_iterations=5", 'rule_args.steps_of={"rule": "fedlsm"}'],
                                  "fedavg", "fedavg"),  # the compute-matched FedAvg: the method's steps per site
                                 ([], "fedmlp", "fedmlp")):
        err = refusal(overrides, job)
        assert (f"the server refuses the job: FedPartialExecutor rule '{rule}' does not make one fixed number of steps "
                f"at every site; this server combines the sites' updates unweighted ('trimmed_mean', 'weight_rule' of "
                f"'weighting' in local/fedpartial_site.json)") in err and str(kit) not in err, (job, err)
    assert refusal(["rule_args.local_iterations=5"]) == ""
    assert refusal(["rule_args.local_iterations=30"], "fedlsm") == ""
    # a size-weighted server (the default) leaves the step count to the job
    mean_kit = _kit(tmp_path / "mean", True)
    assert JobGate("server").validate(str(_deploy(mean_kit, _job(tmp_path), "server"))) == ("", {})


@pytest.mark.parametrize("side, assignment, key", [("client", "rule_args.high=0.4022", "fedmlp.high"),
                                                   ("server", "rule_args.t1=0.01", "fedmlp.t1")])
def test_a_job_leaves_the_selection_of_what_a_site_sends_to_each_participant(tmp_path, side, assignment, key):
    """FedMLP's learning degree at high 0.4021 and 0.4022, two jobs otherwise the same, published 3
    and then 1 of a site's images: a per-image score oracle. The thresholds that select the images
    behind what a site sends are the participant's ('statistics' of its file)."""
    target = {"server": "server", "client": "site-1"}[side]
    kit = _kit(tmp_path, side == "server")
    assert JobGate(side).validate(str(_deploy(kit, _job(tmp_path, job="fedmlp"), target))) == ("", {})
    job = _edit(_job(tmp_path, job="fedmlp"), side, lambda c: _set_weighting(c, side, assignment))
    err, _ = JobGate(side).validate(str(_deploy(kit, job, target)))
    value = json.loads(assignment.partition("=")[2])
    assert (f"rule_args.{key.split('.')[1]} of rule 'fedmlp' = {value}; which images enter what a site sends is "
            f"this participant's to decide") in err and f"'{key}' of 'statistics' in local/fedpartial_site.json" \
        in err and str(kit) not in err, err
    (kit / "local" / "fedpartial_site.json").write_text(json.dumps({"format_version": 1, "datasets": {},
                                                                   "statistics": {key: value}}))
    assert JobGate(side).validate(str(_deploy(kit, job, target))) == ("", {})  # the participant's own choice


def _set_weighting(config, side, assignment):
    key, _, value = assignment.partition("=")
    if side == "server":
        args = next(c for c in config["components"] if c["path"].endswith("RuleAggregator"))["args"]
    else:
        args = config["executors"][0]["executor"]["args"]
    if key.startswith("rule_args."):
        args = args.setdefault("rule_args", {})
        key = key[len("rule_args."):]
    args[key] = json.loads(value)


def test_the_weighting_names_arguments_of_the_schema_and_every_shipped_job_runs_at_a_provisioned_kit(every_job):
    """Each weighting key is an argument the schema lets a job write (a renamed argument would leave
    the participant's choice unchecked), and every job a user can make for production (the shipped
    jobs and the recipes' profiles) runs with a kit's defaults."""
    from fedpartial.flare.site_config import check_participant_tables

    aggregator = COMPONENTS["fedpartial.flare.aggregators.RuleAggregator"].args
    for server_table, site_table, _, _ in PARTICIPANT_TABLES.values():
        for side, table, rules in (("server", server_table, job_schema.SERVER_RULE_ARGS),
                                   ("client", site_table, job_schema.CLIENT_RULE_ARGS)):
            for key in table:
                rule, _, arg = key.rpartition(".")
                assert (arg in rules[rule]) if rule else (side == "server" and arg in aggregator), key
    refused = {}
    for job in every_job:
        for side, config in _configs(job).items():
            try:
                check_participant_tables(check_config(config, side), {"path": "kit"}, side, job.name, "kit")
            except ValueError as e:
                refused.setdefault(job.name, []).append(str(e))
    # profiles that keep the paper's weighting or thresholds, or a data set's (FedIRM's paper and
    # multi-label: its cpu weight was measured on HAM10000 only; FedIA on COVID lungs: the paper's 40
    # warm-up rounds; FedLSM on 14 classes: its confident share): a consortium running one says so in
    # its kits' files, and the same job then runs
    own = {"fedirm-multilabel": {"server": {"weighting": {"fedirm.unlabelled_weight": 1.0}},
                                 "client": {"statistics": {"fedirm.reliable_fraction": 0.0}}},
           "fedirm-paper": {"server": {"weighting": {"fedirm.unlabelled_weight": 1.0}},
                            "client": {"statistics": {"fedirm.reliable_fraction": 0.0}}},
           "fedia-covid": {"server": {"weighting": {"fedia.warmup_rounds": 40}},
                           "client": {"statistics": {"fedia.correction_threshold": 0.8}}},
           "fedia-paper": {"client": {"statistics": {"fedia.correction_threshold": 0.8}}},
           "fedia-lesions": {"client": {"statistics": {"fedia.correction_threshold": 0.8}}},
           "fedmlp-paper": {"server": {"statistics": {"fedmlp.t0": 0.005, "fedmlp.t1": 0.01}}},
           **{name: {"client": {"statistics": {"fedlsm.confident_fraction": 0.21,
                                               "fedlsm.uncertain_fraction": 0.053}}}
              for name in ("fedlsm-multilabel", "fedlsm-multilabel_paper")}}
    assert sorted(refused) == sorted(own), refused
    for name, sides in own.items():
        for side, tables in sides.items():  # each side refuses at its first key
            key, value = next(iter(next(iter(tables.values())).items()))
            said = f"rule_args.{key.split('.')[1]} of rule '{key.split('.')[0]}' = {value}"
            assert any(said in message for message in refused[name]), refused[name]
        job = next(j for j in every_job if j.name == name)
        for side, config in _configs(job).items():
            check_participant_tables(check_config(config, side), {"path": "kit", **sides.get(side, {})}, side,
                                     job.name, "kit")


def test_a_job_brings_no_filter_that_changes_the_weights_a_site_sends(tmp_path):
    """PercentilePrivacy clips each site's update at gamma x its published sample count: a clipped job
    and a plain one are two combinations of the same local models, solved for 70 % of both sites'
    updates. At a provisioned participant only its own privacy.json adds such a filter."""
    from fedpartial.flare.site_config import check_job_filters

    def clipped(config):
        config.setdefault("task_result_filters", []).append({"tasks": ["train"], "filters": [{
            "path": "nvflare.app_common.filters.percentile_privacy.PercentilePrivacy",
            "args": {"percentile": 0, "gamma": 1.1e-6, "data_kinds": ["WEIGHT_DIFF"]}}]})

    job = _edit(_job(tmp_path), "client", clipped)
    message = ("refuses the job: its filter PercentilePrivacy (client.filters) changes the weights each site "
               "sends by the job's arguments; a site adds it in its own local/privacy.json")
    for side, name, where in (("server", "server", "the server"), ("client", "site-1", "site 'site-1'")):
        err, _ = JobGate(side).validate(str(_deploy(_kit(tmp_path / side, side == "server"), job, name)))
        assert err.startswith(f"{where} {message}"), err
    check_job_filters(check_config(_configs(job)["client"], "client"), None, "dev")  # the bench measures it


def _stats_filter(config, **args):
    chain = config["task_result_filters"][0]
    chain["filters"][0]["args"] = {**chain["filters"][0]["args"], **args}


@pytest.mark.parametrize("change, message", [
    (lambda c: _stats_filter(c, clip={"class_counts": [0, 10]}),
     "its filter StatisticsPrivacyFilter sets ['clip']: a job's statistics filter names the method's preset"),
    (lambda c: _stats_filter(c, min_count=100),
     "its filter StatisticsPrivacyFilter min_count = 100 is above this participant's 5"),
    (lambda c: c.__setitem__("task_result_filters", []),
     "its rule 'fedlsm' sends statistics, and its client config has no StatisticsPrivacyFilter with the preset "
     "'fedlsm' on its training task 'train'"),
    (lambda c: c["task_result_filters"][0].__setitem__("tasks", ["other"]),
     "has no StatisticsPrivacyFilter with the preset 'fedlsm' on its training task 'train'"),
], ids=["clip", "min_count_between_sites", "no_filter", "other_task"])
def test_every_job_of_a_method_sends_its_statistics_through_the_same_filter(tmp_path, change, message):
    """Two FedLSM jobs that differ only in their statistics filter (counts clipped, or a min_count
    between the two sites' counts) gave the server other class-wise row weights for the same local
    models: an outside attempt solved both sites' classifier rows. At a provisioned site the job's
    filter is the method's preset; the shipped job passes."""
    site = _kit(tmp_path, False)
    assert JobGate("client").validate(str(_deploy(site, _job(tmp_path, job="fedlsm"), "site-1"))) == ("", {})
    job = _edit(_job(tmp_path, job="fedlsm"), "client", change)
    err, _ = JobGate("client").validate(str(_deploy(site, job, "site-1")))
    assert err.startswith("site 'site-1' refuses the job: ") and message in err, err
