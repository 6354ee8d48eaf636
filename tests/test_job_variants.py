"""Job folders derived from another (custom/fedpartial_tools/job_variants.json) never drift from
their base + settings: an edit to a base reaches its variants, or this test fails."""
import json
import shutil

from fedpartial_tools import jobspec


def test_derived_job_folders_equal_their_base_plus_settings():
    assert jobspec.drift() == []
    spec = jobspec.load_spec()
    assert {"fedavg_full", "fedavg_partial_loss", "fedmlp_ctich", "fedia_covid"} <= set(spec)
    for name, entry in spec.items():  # a derived folder is a plain job folder users can submit
        meta = json.load(open(f"{jobspec.JOBS_DIR}/{name}/meta.json"))
        assert meta["name"] == name and meta["description"] == entry["description"]


def _edit(path, change):
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config, indent=2))


def test_an_edit_to_a_base_or_a_variant_alone_is_reported(tmp_path):
    jobs = tmp_path / "jobs"
    shutil.copytree(jobspec.JOBS_DIR, jobs)
    # the base's learning rate changes, its variants are not regenerated
    _edit(jobs / "fedavg" / "app/config/config_fed_client.json",
          lambda c: c["executors"][0]["executor"]["args"]["rule_args"].update(lr=0.5))
    # a variant of a variant is edited by hand
    _edit(jobs / "fedavg_seg_full_covid" / "app/config/config_fed_server.json", lambda c: c.update(num_rounds=7))
    problems = jobspec.drift(str(jobs))
    named = sorted({p.split("/")[1] for p in problems})
    assert named == ["fedavg_full", "fedavg_partial_loss", "fedavg_seg_full_covid"], problems
    # regenerating from the description repairs every folder
    jobspec.write_all(str(jobs))
    assert jobspec.drift(str(jobs)) == []
    client = json.loads((jobs / "fedavg_full" / "app/config/config_fed_client.json").read_text())
    assert client["executors"][0]["executor"]["args"]["rule_args"] == {
        **client["executors"][0]["executor"]["args"]["rule_args"], "lr": 0.5, "loss_mode": "full"}
