"""What a job may name at a site, without a running system: rules by registered name only, data by
the site's own dataset names, writes inside the job's run folder (fedpartial.flare.site_config).

The executor is set up by hand as FLARE would (an engine whose workspace is a folder of tmp_path);
a kit with ``local/fedpartial_site.json`` is a provisioned site, one without is a development site.
"""
import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from nvflare.apis.fl_context import FLContext

from fedpartial.algorithms import registry
from fedpartial.flare import executors
from fedpartial.flare.common import runtime_identity
from fedpartial.flare.executors import FedPartialExecutor
from fedpartial.flare.site_config import confined, load_site_config
from test_privacy import write_sites

MODEL = {"arch": "small_cnn", "arch_args": {"width": 8, "depth": 2}, "in_channels": 1,
         "class_names": [f"c{i}" for i in range(4)], "task": "single-label", "input_size": [16, 16]}
SITE = "site-1"


class SiteContext(FLContext):
    def get_identity_name(self, default=""):
        return SITE

    def get_job_id(self):
        return "job-1"


def _kit(tmp_path: Path, datasets=None) -> Path:
    """A site's workspace; with ``datasets`` (name -> folder) it is a provisioned kit."""
    kit = tmp_path / "kit"
    (kit / "local").mkdir(parents=True, exist_ok=True)
    if datasets is not None:
        (kit / "local" / "fedpartial_site.json").write_text(json.dumps({"format_version": 1, "datasets": datasets}))
    return kit


def _setup(kit: Path, monkeypatch, model=MODEL, **args):
    """Set the executor up in ``kit`` (``model``: the job's model block); returns (executor, the
    site files it read)."""
    read = []
    real = executors.load_site_dataset
    monkeypatch.setattr(executors, "load_site_dataset", lambda path, *a: read.append(path) or real(path, *a))
    fl_ctx = SiteContext()
    engine = mock.MagicMock()
    workspace = engine.get_workspace.return_value
    workspace.get_root_dir.return_value = str(kit)
    workspace.get_run_dir.return_value = str(kit / "job-1")
    fl_ctx.set_prop("__engine__", engine, private=True, sticky=False)
    ex = FedPartialExecutor(model=model, tensorboard=False, device="cpu", **args)
    ex._setup(fl_ctx)
    return ex, read


@pytest.fixture
def sites(tmp_path):
    """Two folders of site files: the one the site offers, and another study's it does not."""
    write_sites(tmp_path / "offered", "mismatch")
    write_sites(tmp_path / "other_study", "mismatch")
    return tmp_path / "offered", tmp_path / "other_study"


# ---- rules: a fixed table -------------------------------------------------------------------
@pytest.mark.parametrize("side", ["client", "server"])
@pytest.mark.parametrize("name", ["subprocess.run", "os.system", "fedpartial.flare.common.jsonable",
                                  "fedpartial.algorithms.fedlsm.FedLSMClient", "FedLSM", ""])
def test_a_rule_is_a_registered_name_never_an_import_path(side, name):
    with pytest.raises(ValueError) as err:
        registry.build_rule(side, name, {"args": ["sh", "-c", "id"]})
    assert f"the job's {side} 'rule' {name!r} is not a registered {side} rule" in str(err.value)
    assert "'fedia', 'fedirm', 'fedlsm', 'fedmlp'" in str(err.value)


def test_registered_names_give_each_methods_rules():
    from fedpartial.algorithms import fedavg, fedia, fedlsm, segmentation

    assert registry.rule_class("client", "fedlsm") is fedlsm.FedLSMClient
    assert registry.rule_class("server", "fedlsm") is fedlsm.AWPAServer
    assert registry.rule_class("client", "fedavg_seg") is segmentation.SegmentationSupervisedClient
    assert registry.rule_class("server", "fedavg_seg") is fedavg.FedAvgServer
    assert registry.rule_class("client", "fedia") is fedia.FedIAClient
    for side, table in (("client", registry.CLIENT_RULES), ("server", registry.SERVER_RULES)):
        assert sorted(table) == ["fedavg", "fedavg_seg", "fedia", "fedirm", "fedlsm", "fedmlp"]
        for name in table:  # every entry imports and is a class
            assert isinstance(registry.rule_class(side, name), type), (side, name)
    with pytest.raises(ValueError, match="bad rule_args for the client rule 'fedlsm'.*no_such_arg"):
        registry.build_rule("client", "fedlsm", {"no_such_arg": 1})


