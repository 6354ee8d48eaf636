"""The red-team suite: a lead's jobs WITHOUT code against a provisioned one-machine system whose kits
are exactly as provisioned (``SitePolicyBuilder`` defaults: exact component allow-list, no byoc, no
log streaming, the shipped ``privacy.json``, each site offering one dataset, ``demo``).

Each attack is a job the lead submits; each must be refused at deployment or fail at its start
with a reason naming what was refused, and nothing may reach the server or a peer: no marker
file, no local model, no site log, no statistic below the sites' minimum count. A control job in
the same system completes. The sites run the checkout's runtime (the venv's fedpartial), as in the
rehearsal of docs/DEPLOYMENT.md §2.4.

One system per module; the finalizer kills every process it started, even on failure.
"""
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

from fedpartial_tools.deploy import admin
from helpers import running_system
from fedpartial_tools.jobs.packaging import package_job

from test_provisioned import CLASSES, _write_sites

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.filterwarnings("ignore:ssl_context is deprecated:DeprecationWarning")]
SITES = ["site-1", "site-2"]
DATASET = "demo"
OVERRIDES = ["num_rounds=1", "server.min_clients=2", f"model.class_names={json.dumps(CLASSES)}",
             "model.input_size=[16,16]", "model.in_channels=3", "model.arch_args.width=8",
             "rule_args.batch_size=4", "device=cpu"]
# FedLSM's MixUp pairs come out of the batch: a batch of 4 leaves room for 2
JOB_OVERRIDES = {"fedlsm": ["rule_args.ude_pairs=2"]}


# a secret in every participant's environment, as a kit's service might hold one
SECRET_VAR, SECRET = "FEDPARTIAL_RED_TEAM_SECRET", "s3cr3t-ab"


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    root = tmp_path_factory.mktemp("red_team")
    offered, other = root / "offered", root / "other_study"
    for folder in (offered, other):
        folder.mkdir()
        _write_sites(folder, np.random.default_rng(0))
    # the kits as a consortium provisions them: SitePolicyBuilder with project.yml's arguments
    policy = {"allow_byoc": False, "privacy_file": str(REPO / "provisioning" / "privacy.json"),
              "datasets": {DATASET: str(offered)}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SECRET_VAR, SECRET)
        with running_system(root, "red_team", SITES, policy) as system:
            yield dict(system, offered=offered, other=other, storage=root / "storage")


def _job(tmp_path, name, overrides=(), job="fedavg", **kwargs) -> Path:
    kwargs.setdefault("dataset", DATASET)
    return Path(package_job(str(REPO / "jobs" / job), str(tmp_path / name),
                            OVERRIDES + JOB_OVERRIDES.get(job, []) + list(overrides),
                            with_code=False, name=name, **kwargs))


def _edit(job: Path, side: str, change) -> None:
    path = job / "app" / "config" / f"config_fed_{side}.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config, indent=1))


def _run(system, tmp_path, job: Path, timeout=180) -> dict:
    session = admin.new_admin_session(system["kits"]["lead"], timeout=30)
    try:
        return admin.run_job(session, str(job), str(tmp_path / "download"), timeout=timeout, log=lambda m: None)
    finally:
        session.close()


