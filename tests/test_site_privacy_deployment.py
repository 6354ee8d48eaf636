"""A provisioned one-machine system (mutual TLS) whose two sites carry provisioning/privacy.json as
``local/privacy.json``: the site, not the job, decides what leaves it.

* a FedLSM job with NO filters of its own (its task_result_filters removed), which asks for the sites'
  local models and streams every TensorBoard scalar: what the sites really sent (a MessageRecorder at
  the end of the job's chains, i.e. after the site's filters) has every class count below k = 5
  withheld, the server sent no summed counts back (2 sites < 3), no local model left a site, and only
  allow-listed scalar tags reached the server's TensorBoard folder;
* a job naming a scope no site defines is refused (FINISHED:FAILED_TO_RUN, each site saying why).

One system per module; the finalizer kills every process it started, even on failure.
"""
import json
from pathlib import Path

import numpy as np
import pytest

from fedpartial_tools.deploy import admin
from helpers import running_system

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.filterwarnings("ignore:ssl_context is deprecated:DeprecationWarning")]
SITES = ["site-1", "site-2"]
CLASSES = ["c0", "c1", "c2", "c3"]
# training images per class at each site; site-1 annotates c0, c1 and site-2 c2, c3 (label-set mismatch)
TRAIN = {"site-1": [13, 3, 8, 8], "site-2": [10, 10, 2, 10]}
ANNOTATED = {"site-1": [0, 1], "site-2": [2, 3]}
DATASET = "demo"  # what each site's kit offers (local/fedpartial_site.json)


def _write_sites(out: Path) -> None:
    from fedpartial.data import sitefile
    from fedpartial.data.types import SINGLE_LABEL, Dataset, Split

    rng = np.random.default_rng(0)

    def images_of(classes):
        labels = np.eye(len(CLASSES), dtype=np.float32)[classes]
        images = rng.normal(60, 20, size=(len(classes), 16, 16, 3))
        for c in range(len(CLASSES)):
            images[labels[:, c] > 0, 4 * c:4 * c + 4, 4 * c:4 * c + 4] += 150
        return np.clip(images, 0, 255).astype(np.uint8), labels

    for site in SITES:
        images, labels = images_of(np.repeat(np.arange(len(CLASSES)), TRAIN[site]))
        mask = np.zeros_like(labels, dtype=bool)
        mask[:, ANNOTATED[site]] = True
        # every class 5 times or more in val: its scores may leave the site
        val_images, val_labels = images_of(np.arange(6 * len(CLASSES)) % len(CLASSES))
        data = Dataset(SINGLE_LABEL, CLASSES, {"train": Split(images, labels * mask, mask),
                                               "val": Split(val_images, val_labels,
                                                            np.ones_like(val_labels, dtype=bool))},
                       source="synthetic", site=site, info={"scenario": "label-set-mismatch"})
        sitefile.write_site_file(str(out / f"{site}.npz"), data)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    root = tmp_path_factory.mktemp("site_privacy")
    data = root / "sites"
    data.mkdir()
    _write_sites(data)
    # the kits get provisioning/privacy.json from provisioning (SitePolicyBuilder), as project.yml's do;
    # byoc stays allowed: the test's jobs carry their code
    policy = {"allow_byoc": True, "privacy_file": str(REPO / "provisioning" / "privacy.json"),
              "datasets": {DATASET: str(data)}}
    with running_system(root, "privacy_test", SITES, policy) as system:
        for site in SITES:  # the site's own policy, read by FLARE when the kit starts and for every job
            assert (system["prod"] / site / "local" / "privacy.json").read_bytes() == \
                (REPO / "provisioning" / "privacy.json").read_bytes()
        yield system


def _job(tmp_path, overrides=(), name="fedlsm"):
    from fedpartial_tools.jobs.packaging import package_job

    base = ["num_rounds=2", "server.min_clients=2", f"model.class_names={json.dumps(CLASSES)}",
            "model.input_size=[16,16]", "model.in_channels=3", "model.arch_args.width=8", "rule_args.batch_size=16",
            "device=cpu"]
    return Path(package_job(str(REPO / "jobs" / "fedlsm"), str(tmp_path / name), base + list(overrides),
                            dataset=DATASET))


def _tags(event_dir: Path) -> set:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(event_dir))
    acc.Reload()
    return set(acc.Tags()["scalars"])