def test_the_shipped_jobs_name_registered_rules():
    repo = Path(__file__).resolve().parents[1]
    named = 0
    for config in repo.glob("jobs/*/app/config/config_fed_*.json"):
        side = "client" if config.name.endswith("client.json") else "server"
        text = json.loads(config.read_text())
        comps = [e["executor"] for e in text.get("executors", [])] + text.get("components", [])
        for comp in comps:
            if "rule" in comp.get("args", {}):
                registry.rule_path(side, comp["args"]["rule"])
                named += 1
    assert named >= 10


def test_a_provisioned_site_draws_its_training_seed_afresh_for_each_job(tmp_path, sites, monkeypatch):
    """A development site trains from the job's seed (a seeded run repeats); a provisioned one
    from a fresh draw per job, so two jobs never repeat its training and their difference is no
    single step of it."""
    offered, _ = sites
    dev, _ = _setup(_kit(tmp_path / "dev"), monkeypatch, data_root=str(offered), seed=7)
    assert dev.rule.ctx.seed == 7
    kit = _kit(tmp_path, {"study_a": str(offered)})
    seeds = {_setup(kit, monkeypatch, dataset="study_a", runtime_version=runtime_identity(), seed=7)[0].rule.ctx.seed
             for _ in range(3)}
    assert len(seeds) == 3 and 7 not in seeds


# ---- data: the site's own dataset names ---------------------------------------------------
def test_a_provisioned_site_reads_the_dataset_it_offers(tmp_path, sites, monkeypatch):
    offered, _ = sites
    kit = _kit(tmp_path, {"study_a": str(offered)})
    ex, read = _setup(kit, monkeypatch, dataset="study_a", runtime_version=runtime_identity())
    assert read == [str(offered / f"{SITE}.npz")]
    assert len(ex.data.splits["train"]) > 0


@pytest.mark.parametrize("args, words", [
    ({"dataset": "study_a", "data_root": "OTHER"}, "it sets 'data_root'"),
    ({"data_root": "OTHER"}, "it sets 'data_root'"),
    ({}, "it names no 'dataset'"),
    ({"dataset": "study_b"}, "'dataset' 'study_b' is not offered here"),
])
def test_a_provisioned_site_refuses_a_path_or_an_unknown_dataset(tmp_path, sites, monkeypatch, args, words):
    offered, other = sites
    kit = _kit(tmp_path, {"study_a": str(offered), "study_c": str(offered)})
    args = {k: str(other) if v == "OTHER" else v for k, v in args.items()}
    with pytest.raises(ValueError) as err:
        _setup(kit, monkeypatch, runtime_version=runtime_identity(), **args)
    message = str(err.value)
    assert message.startswith(f"site '{SITE}' refuses the job: ") and words in message, message
    if "reference" not in words:
        assert f"offers the datasets: study_a, study_c ({kit / 'local' / 'fedpartial_site.json'})" in message


def test_a_provisioned_site_reads_nothing_before_it_refuses(tmp_path, sites, monkeypatch):
    offered, other = sites
    kit = _kit(tmp_path, {"study_a": str(offered)})
    for args in ({"data_root": str(other)}, {"dataset": "study_a", "reference_file": "reference/{site}.npz"},
                 {"dataset": "study_a", "data_file": "../other_study/{site}.npz"}, {"dataset": "study_a"}):
        read = []
        monkeypatch.setattr(executors, "load_site_dataset", lambda path, *a: read.append(path))
        ex = FedPartialExecutor(model=MODEL, tensorboard=False, device="cpu",
                                runtime_version=runtime_identity() if len(args) > 1 else "", **args)
        fl_ctx = SiteContext()
        engine = mock.MagicMock()
        engine.get_workspace.return_value.get_root_dir.return_value = str(kit)
        engine.get_workspace.return_value.get_run_dir.return_value = str(kit / "job-1")
        fl_ctx.set_prop("__engine__", engine, private=True, sticky=False)
        with pytest.raises(ValueError, match="refuses the job"):
            ex._setup(fl_ctx)
        assert read == [], args
        assert not (kit / "fedpartial_state").exists()