def _log_span(path: Path) -> tuple:
    """The first and last timestamps of a FLARE log (``2026-11-29 19:25:58,649``: sortable as text)."""
    stamps = re.findall(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", path.read_text(errors="replace"), re.M)
    assert stamps, f"no timestamped line in {path}"
    return stamps[0], stamps[-1]


def _logs(system, result) -> dict:
    """Each site's log of the job (in its kit), the server's job log (downloaded with the job) and
    the server's main log."""
    out = {}
    for site in SITES:
        path = system["prod"] / site / result["job_id"] / "log.txt"
        out[site] = path.read_text(errors="replace") if path.is_file() else ""
    out["localhost"] = Path(result["server_log"]).read_text(errors="replace") if result["server_log"] else ""
    out["server_main"] = (system["prod"] / "localhost" / "log.txt").read_text(errors="replace")
    for site in SITES:  # where a site's job gate logs what it refused at deployment
        out[f"{site}_main"] = (system["prod"] / site / "log.txt").read_text(errors="replace")
    return out


def _no_marker(system, tmp_path):
    hits = [p for base in (system["root"], tmp_path) for p in base.rglob("pwned*")]
    assert not hits, f"the attack's command ran: {hits}"


def _failed(result):
    assert result["status"] != "FINISHED:COMPLETED" and not result["global_model"], result["status"]


# ---- 1. code from configs --------------------------------------------------------------------
@pytest.mark.slow
def test_a_rule_naming_a_command_runs_nothing_at_the_sites(system, tmp_path):
    marker = tmp_path / "pwned_site"

    def attack(config):
        args = config["executors"][0]["executor"]["args"]
        args["rule"], args["rule_args"] = "subprocess.run", {"args": ["sh", "-c", f"id > {marker}"]}
    job = _job(tmp_path, "rule_cmd")
    _edit(job, "client", attack)
    _two_apps(job)  # the server never sees the client config: each site's gate decides
    result = _run(system, tmp_path, job)
    _failed(result)
    logs = _logs(system, result)
    for site in SITES:
        assert (f"site '{site}' refuses the job: config_fed_client.json: component "
                f"fedpartial.flare.executors.FedPartialExecutor (executors[0].executor), argument 'rule' = "
                f"'subprocess.run' must be one of ['fedavg'") in logs[f"{site}_main"], site
    _no_marker(system, tmp_path)


@pytest.mark.slow
def test_a_rule_naming_a_command_runs_nothing_at_the_server(system, tmp_path):
    marker = tmp_path / "pwned_server"

    def attack(config):
        aggregator = next(c for c in config["components"] if c["id"] == "aggregator")
        aggregator["args"]["rule"] = "subprocess.run"
        aggregator["args"]["rule_args"] = {"args": ["sh", "-c", f"id > {marker}"]}
    job = _job(tmp_path, "server_rule_cmd")
    _edit(job, "server", attack)
    result = _run(system, tmp_path, job)
    _failed(result)
    assert ("the server refuses the job: config_fed_server.json: component 'aggregator' "
            "(fedpartial.flare.aggregators.RuleAggregator), argument 'rule' = 'subprocess.run' must be one of"
            in _logs(system, result)["server_main"])
    _no_marker(system, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("side, path, args", [
    # a runtime function, admitted by a "fedpartial." prefix; FLARE would call it with the args
    ("client", "fedpartial.algorithms.registry.build_rule", {"side": "client", "name": "fedavg"}),
    ("server", "fedpartial.flare.common.atomic_write_json", {"path": "pwned_json", "obj": {}}),
    # a test-only recorder that writes pickles wherever a config says
    ("client", "fedpartial.flare.recorder.MessageRecorder", {"folder": "pwned_recorder"}),
    # FLARE's log streamer (on FLARE's default list) and peer-to-peer controllers
    ("client", "nvflare.app_common.logging.job_log_streamer.JobLogStreamer", {}),
    ("server", "nvflare.app_common.workflows.cyclic_ctl.CyclicController", {}),
    ("client", "nvflare.app_common.ccwf.swarm_client_ctl.SwarmClientController", {}),
])
def test_components_off_the_allow_list_are_refused(system, tmp_path, side, path, args):
    job = _job(tmp_path, "component")
    _edit(job, side, lambda config: config["components"].append({"id": "attack", "path": path, "args": args}))
    result = _run(system, tmp_path, job)
    _failed(result)
    # the server's job gate refuses it at deployment, before FLARE's allow-list would
    assert (f"the server refuses the job: config_fed_{side}.json: component 'attack' ({path}) is not one a job "
            f"may name") in _logs(system, result)["server_main"], path
    _no_marker(system, tmp_path)


# ---- 2. data and writes: the site decides -------------------------------------------------------
@pytest.mark.slow
def test_a_job_pointing_at_data_the_site_did_not_offer_is_refused(system, tmp_path):
    job = _job(tmp_path, "other_data", dataset=None, data_root=str(system["other"]))
    result = _run(system, tmp_path, job)
    _failed(result)
    logs = _logs(system, result)
    for site in SITES:
        assert f"site '{site}' refuses the job: it sets 'data_root' ('{system['other']}')" in logs[site]
        assert f"offers the datasets: {DATASET}" in logs[site]
        assert "training images from" not in logs[site]  # no image was read


@pytest.mark.slow
def test_a_job_writing_outside_its_run_folder_is_refused(system, tmp_path):
    target = tmp_path / "pwned_state"
    job = _job(tmp_path, "state_out", [f"client.state_dir={json.dumps(str(target))}"])
    result = _run(system, tmp_path, job)
    _failed(result)
    assert (f"argument 'state_dir' = '{target}' must be a relative path without '..'"
            in _logs(system, result)["server_main"])
    assert not target.exists()
    kit_local = system["prod"] / "site-1" / "local"
    job2 = _job(tmp_path, "state_kit", ['client.state_dir="../local"'])
    _two_apps(job2)
    result = _run(system, tmp_path, job2)
    _failed(result)
    assert "argument 'state_dir' = '../local' must be a relative path without '..'" in \
        _logs(system, result)["site-1_main"]
    assert not (kit_local / "site-1").exists()


@pytest.mark.slow
def test_a_job_naming_no_runtime_version_is_refused(system, tmp_path):
    job = _job(tmp_path, "no_version", runtime_version="")
    result = _run(system, tmp_path, job)
    _failed(result)
    logs = _logs(system, result)
    assert "refuses the job: it names no 'runtime_version'" in logs["localhost"] + logs["site-1"] + logs["site-2"]


# ---- 3. what leaves a site ------------------------------------------------------------------------
@pytest.mark.slow
def test_a_renamed_submit_task_gets_no_local_model_and_logs_stay_at_the_sites(system, tmp_path):
    """Cross-site evaluation under another task name: the sites' gate withholds their local models
    by content. The FedLSM job completes (it is the control too: the data the site offers is read),
    and no count below the sites' minimum reached the server."""
    def rename_client(config):
        config["executors"][0]["tasks"] = ["train", "validate", "get_weights"]
        config["executors"][0]["executor"]["args"]["submit_model_task_name"] = "get_weights"

    def rename_server(config):
        cross = next(w for w in config["workflows"] if w["id"] == "cross_site_validate")
        cross["args"]["submit_model_task_name"] = "get_weights"
    job = _job(tmp_path, "renamed_submit", job="fedlsm")
    _edit(job, "client", rename_client)
    _edit(job, "server", rename_server)
    result = _run(system, tmp_path, job)
    assert result["status"] == "FINISHED:COMPLETED", result["status"]
    assert result["global_model"]
    cross = json.loads(Path(result["cross_site_val"]).read_text())
    for site, models in cross.items():  # only the server's models were validated: no site model left
        assert all(name.startswith("SRV_") for name in models), models
    logs = _logs(system, result)
    for site in SITES:
        assert f"site '{site}'" in logs[site] and "training images from" in logs[site]
    # what the server recorded of each site: counts only from >= 5 images, no key the policy does not know
    from fedpartial.flare.result_policy import METRIC_RULES
    # what the aggregator adds of each site: sizes, sample count, validation, per-class val counts
    # (summed from the histograms the policy released: >= 5 positives and negatives)
    recorded_by_server = {"bytes_stats", "bytes_weights", "num_samples", "val", "val_counts"}
    rounds = json.loads(Path(result["metrics"]).read_text())["rounds"]
    for entry in rounds:
        for site, metrics in entry["sites"].items():
            unknown = set(metrics) - set(METRIC_RULES) - recorded_by_server
            assert not unknown, (site, unknown)
            for key in ("num_pseudo_positive", "num_pseudo_negative", "n_confident", "n_uncertain", "samples_seen"):
                assert metrics.get(key, 5) >= 5, (site, key, metrics[key])
    # no line of a site's log reached the server: not in the download, not in the server's job store
    # (each site's job log says where it read its data; log streaming is off in the kits)
    site_line = f"training images from {system['offered']}"
    assert site_line in logs["site-1"]
    for base in (Path(result["result_dir"]), system["storage"]):
        for path in (p for p in base.rglob("*") if p.is_file()):
            assert site_line.encode() not in path.read_bytes(), f"a site's log line reached {path}"


@pytest.mark.slow
def test_an_admin_of_another_org_cannot_read_a_sites_files(system):
    """admin@hospital-a.org (project_admin) at site-2 (hospital_b): no shell commands."""
    session = admin.new_admin_session(system["kits"]["project_admin"], timeout=30)
    try:
        with pytest.raises(Exception) as err:
            reply = session.cat_target("site-2", file="log.txt")
            raise AssertionError(f"cat answered: {reply[:200]}")
        assert "not authorized" in str(err.value).lower() or "authoriz" in str(err.value).lower(), err.value
        # its own org's site still answers (the right exists, for the site's own people)
        assert session.ls_target("site-1") is not None
    finally:
        session.close()


# ---- attacks found by an outside attempt on a provisioned system --------------------------------
@pytest.mark.slow
def test_a_data_file_naming_a_reference_copy_is_refused(system, tmp_path):
    """split writes reference/<site>_full.npz (complete labels) inside its output folder, which a
    site may offer whole."""
    job = _job(tmp_path, "reference_copy", ['client.data_file="reference/{site}_full.npz"'])
    result = _run(system, tmp_path, job)
    _failed(result)
    logs = _logs(system, result)
    for site in SITES:
        assert "its 'data_file' ('reference/{site}_full.npz') is not one of ['{site}.npz']" in logs[site]
        assert "training images from" not in logs[site]


@pytest.mark.slow
def test_a_job_on_one_site_gets_no_global_model_of_it(system, tmp_path):
    """deploy_map to one hospital with min_clients 1: its one-site "aggregate" is its local model."""
    job = _job(tmp_path, "one_site", ["server.min_clients=1"])
    meta = json.loads((job / "meta.json").read_text())
    meta.update(deploy_map={"app": ["server", "site-2"]}, min_clients=1)
    (job / "meta.json").write_text(json.dumps(meta))
    result = _run(system, tmp_path, job)
    _failed(result)
    assert "only 1 valid update(s) with samples, 2 needed" in _logs(system, result)["localhost"]
    rounds = json.loads(Path(result["metrics"]).read_text())["rounds"] if result["metrics"] else []
    assert not rounds, rounds


@pytest.mark.slow
def test_cross_site_validation_under_the_train_task_name_gets_no_local_model(system, tmp_path):
    """The server's cross-site evaluation asks each site to 'validate' under the task name 'train':
    the site trains and answers with weights, which its gate withholds (the request carries
    MODEL_OWNER), so the download holds no site's model."""
    from nvflare.apis.dxo import DataKind, from_file

    def attack(config):
        cross = next(w for w in config["workflows"] if w["id"] == "cross_site_validate")
        cross["args"]["validation_task_name"] = "train"
    job = _job(tmp_path, "validate_as_train")
    _edit(job, "server", attack)
    result = _run(system, tmp_path, job)
    assert result["global_model"], result["status"]
    answers = list(Path(result["result_dir"]).rglob("result_shareables/*"))
    kinds = []
    for path in answers:
        try:
            kinds.append(from_file(str(path)).data_kind)
        except Exception:  # an empty answer holds no DXO
            kinds.append(None)
    assert DataKind.WEIGHTS not in kinds, (answers, kinds)
    for site in SITES:
        assert "withheld: it carries model weights but the task asked to validate a model" in \
            _logs(system, result)[site]


@pytest.mark.slow
def test_monai_weight_loading_through_arch_args_is_refused(system, tmp_path):
    secret = tmp_path / "server_private.pt"
    secret.write_bytes(b"not weights")
    job = _job(tmp_path, "arch_pretrained", ["model.arch=resnet18",
                                               f'model.arch_args={{"pretrained": "{secret}"}}'])
    result = _run(system, tmp_path, job)
    _failed(result)
    assert "'arch_args' of resnet18 has 'pretrained', which is not one of" in _logs(system, result)["server_main"]


@pytest.mark.slow
def test_a_job_giving_one_site_other_settings_is_refused(system, tmp_path):
    """Two client apps: site-2's trains with other settings (here a learning rate of 1e-12; a filter that
    zeroed its update is refused by the sites' gates on its own), so the "average" would be site-1's
    local model times its weight."""
    import shutil

    job = _job(tmp_path, "two_apps")
    shutil.copytree(job / "app", job / "app2")
    _edit(job, "client", lambda c: None)
    client2 = job / "app2" / "config" / "config_fed_client.json"
    config = json.loads(client2.read_text())
    config["executors"][0]["executor"]["args"].setdefault("rule_args", {})["lr"] = 1e-12
    client2.write_text(json.dumps(config))
    meta = json.loads((job / "meta.json").read_text())
    meta["deploy_map"] = {"app": ["server", "site-1"], "app2": ["site-2"]}
    (job / "meta.json").write_text(json.dumps(meta))
    result = _run(system, tmp_path, job)
    _failed(result)
    assert "the server refuses the job: its deploy_map gives the sites 2 different apps (app, app2)" in \
        _logs(system, result)["localhost"]


@pytest.mark.slow
def test_a_round_on_one_image_sends_nothing(system, tmp_path):
    """One iteration of batch size 1: the loss, and the weights' change, are one image's."""
    job = _job(tmp_path, "one_image", ["rule_args.local_iterations=1", "rule_args.batch_size=1"])
    result = _run(system, tmp_path, job)
    _failed(result)
    logs = _logs(system, result)
    # the first site to answer ends the round (its answer is empty); the other may not get to train
    assert any("result withheld: WEIGHTS trained on 1 image(s), fewer than 5" in logs[s] for s in SITES), logs
    rounds = json.loads(Path(result["metrics"]).read_text())["rounds"] if result["metrics"] else []
    assert not rounds, rounds
    server_tb = list(Path(result["result_dir"]).rglob("tb_events/*/events.*"))
    for path in server_tb:  # no curve of that round reached the server either
        assert b"train/train_loss" not in path.read_bytes(), path


@pytest.mark.slow
def test_a_local_model_of_one_optimizer_step_is_withheld(system, tmp_path):
    """One Adam step moves every weight by +-lr: an outside attempt decoded both sites' gradient signs
    (94,374 and 94,375 of 94,375 parameters) from one 2-site average of 5-image steps. Five images
    pass the count floor; one step does not pass the site's min_local_steps (2)."""
    job = _job(tmp_path, "one_step", ["rule_args.local_iterations=1", "rule_args.batch_size=5"])
    result = _run(system, tmp_path, job)
    _failed(result)
    logs = _logs(system, result)
    assert any("result withheld: WEIGHTS of 1 optimizer step(s), fewer than 2 ('min_local_steps')" in logs[s]
               for s in SITES), logs
    rounds = json.loads(Path(result["metrics"]).read_text())["rounds"] if result["metrics"] else []
    assert not rounds, rounds


@pytest.mark.slow
def test_a_site_runs_one_job_at_a_time_and_the_next_waits_in_the_queue(system, tmp_path):
    """Every limit is per job, and the server starts up to 4 jobs at once: an outside attempt ran 4
    jobs at each site together, 4 times what one job may ask of its memory. A site's resource
    manager holds it to its max_concurrent_jobs (1): the second job waits SUBMITTED until the
    first has ended at the sites, then runs and completes."""
    first, second = _job(tmp_path, "first", ["num_rounds=3"]), _job(tmp_path, "second")
    session = admin.new_admin_session(system["kits"]["lead"], timeout=30)
    try:
        ids = [session.submit_job(str(first)), session.submit_job(str(second))]
        seen, deadline = set(), time.time() + 300
        while time.time() < deadline:
            status = tuple(session.get_job_meta(i)["status"] for i in ids)
            seen.add(status)
            if all(s.startswith("FINISHED") for s in status):
                break
            time.sleep(0.5)
    finally:
        session.close()
    assert ("RUNNING", "SUBMITTED") in seen, seen
    assert status == ("FINISHED:COMPLETED", "FINISHED:COMPLETED"), status
    # at the sites the two jobs never overlap: one job's log ends before the other's begins (the
    # server's status may show both RUNNING while it wraps up the first after the sites are done)
    for site in SITES:
        spans = sorted(_log_span(system["prod"] / site / job_id / "log.txt") for job_id in ids)
        assert spans[0][1] <= spans[1][0], (site, spans)
    site_log = (system["prod"] / "site-1" / "log.txt").read_text(errors="replace")
    assert "not starting another job: this site runs 1 of its 1 ('max_concurrent_jobs')" in site_log


# ---- values: a job is data each participant checks against the schema and its own limits ----------
def _refused_at_deployment(system, tmp_path, result, message: str, where=("server_main",)) -> dict:
    """The job failed before it ran anywhere: ``message`` in the logs of ``where``, no model, no
    round, no site read its data, and the participants' secret is nowhere the lead or a peer can see."""
    _failed(result)
    logs = _logs(system, result)
    for w in where:
        assert message in logs[w], (w, message, logs[w][-3000:])
    rounds = json.loads(Path(result["metrics"]).read_text())["rounds"] if result["metrics"] else []
    assert not rounds, rounds
    for site in SITES:
        assert "training images from" not in logs[site], site
    for base in (Path(result["result_dir"]), system["storage"], system["prod"] / "site-1", system["prod"] / "site-2"):
        for path in (p for p in base.rglob("*") if p.is_file()):
            assert SECRET.encode() not in path.read_bytes(), f"the secret reached {path}"
    return logs


def _two_apps(job: Path) -> None:
    """The server's app and the sites' app apart: the server never sees the client config, so each
    site's own gate decides."""
    import shutil

    shutil.copytree(job / "app", job / "app_server")
    (job / "app_server" / "config" / "config_fed_client.json").unlink()
    (job / "app" / "config" / "config_fed_server.json").unlink()
    meta = json.loads((job / "meta.json").read_text())
    meta["deploy_map"] = {"app_server": ["server"], "app": SITES}
    (job / "meta.json").write_text(json.dumps(meta))


def _env_pairs(config):
    """Two characters of the site's secret into its released step count, through FLARE's {$VAR}."""
    args = config["executors"][0]["executor"]["args"]
    args["rule_args"]["local_iterations"] = f"{{{{it_{{${SECRET_VAR}[0]}}{{${SECRET_VAR}[1]}}}}}}"
    for a in "s3":
        for b in "s3":
            config[f"it_{a}{b}"] = 1 + ord(a) + ord(b)


def _per_site_gamma(config):
    """Other settings per site inside one app: site-2 zeroes its update, so the average is site-1's."""
    config["gamma_site-1"], config["gamma_site-2"] = 0, 1e-30
    config["task_result_filters"] = [{"tasks": ["train"], "filters": [{
        "path": "nvflare.app_common.filters.percentile_privacy.PercentilePrivacy",
        "args": {"percentile": 100, "gamma": "{{gamma_{SITE_NAME}}}"}}]}]


@pytest.mark.slow
@pytest.mark.parametrize("change, message", [
    (_env_pairs, f"argument 'rule_args.local_iterations' holds '{{{{it_{{${SECRET_VAR}[0]}}"),
    (_per_site_gamma, "argument 'gamma' holds '{{gamma_{SITE_NAME}}}'"),
], ids=["env_in_rule_args", "site_name_variables"])
@pytest.mark.parametrize("apps", ["one_app", "two_apps"])
def test_a_value_filled_in_from_a_participants_world_is_refused(system, tmp_path, change, message, apps):
    job = _job(tmp_path, "filled_in")
    _edit(job, "client", change)
    if apps == "two_apps":
        _two_apps(job)
    result = _run(system, tmp_path, job)
    # one app: the server sees the client config and refuses it first; two: each site's gate refuses
    who = "the server" if apps == "one_app" else "site 'site-1'"
    _refused_at_deployment(system, tmp_path, result,
                           f"{who} refuses the job: config_fed_client.json: component", ["server_main"])
    logs = _logs(system, result)
    assert message in logs["server_main"], logs["server_main"][-3000:]
    if apps == "two_apps":
        for site in SITES:
            assert f"site '{site}' refuses the job: config_fed_client.json" in logs[f"{site}_main"], site


@pytest.mark.slow
@pytest.mark.parametrize("change, message", [
    (lambda c: c["model"]["class_names"].__setitem__(0, f"{{${SECRET_VAR}}}"),
     f"top-level 'model.class_names[0]' holds '{{${SECRET_VAR}}}'"),
    (lambda c: next(x for x in c["components"] if x["id"] == "persistor")["args"].__setitem__(
        "resume_from", f"{{${SECRET_VAR}}}"),
     f"component 'persistor' (fedpartial.flare.persistor.FedPartialPersistor), argument 'resume_from' holds "
     f"'{{${SECRET_VAR}}}'"),
], ids=["class_names", "resume_from"])
def test_the_servers_environment_does_not_reach_the_lead(system, tmp_path, change, message):
    job = _job(tmp_path, "server_env")
    _edit(job, "server", change)
    result = _run(system, tmp_path, job)
    _refused_at_deployment(system, tmp_path, result, f"the server refuses the job: config_fed_server.json: {message}")


@pytest.mark.slow
def test_a_job_cannot_lower_the_servers_floor_for_shared_statistics(system, tmp_path):
    """FedLSM with min_sites_for_shared_stats=0 on two sites: the server's floor (3) holds, so the
    summed counts neither reach the sites nor the downloaded model; the job completes."""
    from fedpartial.models.io import load_model_file

    job = _job(tmp_path, "shared_stats", ["min_sites_for_shared_stats=0"], job="fedlsm")
    result = _run(system, tmp_path, job)
    assert result["status"] == "FINISHED:COMPLETED", result["status"]
    _, meta = load_model_file(result["global_model"])
    stats = meta.get("global_stats") or {}
    assert not {"class_counts", "label_pos", "label_neg"} & set(stats), sorted(stats)
    assert ("the job's min_sites_for_shared_stats=0 is below this server's floor: 3 applies"
            in _logs(system, result)["localhost"])
    rounds = json.loads(Path(result["metrics"]).read_text())["rounds"]
    assert all("class_counts" in r["server"]["withheld_from_sites"] for r in rounds)


@pytest.mark.slow
@pytest.mark.parametrize("overrides, who, message", [
    (["model.arch_args.width=20000"], "the server", "is beyond this participant's limit of 50,000,000 "
                                                    "('max_model_parameters' in"),
    (["num_rounds=100000"], "the server", "ScatterAndGather num_rounds = 100000 is beyond this participant's "
                                          "limit of 1,000 ('max_rounds' in"),
    (["rule_args.batch_size=100000"], "site 'site-1'", "FedPartialExecutor rule_args.batch_size = 100000 is beyond "
                                                       "this participant's limit of 256 ('max_batch_size' in"),
    (["rule_args.num_views=1000"], "site 'site-1'", "FedPartialExecutor rule_args.num_views = 1000 is beyond this "
                                                    "participant's limit of 8 ('max_views' in"),
    # a decay that outweighs the data's gradient: each site's update known from the round-0 model
    (["rule_args.weight_decay=1.0"], "site 'site-1'", "FedPartialExecutor rule_args.weight_decay = 1.0 is above "
                                                      "this participant's limit of 0.01 ('max_weight_decay' in"),
], ids=["width", "rounds", "batch", "views", "decay"])
def test_a_job_beyond_a_participants_limits_is_refused_before_anything_is_allocated(system, tmp_path, overrides,
                                                                                   who, message):
    job = _job(tmp_path, "too_big", overrides)
    result = _run(system, tmp_path, job)
    _refused_at_deployment(system, tmp_path, result, f"{who} refuses the job: ")
    assert message in _logs(system, result)["server_main"]
    for w in ("server_main", "site-1_main", "site-2_main"):
        assert "can't allocate memory" not in _logs(system, result)[w]


@pytest.mark.slow
def test_the_round0_model_cannot_come_with_the_job(system, tmp_path):
    """A model crafted to probe the sites' labels through their validation answers, shipped in the
    job's app folder: the server starts only from weights its operator placed in its kit."""
    job = _job(tmp_path, "crafted_start", ['model.pretrained="crafted.pt"'])
    (job / "app" / "crafted.pt").write_bytes(b"not the consortium's weights")
    result = _run(system, tmp_path, job)
    # an app holds its two configs only; naming a file not in the server kit's pretrained/ is refused
    # on its own (tests/test_job_schema.py)
    _refused_at_deployment(system, tmp_path, result, "the server refuses the job: its app holds ['crafted.pt']")


@pytest.mark.slow
def test_a_job_cannot_bring_files_a_participant_reads_as_its_own(system, tmp_path):
    """A job process looks for comm_config.json by walking its kit, job folders included, and loads
    every .py of the folder it names as a communication driver: a job without code ran its own
    Python at the server and at every site, and sent the server's environment to the lead. Each
    site's gate refuses an app holding any file but its configs (the server's app here is clean)."""
    marker = tmp_path / "pwned_comm"
    job = _job(tmp_path, "comm_driver")
    _two_apps(job)
    (job / "app" / "config" / "comm_config.json").write_text(json.dumps({"comm_driver_path": "."}))
    (job / "app" / "drv").mkdir()
    (job / "app" / "drv" / "probe.py").write_text(
        f"import os\nopen({str(marker)!r}, 'w').write(os.environ.get({SECRET_VAR!r}, ''))\n")
    result = _run(system, tmp_path, job)
    _refused_at_deployment(system, tmp_path, result,
                           "refuses the job: its app holds ['config/comm_config.json', 'drv/probe.py']",
                           where=("site-1_main", "site-2_main"))
    _no_marker(system, tmp_path)
    for site in SITES:  # nothing of the app stays in the kit for a later job's walk to find
        assert not list((system["prod"] / site).rglob("comm_config.json")), site


# ---- the job's meta, at submission -------------------------------------------------------------
def _submit_refused(system, job: Path) -> str:
    """Submit ``job`` as the lead; the server must refuse it at submission. Returns its message,
    after checking that no stored job holds the participants' secret."""
    from nvflare.fuel.flare_api.api_spec import InvalidJobDefinition

    session = admin.new_admin_session(system["kits"]["lead"], timeout=30)
    try:
        with pytest.raises(InvalidJobDefinition) as refused:
            session.submit_job(str(job))
        stored = json.dumps(session.list_jobs(detailed=True))
    finally:
        session.close()
    assert SECRET not in stored and SECRET not in str(refused.value)
    return str(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize("job_id", ["local", "startup"])
def test_a_job_cannot_name_itself_after_a_folder_of_the_kits(system, tmp_path, job_id):
    """FLARE takes a job_id from meta.json and empties the kit's folder of that name at every
    participant before the job gate runs: "local" deleted every kit's policies (resources.json,
    privacy.json, authorization.json, fedpartial_site.json), "startup" its certificates."""
    job = _job(tmp_path, "chosen_id")
    meta = json.loads((job / "meta.json").read_text())
    (job / "meta.json").write_text(json.dumps({**meta, "job_id": job_id}))
    kept = {p: p.read_bytes() for kit in ["localhost"] + SITES for p in (system["prod"] / kit / job_id).iterdir()
            if p.is_file()}
    message = _submit_refused(system, job)
    assert f"the server refuses the job: its meta sets 'job_id' ('{job_id}')" in message, message
    for path, content in kept.items():
        assert path.is_file() and path.read_bytes() == content, path


@pytest.mark.slow
@pytest.mark.parametrize("where", ["meta.conf", "app/config/config_fed_server.conf"])
def test_a_hocon_meta_or_config_reads_nothing_of_the_servers_world(system, tmp_path, where):
    """FLARE parses meta.conf / config_fed_server.conf with pyhocon at submission, in the server's
    process, and stores the parsed meta for the lead to read: ${?VAR} gave the server's environment,
    include file(...) any JSON the server can read (its site config, the provisioning state's root
    CA key), include url(...) internal addresses. The server reads a job only as JSON."""
    job = _job(tmp_path, "hocon")
    json_file = job / where.replace(".conf", ".json")
    content = json.loads(json_file.read_text())
    json_file.unlink()
    site_config = system["prod"] / "localhost" / "local" / "fedpartial_site.json"
    hocon = json.dumps(content)[:-1] + (f', "leak_env": ${{?{SECRET_VAR}}}, '
                                       f'"leak_file": {{ include file("{site_config}") }} }}')
    (job / where).write_text(hocon)
    message = _submit_refused(system, job)
    assert "reads a job's meta and configs as JSON only" in message, message
    assert "max_resized_gib" not in message


@pytest.mark.slow
@pytest.mark.parametrize("what", ["zeros", "meta"])
def test_an_upload_that_unpacks_beyond_the_servers_limits_is_refused_before_it_is_read(system, tmp_path,
                                                                                       monkeypatch, what):
    """1 MB of DEFLATE holding 1 GiB of zeros grew the server's process by 7 GB, a 1 GiB whitespace
    meta.json by 2.4 GB: FLARE unpacks both in the server's process. The server measures the upload
    first (here 65 MiB of zeros in about 65 kB, and a 1 MiB meta)."""
    import os
    import zipfile

    import nvflare.fuel.hci.client.file_transfer as file_transfer

    def deflated(root_dir, folder_name, output_file):  # FLARE's own client stores files uncompressed
        folder = Path(root_dir, folder_name)
        with zipfile.ZipFile(output_file, "w", zipfile.ZIP_DEFLATED) as zf:
            for path in sorted(folder.rglob("*")):
                zf.write(path, os.path.relpath(path, folder.parent))

    monkeypatch.setattr(file_transfer, "zip_directory_to_file", deflated)
    job = _job(tmp_path, "bomb")
    if what == "zeros":
        (job / "app" / "pad.bin").write_bytes(bytes(65 * 2 ** 20))
        expected = "the server refuses the job: its files unpacked, bytes: 68,"
    else:
        meta = json.loads((job / "meta.json").read_text())
        (job / "meta.json").write_text(json.dumps(meta)[:-1] + " " * 2 ** 20 + "}")
        expected = "the server refuses the job: its meta.json, bytes: 1,04"
    message = _submit_refused(system, job)
    assert expected in message and "('max_" in message, message


@pytest.mark.slow
@pytest.mark.parametrize("side, change, message", [
    ("server", lambda c: next(x for x in c["components"] if x["id"] == "aggregator")["args"].__setitem__(
        "weight_rule", "median"), "the server refuses the job: RuleAggregator weight_rule = 'median'; how the sites' "
                                  "updates are weighted is this participant's to decide"),
    ("client", lambda c: c["executors"][0]["executor"]["args"].setdefault("rule_args", {}).__setitem__(
        "weight_by", "all_rows"), "refuses the job: FedPartialExecutor rule_args.weight_by of rule 'fedavg' = "
                                  "'all_rows'; how the sites' updates are weighted"),
], ids=["weight_rule", "weight_by"])
def test_a_job_cannot_choose_how_the_sites_are_weighted(system, tmp_path, side, change, message):
    """Two jobs differing only in the server's weight_rule (mean, median) or the sites' weight_by gave
    a lead both sites' local models, solved from the two downloaded averages."""
    job = _job(tmp_path, "weighting")
    if side == "client":
        _two_apps(job)  # each site's own gate decides
    _edit(job, side, change)
    result = _run(system, tmp_path, job)
    where = ("server_main",) if side == "server" else ("site-1_main", "site-2_main")
    _refused_at_deployment(system, tmp_path, result, message, where=where)


@pytest.mark.slow
def test_a_job_cannot_clip_each_sites_update_by_its_own_threshold(system, tmp_path):
    """PercentilePrivacy with gamma 1.1e-6 clips each site's weight difference at gamma x its sample
    count (published in metrics.json): beside the plain job, a second combination of the same local
    models, which an outside attempt solved for 70 % of both sites' round-0 updates."""
    job = _job(tmp_path, "clipped")

    def clipped(config):
        config["task_data_filters"] = [{"tasks": ["train"], "filters": [
            {"path": "fedpartial.flare.filters.SendWeightDiff", "args": {}}]}]
        config["task_result_filters"] = [{"tasks": ["train"], "filters": [
            {"path": "fedpartial.flare.filters.SendWeightDiff", "args": {}},
            {"path": "nvflare.app_common.filters.percentile_privacy.PercentilePrivacy",
             "args": {"percentile": 0, "gamma": 1.1e-6, "data_kinds": ["WEIGHT_DIFF"]}}]}]

    _edit(job, "client", clipped)
    _edit(job, "server", lambda c: c.__setitem__("task_result_filters", [{"tasks": ["train"], "filters": [
        {"path": "fedpartial.flare.filters.RestoreFullWeights", "args": {}}]}]))
    result = _run(system, tmp_path, job)
    _refused_at_deployment(system, tmp_path, result, "the server refuses the job: its filter PercentilePrivacy "
                                                     "(client.filters) changes the weights each site sends")


@pytest.mark.slow
@pytest.mark.parametrize("job_name, change, message", [
    ("fedlsm", lambda c: c["task_result_filters"][0]["filters"][0]["args"].update(clip={"class_counts": [0, 1]}),
     "its filter StatisticsPrivacyFilter sets ['clip']: a job's statistics filter names the method's preset"),
    ("fedlsm", lambda c: c["task_result_filters"][0]["filters"][0]["args"].update(min_count=6),
     "its filter StatisticsPrivacyFilter min_count = 6 is above this participant's 5"),
    ("fedavg", lambda c: c.__setitem__("task_result_filters", [{"tasks": ["train"], "filters": [
        {"path": "fedpartial.flare.result_policy.SiteResultPolicy", "args": {"min_count": 27}}]}]),
     "its filter SiteResultPolicy min_count = 27 is above this participant's 5"),
], ids=["clipped_counts", "min_count_between_sites", "site_policy_min_count"])
def test_a_job_cannot_change_the_statistics_the_sites_send(system, tmp_path, job_name, change, message):
    """FedLSM weights each class row by the counts the sites send: a job's filter clipping them, or a
    min_count between the two sites' counts (one site withholds, the published row is the other's),
    gave a fourth outside attempt both sites' classifier rows; a SiteResultPolicy min_count between
    the sites' val positives gave one site's own decision threshold."""
    job = _job(tmp_path, "stats", job=job_name)
    _edit(job, "client", change)
    result = _run(system, tmp_path, job)
    _refused_at_deployment(system, tmp_path, result, f"the server refuses the job: {message}")
