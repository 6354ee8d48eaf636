"""What ships to a hospital (a job's ``app/custom``) is the runtime package only, it has no import
cycle and never reaches into the tooling, and a packaged job runs from it alone."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import import_cycles, package_modules

from fedpartial.data.npz import save_npz
from fedpartial_tools.data.partition import split_file
from fedpartial_tools.data.sites import dataset_overrides
from fedpartial_tools.data.synthetic import make_classification
from fedpartial_tools.jobs.packaging import package_job
from fedpartial_tools.run.simulator import simulate

REPO = Path(__file__).resolve().parents[1]
JOBS = sorted(p.name for p in (REPO / "jobs").iterdir() if (p / "meta.json").is_file())
# Modules of the tooling package and its subpackages: none may appear in a shipped tree.
TOOLING = {p.stem for p in (REPO / "custom" / "fedpartial_tools").rglob("*.py") if p.stem != "__init__"}

# Loaded by every Python process started with this folder on PYTHONPATH (the simulator's server
# and clients too): hides the checkout's custom/ folder and the editable install, so fedpartial
# can only come from a job's app/custom.
HIDE_CHECKOUT = f'''
import sys
_custom = {str(REPO / "custom")!r}
sys.path[:] = [p for p in sys.path if p.rstrip("/") != _custom]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
'''


def _runtime_only_env(tmp_path, extra_path=()):
    hook = tmp_path / "hide_checkout"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HIDE_CHECKOUT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(hook), *map(str, extra_path)])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _imports(path: Path):
    """Every module named by an import statement of ``path`` (also inside functions)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


@pytest.fixture(scope="module")
def packaged(tmp_path_factory):
    root = tmp_path_factory.mktemp("shipped")
    return {job: Path(package_job(str(REPO / "jobs" / job), str(root / job))) for job in JOBS}


def test_every_job_ships_the_runtime_package_and_no_tooling(packaged):
    for job, out in packaged.items():
        customs = sorted(out.glob("*/custom"))
        assert customs, f"{job}: no app/custom"
        for custom in customs:
            assert sorted(os.listdir(custom)) == ["fedpartial"], f"{job}: {os.listdir(custom)}"
            files = sorted(custom.rglob("*.py"))
            shipped = {f.stem for f in files}
            assert not shipped & TOOLING, f"{job} ships tooling modules {sorted(shipped & TOOLING)}"
            for f in files:
                bad = [m for m in _imports(f) if m.split(".")[0] == "fedpartial_tools"]
                assert not bad, f"{job}: {f.relative_to(custom)} imports {bad}"
    assert {"runner", "provision", "throughput", "privacy", "cli", "packaging", "simulator", "importer"} <= TOOLING


def test_the_runtime_package_has_no_import_cycle():
    module_of = package_modules(REPO / "custom" / "fedpartial")
    graph = {m: {i for i in _imports(f) if i in module_of and i != m} for m, f in module_of.items()}
    cycles = import_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _resolve(value, variables):
    if isinstance(value, str) and value.startswith("{") and value.endswith("}") and value[1:-1] in variables:
        return variables[value[1:-1]]
    if isinstance(value, dict):
        return {k: _resolve(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, variables) for v in value]
    return value


def test_every_component_a_job_names_builds_from_its_app_custom_alone(packaged, tmp_path):
    """In a Python that cannot see the checkout: import every shipped module, and build every
    fedpartial component each packaged job's configs name, with the configs' own arguments."""
    plan = []
    for job, out in packaged.items():
        for config in sorted(out.glob("*/config/config_fed_*.json")):
            cfg = json.loads(config.read_text())
            variables = {k: v for k, v in cfg.items() if not isinstance(v, list)}
            for comp in cfg.get("components", []) + [e["executor"] for e in cfg.get("executors", [])]:
                if comp["path"].startswith("fedpartial."):
                    plan.append([job, str(config.parent.parent / "custom"), comp["path"],
                                 _resolve(comp.get("args", {}), variables)])
    assert len({p[0] for p in plan}) == len(JOBS)
    script = '''
import importlib, json, pkgutil, sys
try:
    import fedpartial_tools
    sys.exit("the tooling package is importable: the checkout is not hidden")
except ImportError:
    pass
try:
    import fedpartial
    sys.exit(f"fedpartial importable without a job's app/custom: {fedpartial.__file__}")
except ImportError:
    pass
for job, custom, path, args in json.load(open(sys.argv[1])):
    sys.path.insert(0, custom)
    import fedpartial
    assert fedpartial.__file__.startswith(custom), (job, fedpartial.__file__)
    for info in pkgutil.walk_packages(fedpartial.__path__, "fedpartial."):
        importlib.import_module(info.name)
    module, name = path.rsplit(".", 1)
    getattr(importlib.import_module(module), name)(**args)
    for m in [m for m in sys.modules if m == "fedpartial" or m.startswith("fedpartial.")]:
        del sys.modules[m]
    sys.path.remove(custom)
print("built", len(json.load(open(sys.argv[1]))), "components")
'''
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "check.py").write_text(script)
    proc = subprocess.run([sys.executable, str(tmp_path / "check.py"), str(tmp_path / "plan.json")],
                          env=_runtime_only_env(tmp_path), cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"built {len(plan)} components" in proc.stdout


@pytest.mark.slow
def test_a_packaged_job_runs_in_the_simulator_from_its_app_custom_alone(tmp_path, monkeypatch):
    src = tmp_path / "src.npz"
    save_npz(make_classification("single-label", num_classes=3, n_train=90, n_val=30, n_test=30, seed=4), str(src))
    split_file(str(src), "label-set-mismatch", sites=2, seed=0, out=str(tmp_path / "sites"), classes_per_site=2)
    # every process the simulator starts inherits this PYTHONPATH: fedpartial only from app/custom
    monkeypatch.setenv("PYTHONPATH", _runtime_only_env(tmp_path)["PYTHONPATH"])
    summary = simulate(str(REPO / "jobs" / "fedlsm"), str(tmp_path / "sites"), str(tmp_path / "ws"),
                       ["num_rounds=2", "model.arch_args={\"width\": 8, \"depth\": 2}",
                        *dataset_overrides(str(tmp_path / "sites"))], timeout=300)
    assert summary["ok"], summary
    assert (tmp_path / "ws" / "global_model.pt").is_file()