def test_a_provisioned_site_refuses_a_job_naming_no_runtime(tmp_path, sites, monkeypatch):
    offered, _ = sites
    kit = _kit(tmp_path, {"study_a": str(offered)})
    with pytest.raises(ValueError, match=r"site 'site-1' refuses the job: it names no 'runtime_version'"):
        _setup(kit, monkeypatch, dataset="study_a")
    bare = runtime_identity().split("+")[0]
    with pytest.raises(ValueError, match=f"needs fedpartial runtime {bare} but site 'site-1' has"):
        _setup(kit, monkeypatch, dataset="study_a", runtime_version=bare)


def test_a_development_site_reads_the_jobs_data_root_and_says_so(tmp_path, sites, monkeypatch):
    offered, _ = sites
    kit = _kit(tmp_path)  # no fedpartial_site.json: simulator / POC
    warnings = []
    monkeypatch.setattr(FedPartialExecutor, "log_warning", lambda self, ctx, msg, *a, **k: warnings.append(msg))
    ex, read = _setup(kit, monkeypatch, data_root=str(offered))
    assert read == [str(offered / f"{SITE}.npz")]
    assert any("development site, reading the job's data_root" in w for w in warnings), warnings


# ---- writes: inside the job's run folder ----------------------------------------------------
@pytest.mark.parametrize("state_dir", ["/tmp/elsewhere", "../../local", "state/../../..", "~/x"])
def test_a_state_dir_outside_the_run_folder_is_refused_and_nothing_is_written(tmp_path, sites, monkeypatch,
                                                                               state_dir):
    offered, _ = sites
    kit = _kit(tmp_path, {"study_a": str(offered)})
    with pytest.raises(ValueError) as err:
        _setup(kit, monkeypatch, dataset="study_a", runtime_version=runtime_identity(), state_dir=state_dir)
    assert f"its 'state_dir' ({state_dir!r}) must be a path relative to {kit / 'job-1'}, without '..'" in str(err.value)
    assert sorted(p.name for p in kit.iterdir()) == ["local"]


def test_a_relative_state_dir_lands_in_the_run_folder(tmp_path, sites, monkeypatch):
    offered, _ = sites
    kit = _kit(tmp_path, {"study_a": str(offered)})
    _setup(kit, monkeypatch, dataset="study_a", runtime_version=runtime_identity(), state_dir="my_state")
    assert (kit / "job-1" / "my_state" / SITE).is_dir()


def test_confined_paths():
    assert confined("/run", "a/b", "state_dir", "x") == "/run/a/b"
    assert confined("/run", "a/./b/", "state_dir", "x") == "/run/a/b"
    for bad in ("/etc", "..", "a/../../b", "a\\..\\b", "~root"):
        with pytest.raises(ValueError, match="state_dir"):
            confined("/run", bad, "state_dir", "x")


def test_site_config_errors_name_the_file_and_key(tmp_path):
    kit = _kit(tmp_path)
    config = kit / "local" / "fedpartial_site.json"
    assert load_site_config(str(kit)) is None
    config.write_text("{not json")
    with pytest.raises(ValueError, match=f"'{config}' cannot be read"):
        load_site_config(str(kit))
    config.write_text(json.dumps({"format_version": 1, "datasets": {"a": 3}}))
    with pytest.raises(ValueError, match="'datasets' must map names to folders"):
        load_site_config(str(kit))
    config.write_text(json.dumps({"format_version": 2}))
    with pytest.raises(ValueError, match="format_version must be 1"):
        load_site_config(str(kit))
    config.write_text(json.dumps({"format_version": 1, "datasets": {"a": "data/a", "b": "/abs/b"}}))
    assert load_site_config(str(kit))["datasets"] == {"a": str(kit / "data" / "a"), "b": "/abs/b"}


