"""README "Your own data" runs as written: DICOM + CSV at three hospitals -> import -> FedMLP in POC
-> evaluation on the imported test folder."""
import os
import re
import subprocess
from pathlib import Path

import pytest

# POC and provisioned systems run one at a time, on one xdist worker (scripts/test.sh runs -n 2)
pytestmark = pytest.mark.xdist_group("deployment")
REPO = Path(__file__).resolve().parents[1]


def readme_block(name: str) -> str:
    """The bash code between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` of README.md."""
    text = (REPO / "README.md").read_text()
    found = re.search(rf"<!-- {name}:begin -->\s*```bash\n(.*?)```\s*<!-- {name}:end -->", text, re.S)
    assert found, f"README.md has no '{name}' block"
    return found.group(1)


@pytest.mark.slow
def test_readme_own_data_walkthrough_runs_as_written(tmp_path):
    from fedpartial.data.npz import load_npz
    from fedpartial.data.sitefile import load_site_file
    from fedpartial_tools.processes import live_workspace_processes

    own = tmp_path / "own"
    env = dict(os.environ, OWN=str(own), TMPDIR=str(tmp_path))
    script = "set -euo pipefail\n" + readme_block("own-data")
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
