"""The tools wheel: the model user's commands (import, evaluate, predict, export) installable at a
site or a workstation without the checkout (docs/DEPLOYMENT.md "Which environment runs what").

Fast: the wheel holds exactly the modules those commands import (no job packaging, simulator,
provisioning or bench), ``fedpartial/__main__.py`` and the ``fedpartial`` command, and no runtime
file; its lock holds every package of the site lock at the same pin and hash, plus the readers and
``fire``. Slow: a fresh venv gets the tools lock (``pip install --require-hashes``) and both wheels
(``--no-deps``); with the checkout off the path, ``python -m fedpartial evaluate / predict / export``
and ``python -m monai.bundle run`` work there, and the runtime's identity is the checkout's (the
tools change nothing a kit runs).
"""
import csv
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fedpartial.flare.common import runtime_identity
from fedpartial_tools.deploy import provision
from fedpartial_tools.deploy.tools_wheel import build_tools, shipped_modules

from helpers import outer_pip_cache

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings(r"ignore:.*torch\.jit.*deprecated:DeprecationWarning")


def _lock(path: Path) -> dict:
    """``{name: (version, hashes)}`` of a hashed lock, parsed independently of the tooling."""
    out = {}
    for logical in path.read_text().replace("\\\n", " ").splitlines():
        if logical.strip() and not logical.lstrip().startswith("#"):
            spec, *options = logical.split()
            name, version = spec.split("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = (version, sorted(options))
    return out


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools_wheel")
    return {"runtime": Path(provision.build_runtime(str(root / "runtime"))),
            "tools": Path(build_tools(str(root / "tools"))), "root": root}


def test_the_tools_wheel_ships_the_model_users_commands_only(wheels):
    tools = wheels["tools"]
    names = sorted(zipfile.ZipFile(tools).namelist())
    modules = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in names
                     if n.startswith("fedpartial_tools/") and n.endswith(".py"))
    assert modules == shipped_modules()
    assert {"fedpartial_tools.model_cli", "fedpartial_tools.evaluate", "fedpartial_tools.model.predict",
            "fedpartial_tools.model.export", "fedpartial_tools.data.importer"} <= set(modules)
    for other in ("jobs", "run", "deploy", "bench", "cli", "data.partition", "data.synthetic"):
        assert not [m for m in modules if m.startswith(f"fedpartial_tools.{other}")], other
    # of the runtime package, only the command-line shim the runtime wheel leaves out (and does not hash)
    assert [n for n in names if n.startswith("fedpartial/")] == ["fedpartial/__main__.py"]
    info = zipfile.ZipFile(tools)
    dist_info = "fedpartial_tools-0.1.0.dist-info"
    assert "fedpartial = fedpartial_tools.model_cli:main" in info.read(f"{dist_info}/entry_points.txt").decode()
    assert "Requires-Dist: fedpartial_runtime==0.1.0" in info.read(f"{dist_info}/METADATA").decode()
    assert "fedpartial/__main__.py" not in zipfile.ZipFile(wheels["runtime"]).namelist()
    # checked like the runtime's: its .sha256 names the wheel and its lock; the same source, the same bytes
    assert provision.verify_runtime(str(tools)) == [str(tools), str(tools.parent / "requirements-tools.lock")]
    again = Path(build_tools(str(wheels["root"] / "again")))
    assert hashlib.sha256(again.read_bytes()).digest() == hashlib.sha256(tools.read_bytes()).digest()


def test_the_tools_lock_is_the_site_lock_plus_the_readers():
    site, tools = _lock(REPO / "requirements-site.lock"), _lock(REPO / "requirements-tools.lock")
    assert {n: tools[n] for n in site} == site  # same pins, same files: one venv may hold both
    assert {"pydicom", "pillow", "nibabel", "fire"} <= set(tools)
    assert not {"matplotlib", "pytest"} & set(tools)  # the checkout's plots and tests stay out
    assert len(provision.check_site_lock(str(REPO / "requirements-tools.lock"))) == len(tools)