# ---- what else a provisioned site refuses ---------------------------------------------------------
def test_a_provisioned_site_reads_only_its_own_site_file(tmp_path, sites, monkeypatch):
    """A reference copy inside the offered folder (``split`` writes ``reference/`` there) is refused
    by name and, renamed to the site's own file name, by content."""
    from fedpartial.data import sitefile

    offered, _ = sites
    kit = _kit(tmp_path, {"study_a": str(offered)})
    identity = runtime_identity()
    for data_file in ("reference/{site}_full.npz", "{site}_full.npz", "{site:>99}.npz", "{site}.npz/.."):
        with pytest.raises(ValueError, match=f"its 'data_file' \\({data_file!r}\\) is not one of"):
            _setup(kit, monkeypatch, dataset="study_a", runtime_version=identity, data_file=data_file)
    copy = tmp_path / "copied"
    copy.mkdir()
    data = sitefile.load_site_file(str(offered / f"{SITE}.npz"), expected_site=SITE)
    data.info["reference"] = True  # what split writes into reference/<site>_full.npz
    sitefile.write_site_file(str(copy / f"{SITE}.npz"), data)
    kit = _kit(tmp_path / "k2", {"study_a": str(copy)})
    with pytest.raises(ValueError, match="is a complete-label reference copy"):
        _setup(kit, monkeypatch, dataset="study_a", runtime_version=identity)


def test_a_provisioned_site_caps_the_input_size(tmp_path, sites, monkeypatch):
    offered, _ = sites
    kit = _kit(tmp_path, {"study_a": str(offered)})
    big = dict(MODEL, input_size=[4096, 4096])
    with pytest.raises(ValueError, match=r"model.input_size \[4096, 4096\] is beyond this site's limit of 1024"):
        _setup(kit, monkeypatch, model=big, dataset="study_a", runtime_version=runtime_identity())


def test_a_provisioned_site_keeps_the_resize_cache_in_its_workspace(tmp_path, sites, monkeypatch):
    from fedpartial.data import sitefile

    offered, _ = sites
    folder = tmp_path / "large"
    folder.mkdir()
    data = sitefile.load_site_file(str(offered / f"{SITE}.npz"), expected_site=SITE)
    sitefile.write_site_file(str(folder / SITE), data, layout="folder")
    kit = _kit(tmp_path, {"big": str(folder)})
    model = dict(MODEL, input_size=[12, 12])  # the files hold 16 x 16: a resized copy is made
    ex, _ = _setup(kit, monkeypatch, model=model, dataset="big", runtime_version=runtime_identity())
    assert ex.data.splits["train"].images.shape[1:3] == (12, 12)
    cache = kit / "fedpartial_cache" / "big" / SITE
    assert list(cache.glob("train_images_12x12.npy"))
    assert not (folder / SITE / "cache").exists()  # nothing written into the offered data folder
    # a job at another size replaces the copy rather than adding one (an outside attempt's disk
    # growth: a copy of the folder per input size, job after job)
    kept = np.load(cache / "train_images_12x12.npy", mmap_mode="r")  # a job still reading it
    ex, _ = _setup(kit, monkeypatch, model=dict(MODEL, input_size=[8, 8]), dataset="big",
                   runtime_version=runtime_identity())
    assert sorted(p.name for p in cache.iterdir() if "12x12" in p.name) == []
    assert {p.name for p in cache.iterdir()} >= {"train_images_8x8.npy", "train_images_8x8.json"}
    assert kept.shape[1:3] == (12, 12) and float(np.asarray(kept).mean()) >= 0  # its map still reads
