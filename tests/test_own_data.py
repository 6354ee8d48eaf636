"""docs/USAGE.md "Your own data" runs as written: DICOM + CSV at three hospitals -> import -> FedMLP in POC
-> evaluation on the imported test folder -> predict on the test DICOM folder -> export as a MONAI
bundle that MONAI's own runner runs on PNG copies of the test slices."""
import csv
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def usage_block(name: str) -> str:
    """The bash code between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` of docs/USAGE.md."""
    text = (REPO / "docs" / "USAGE.md").read_text()
    found = re.search(rf"<!-- {name}:begin -->\s*```bash\n(.*?)```\s*<!-- {name}:end -->", text, re.S)
    assert found, f"docs/USAGE.md has no '{name}' block"
    return found.group(1)


@pytest.mark.slow
def test_readme_own_data_walkthrough_runs_as_written(tmp_path):
    from fedpartial.data.npz import load_npz
    from fedpartial.data.sitefile import load_site_file
    from fedpartial_tools.deploy.processes import live_workspace_processes

    own = tmp_path / "own"
    env = dict(os.environ, OWN=str(own), TMPDIR=str(tmp_path))
    script = "set -euo pipefail\n" + usage_block("own-data")
    try:
        run = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    finally:
        subprocess.run(["bash", str(REPO / "poc" / "stop.sh"), str(own / "poc")], cwd=REPO, env=env,
                       capture_output=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    # each hospital's summary says what it annotates; the rest is blank in its CSV
    for k in (1, 2, 3):
        site = load_site_file(str(own / "sites" / f"site-{k}.npz"), expected_site=f"site-{k}")
        annotated = site.splits["train"].label_mask.any(axis=0)
        assert annotated.sum() == 2, (k, annotated)
        assert "val" in site.splits and site.splits["train"].images.shape[1:] == site.splits["val"].images.shape[1:]
        assert f"site 'site-{k}': multi-label" in out
    test = load_npz(str(own / "test.npz"), require_train=False)
    assert list(test.splits) == ["test"] and test.splits["test"].label_mask.all()
    assert re.search(r"round 3/3: val auc", out), out[-2000:]
    assert "FINISHED:COMPLETED" in out
    model = own / "poc" / "results" / "fedmlp_ctich" / "latest" / "workspace" / "global_model.pt"
    assert model.is_file()
    assert not live_workspace_processes(str(own / "poc"))
    # the evaluation's table: the test file's n and a finite AUC of the downloaded model
    assert re.search(rf"^n\s+{len(test.splits['test'])}$", out, re.M)
    auc = float(re.search(r"^auc\s+(\d\.\d+)$", out, re.M).group(1))
    assert 0.0 <= auc <= 1.0
    # predict: one row per test slice, the patient from the DICOM header, per class probability and decision
    from fedpartial.models.io import load_model_file

    names = load_model_file(str(model))[1]["class_names"]
    with open(own / "predicted" / "predictions.csv", newline="") as f:
        predicted = list(csv.DictReader(f))
    assert len(predicted) == len(test.splits["test"])
    assert all(r["patient_id"].startswith("P") for r in predicted)
    assert set(predicted[0]) >= {f"prob_{n}" for n in names} | {f"decision_{n}" for n in names}
    assert "file,frame,patient_id,prob_" in out  # head -3 of the CSV
    # the bundle, run by MONAI on the PNG copies, gives the same probabilities and decisions
    with open(own / "bundle_out" / "predictions.csv", newline="") as f:
        bundled = {Path(r["file"]).stem: r for r in csv.DictReader(f)}
    assert len(bundled) == len(predicted)
    for row in predicted:
        other = bundled[Path(row["file"]).stem]
        for n in names:
            assert abs(float(other[f"prob_{n}"]) - float(row[f"prob_{n}"])) < 1e-5, (row["file"], n)
            assert int(float(other[f"decision_{n}"])) == int(row[f"decision_{n}"]), (row["file"], n)