def _model_and_data(root: Path):
    """A small multi-label model file, a test .npz and a folder of PNGs (made with the checkout)."""
    import torch
    from PIL import Image

    from fedpartial.data.npz import save_npz
    from fedpartial.models import build_model, save_model_file
    from fedpartial_tools.data.synthetic import make_classification

    data = make_classification(task="multi-label", num_classes=3, size=16, channels=1, seed=0)
    save_npz(data, str(root / "source.npz"))
    torch.manual_seed(0)
    model = build_model("small_cnn", 3, 1, width=4, depth=2).eval()
    save_model_file(str(root / "model.pt"), model, {"class_names": list(data.class_names), "task": "multi-label",
                                                      "input_size": [16, 16],
                                                      "normalisation": {"mean": 0.5, "std": 0.5}})
    (root / "png").mkdir()
    for i, image in enumerate(data.splits["test"].images[:5]):
        Image.fromarray(np.asarray(image).squeeze()).save(root / "png" / f"img{i}.png")
    return root / "model.pt", root / "source.npz", root / "png", str(data.class_names[0])


@pytest.mark.slow
def test_the_model_users_commands_run_from_the_installed_wheels(wheels, tmp_path):
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIP_NO_INPUT="1", PIP_CACHE_DIR=outer_pip_cache(), HOME=str(tmp_path), TMPDIR=str(tmp_path))
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    for cmd in ([py, "-m", "pip", "install", "-q", "--require-hashes", "-r",
                 str(wheels["tools"].parent / "requirements-tools.lock")],
                [py, "-m", "pip", "install", "-q", "--no-deps", str(wheels["runtime"]), str(wheels["tools"])]):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        assert res.returncode == 0, f"{' '.join(cmd)}:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    model, source, pngs, first = _model_and_data(tmp_path)

    def run(*args, exe=py):
        res = subprocess.run([exe, *map(str, args)], cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"{args} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        return res.stdout

    # the venv's own copies, not the checkout's
    where = json.loads(run("-c", "import json, fedpartial, fedpartial_tools, fedpartial.flare.common as c; print("
                                 "json.dumps([fedpartial.__file__, fedpartial_tools.__file__, c.runtime_identity()]))"))
    site_packages = str(next(venv.glob("lib/python3*/site-packages")))
    assert all(p.startswith(site_packages) for p in where[:2]), where
    assert where[2] == runtime_identity()  # the tools wheel's __main__.py changes no kit's identity
    evaluated = json.loads(run("-m", "fedpartial", "evaluate", "--model", model, "--data", source, "--compact"))
    assert evaluated["split"] == "test" and evaluated["n"] == 100 and 0 <= evaluated["auc"] <= 1
    run("-m", "fedpartial", "predict", "images", "--model", model, "--folder", pngs, "--out", work / "pred")
    rows = list(csv.DictReader(open(work / "pred" / "predictions.csv")))
    assert len(rows) == 5 and {f"prob_{first}", f"decision_{first}"} <= set(rows[0])
    assert "A class is reported present when its probability is at least" in (work / "pred" / "README.txt").read_text()
    run("export", "--model", model, "--format", "monai-bundle", "--out", work / "bundle",
        exe=str(venv / "bin" / "fedpartial"))
    run("-m", "monai.bundle", "run", "--config_file", work / "bundle" / "configs" / "inference.json",
        "--dataset_dir", pngs, "--output_dir", work / "bundle_out")
    bundled = list(csv.DictReader(open(work / "bundle_out" / "predictions.csv")))
    assert sorted(Path(r["file"]).name for r in bundled) == sorted(r["file"] for r in rows)
    for b in bundled:
        p = next(r for r in rows if r["file"] == Path(b["file"]).name)
        assert abs(float(b[f"prob_{first}"]) - float(p[f"prob_{first}"])) < 1e-4, (b, p)
    # only the model user's commands: the research ones need the checkout
    res = subprocess.run([py, "-m", "fedpartial", "simulate", "--help"], cwd=work, env=env, capture_output=True,
                         text=True)
    assert res.returncode == 2 and "invalid choice: 'simulate'" in res.stderr