@pytest.mark.slow
def test_the_site_policy_holds_for_a_job_asking_for_the_local_models(system, tmp_path):
    from fedpartial.flare.recorder import load_recorded
    from fedpartial.flare.common import GLOBAL_STATS, SITE_STATS

    # the job asks for the local models (cross-site evaluation of site models) ...
    job = _job(tmp_path, ["submit_model_task_name=submit_model"])
    client_file = job / "app" / "config" / "config_fed_client.json"
    client = json.loads(client_file.read_text())
    # ... with only the statistics filter a provisioned site requires of FedLSM (the method's preset),
    # and recorders, which run AFTER the site's scope filters and the job's
    record = tmp_path / "wire"
    recorder = {"path": "fedpartial.flare.recorder.MessageRecorder", "args": {"folder": str(record)}}
    statistics = next(f for chain in client["task_result_filters"] for f in chain["filters"]
                      if f["path"].endswith("StatisticsPrivacyFilter"))
    client["task_result_filters"] = [{"tasks": ["train", "submit_model", "validate"],
                                      "filters": [statistics, recorder]}]
    client["task_data_filters"] = [{"tasks": ["train"], "filters": [recorder]}]
    client_file.write_text(json.dumps(client))

    session = admin.new_admin_session(system["kits"]["lead"], timeout=30)
    try:
        result = admin.run_job(session, str(job), str(tmp_path / "download"), timeout=300, log=lambda m: None)
    finally:
        session.close()
    assert result["status"] == "FINISHED:COMPLETED", f"job ended {result['status']}"

    messages = load_recorded(str(record))
    sent = {}
    for m in messages:
        if m["task"] == "train" and m["direction"] == "out":
            sent.setdefault(m["site"], []).append(m["dxo"]["meta"][SITE_STATS])
    assert sorted(sent) == SITES and all(len(v) == 2 for v in sent.values())
    # annotated positives / negatives per class, worked out from TRAIN and ANNOTATED; a count < 5 is sent as 0:
    # site-1: pos [13, 3, 0, 0] -> [13, 0, 0, 0], neg [19, 29, 0, 0] (32 images); site-2: pos [0, 0, 2, 10] ->
    # [0, 0, 0, 10], neg [0, 0, 30, 22]
    expected = {"site-1": ([13, 0, 0, 0], [19, 29, 0, 0]), "site-2": ([0, 0, 0, 10], [0, 0, 30, 22])}
    for site, rounds in sent.items():
        for stats in rounds:
            assert stats["label_pos"].tolist() == expected[site][0], site
            assert stats["label_neg"].tolist() == expected[site][1], site
            counts = np.asarray(stats["class_counts"])
            assert np.all((counts == 0) | (counts >= 5)), (site, counts)
    # the server's reply of round 1: the pos_weight the sites train with, but no summed counts (2 sites < 3)
    received = [m["dxo"]["meta"].get(GLOBAL_STATS) or {} for m in messages
                if m["task"] == "train" and m["direction"] == "in" and m["round"] == 1]
    assert len(received) == 2
    for stats in received:
        assert "pos_weight" in stats and not {"class_counts", "label_pos", "label_neg"} & set(stats), sorted(stats)
    rounds = json.loads(Path(result["metrics"]).read_text())["rounds"]
    assert all(r["server"]["withheld_from_sites"] == ["class_counts", "label_pos", "label_neg"] for r in rounds)
    # local models: the job asked, the sites' policy said no
    submitted = [m for m in messages if m["task"] == "submit_model"]
    assert sorted(m["site"] for m in submitted) == SITES
    assert all(m["dxo"] is None for m in submitted)  # EMPTY_RESULT, no weights
    cross = json.loads(Path(result["cross_site_val"]).read_text())
    assert sorted(cross) == SITES
    for site, models in cross.items():  # every site scored the server's models, no site's local model
        assert "SRV_SRV_global_model" in models and all(name.startswith("SRV_") for name in models), models
    # analytics: only allow-listed scalar tags reached the server; the site kept all of them locally
    server_tb = {site: _tags(next(Path(result["result_dir"]).rglob(f"tb_events/{site}"))) for site in SITES}
    for site in SITES:
        local = _tags(system["prod"] / site / result["job_id"] / "tb" / site)
        assert {"train/num_pseudo_positive", "train/loss", "val/auc"} <= local
        assert {"train/loss", "val/auc"} <= server_tb[site]
        assert server_tb[site] <= set(json.loads((REPO / "provisioning" / "privacy.json").read_text())
                                      ["components"][0]["args"]["allowed_tags"]), server_tb[site]


@pytest.mark.slow
def test_a_job_naming_an_unknown_scope_is_refused(system, tmp_path):
    job = _job(tmp_path, name="scoped")
    meta_file = job / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["scope"] = "no_such_scope"
    meta_file.write_text(json.dumps(meta))
    session = admin.new_admin_session(system["kits"]["lead"], timeout=30)
    try:
        result = admin.run_job(session, str(job), str(tmp_path / "download"), timeout=120, log=lambda m: None)
    finally:
        session.close()
    assert result["status"] == "FINISHED:FAILED_TO_RUN", result["status"]
    logs = "".join(p.read_text(errors="replace") for p in system["prod"].glob("*/log.txt"))
    assert "privacy scope 'no_such_scope' is not allowed" in logs
