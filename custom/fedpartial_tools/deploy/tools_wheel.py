"""The tools wheel: the model user's commands (``python -m fedpartial import / evaluate / predict /
export`` and the ``fedpartial`` command) for a venv at a site or on a workstation, beside the runtime
wheel, with its own hashed lock (``requirements-tools.lock``, which adds the DICOM / image / NIfTI
readers and ``fire`` for ``python -m monai.bundle run`` to the site lock's packages).

It holds the modules those commands import and nothing else of the tooling (no job packaging,
simulator, provisioning or bench), plus ``fedpartial/__main__.py``: the runtime wheel leaves that
file out (it is no part of what a kit runs, and :func:`fedpartial.flare.common.runtime_identity` does
not hash it), so a venv holding both wheels runs ``python -m fedpartial`` and a kit's identity is the
same with or without the tools installed.
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import List, Optional, Set

from fedpartial_tools.deploy.provision import (REPO_ROOT, RUNTIME_DIST, TOOLS_EXTRA, TOOLS_LOCK, WHEEL_EPOCH,
                                               check_site_lock, sha256_file)

TOOLS_DIST = "fedpartial_tools"
#: the command line the wheel ships; every module it imports (at the top or inside functions) comes along
ENTRY = "fedpartial_tools.model_cli"
#: ``python -m fedpartial`` in a venv with the tools wheel (the checkout's own shim runs every user command)
MAIN_SHIM = '''"""``python -m fedpartial`` of the tools wheel: the model user's commands
(:mod:`fedpartial_tools.model_cli`)."""
from fedpartial_tools.model_cli import main

main()
'''


def _module_file(root: str, module: str) -> Optional[str]:
    path = os.path.join(root, *module.split("."))
    if os.path.isfile(os.path.join(path, "__init__.py")):
        return os.path.join(path, "__init__.py")
    return path + ".py" if os.path.isfile(path + ".py") else None


def shipped_modules(root: Optional[str] = None, entry: str = ENTRY) -> List[str]:
    """The ``fedpartial_tools`` modules the tools wheel holds: ``entry``, every tooling module it
    imports, transitively (imports inside functions too), and their packages' ``__init__``.

    Args:
        root: the folder holding ``fedpartial_tools`` (default: this checkout's ``custom``).
        entry: the command-line module.
    """
    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    seen: Set[str] = set()
    todo = [entry]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        path = _module_file(root, module)
        if path is None:
            raise FileNotFoundError(f"tools wheel: module '{module}' has no file under '{root}'")
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            todo += [n for n in names if n.split(".")[0] == "fedpartial_tools" and _module_file(root, n)]
    return sorted(seen)


def build_tools(out_dir: str, timeout: float = 300, lock_file: Optional[str] = None) -> str:
    """Build ``fedpartial_tools-<version>-py3-none-any.whl`` into ``out_dir``, with
    ``requirements-tools.lock`` and ``<wheel>.sha256`` (both files' sha256) beside it. Returns the
    wheel's path. Installed after the runtime wheel, from the lock::

        pip install --require-hashes -r requirements-tools.lock
        pip install --no-deps fedpartial_runtime-<version>-py3-none-any.whl fedpartial_tools-<version>-py3-none-any.whl

    The same source builds the same wheel (fixed zip timestamps); nothing is downloaded.

    Args:
        out_dir: folder for the wheel (created).
        timeout: seconds for the build.
        lock_file: the lock copied beside the wheel (default: the repository's ``requirements-tools.lock``).
    """
    import fedpartial

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    lock_file = os.path.abspath(lock_file or os.path.join(REPO_ROOT, TOOLS_LOCK))
    check_site_lock(lock_file)
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    version = fedpartial.__version__
    custom = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    modules = shipped_modules(custom)
    packages = [m for m in modules if _module_file(custom, m).endswith("__init__.py")]
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as stage:
        for module in modules:
            src = _module_file(custom, module)
            dest = os.path.join(stage, os.path.relpath(src, custom))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(src, dest)
        os.makedirs(os.path.join(stage, "fedpartial"))
        with open(os.path.join(stage, "fedpartial", "__main__.py"), "w") as f:
            f.write(MAIN_SHIM)
        deps = [f"{RUNTIME_DIST}=={version}"] + list(project.get("optional-dependencies", {}).get(TOOLS_EXTRA, []))
        with open(os.path.join(stage, "pyproject.toml"), "w") as f:
            f.write(f"""[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{TOOLS_DIST}"
version = "{version}"
description = "fedpartial's model user commands: import a site's images, evaluate, predict, export a result model"
requires-python = {json.dumps(project.get("requires-python", ">=3.10"))}
dependencies = [{", ".join(json.dumps(d) for d in deps)}]

[project.scripts]
fedpartial = "{ENTRY}:main"

[tool.setuptools]
packages = [{", ".join(json.dumps(p) for p in packages)}]
py-modules = ["fedpartial.__main__"]
""")
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
               "-w", os.path.abspath(out_dir), stage]
        env = dict(os.environ, SOURCE_DATE_EPOCH=WHEEL_EPOCH)
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=stage, env=env)
        if res.returncode != 0:
            raise RuntimeError(f"building the tools wheel failed (exit {res.returncode}):\n{res.stdout}\n{res.stderr}")
    wheel = os.path.join(os.path.abspath(out_dir), f"{TOOLS_DIST}-{version}-py3-none-any.whl")
    if not os.path.isfile(wheel):
        raise RuntimeError(f"pip wheel succeeded but wrote no '{wheel}'; found {os.listdir(out_dir)}")
    lock = os.path.join(os.path.abspath(out_dir), TOOLS_LOCK)
    if os.path.abspath(lock) != lock_file:
        shutil.copyfile(lock_file, lock)
    with open(wheel + ".sha256", "w") as f:  # sha256sum's format, names relative to out_dir
        for path in (wheel, lock):
            f.write(f"{sha256_file(path)}  {os.path.basename(path)}\n")
    return wheel
