"""Provisioning a FLARE project for fedpartial: one-machine ``project.yml`` files, ``nvflare
provision``, the environment and storage of the startup kits, the installed-runtime wheel and the
Docker variant of a project.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

# Admin users of the one-machine projects; roles decide rights (authorization.json.default):
# project_admin = everything; lead = submit / manage own jobs, byoc; org_admin = manage own org's
# sites, may not submit jobs and has no byoc right.
DEFAULT_ADMINS = (("admin@hospital-a.org", "hospital_a", "project_admin"),
                  ("lead@hospital-a.org", "hospital_a", "lead"),
                  ("orgadmin@hospital-b.org", "hospital_b", "org_admin"))
SITE_POLICY_BUILDER = "fedpartial_tools.provision_builders.SitePolicyBuilder"
# the folder holding fedpartial_tools: on PYTHONPATH for `nvflare provision` (it imports the builder)
TOOLS_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Root CA validity of the projects provisioned here (as provisioning/project*.yml); FLARE's default is 360
# days, which also caps every participant's certificate, so renewing a site's kit could not go past it.
ROOT_VALID_DAYS = 3650


def nvflare_cmd() -> List[str]:
    """``nvflare`` of the running interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "nvflare.cli"]


def free_port() -> int:
    """A TCP port nobody listens on right now (for parallel one-machine systems)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def site_list(num_sites: int) -> List[str]:
    if num_sites < 1:
        raise ValueError(f"number of sites must be >= 1, got {num_sites}")
    return [f"site-{i}" for i in range(1, num_sites + 1)]


def localhost_project(name: str, port: int, sites: Sequence[str], server_name: str = "localhost",
                      admins: Sequence[Sequence[str]] = DEFAULT_ADMINS, site_org: str = "hospital",
                      site_policy: Optional[dict] = None, root_valid_days: int = ROOT_VALID_DAYS) -> dict:
    """A one-machine project (same layout as ``provisioning/project_localhost.yml``).

    Args:
        name: project name (also the CN of the root CA).
        port: the server's single port (FL + admin traffic).
        sites: client names, e.g. ``["site-1", "site-2"]``; site i gets org ``{site_org}_{letter}``.
        server_name: ``localhost`` for provisioned kits (clients connect to this name). POC
            projects use ``server`` with ``default_host: localhost``.
        admins: ``(email, org, role)`` triples.
        site_org: prefix of the sites' organisation names.
        site_policy: args of :class:`fedpartial_tools.provision_builders.SitePolicyBuilder` (e.g.
            ``{"allow_byoc": False}``: installed runtime, no code with jobs); ``None`` = FLARE's default
            policy (byoc jobs allowed, as in POC).
        root_valid_days: validity of the root CA (only when first created; participants' certificates
            are valid 360 days, never beyond the root CA).
    """
    server = {"name": server_name, "type": "server", "org": "hospital_a", "fed_learn_port": int(port)}
    if server_name != "localhost":
        server["default_host"] = "localhost"
    participants = [server]
    for i, site in enumerate(sites):
        participants.append({"name": site, "type": "client", "org": f"{site_org}_{chr(ord('a') + i % 26)}"})
    for email, org, role in admins:
        participants.append({"name": email, "type": "admin", "org": org, "role": role})
    builders = [
        {"path": "nvflare.lighter.impl.workspace.WorkspaceBuilder", "args": {"template_file": ["master_template.yml"]}},
        {"path": "nvflare.lighter.impl.static_file.StaticFileBuilder", "args": {"config_folder": "config"}},
        {"path": "nvflare.lighter.impl.cert.CertBuilder", "args": {"root_valid_days": int(root_valid_days)}},
        {"path": "nvflare.lighter.impl.signature.SignatureBuilder"},
    ]
    if site_policy is not None:
        builders.insert(2, {"path": SITE_POLICY_BUILDER, "args": dict(site_policy)})
    return {
        "api_version": 3,
        "name": name,
        "description": "fedpartial one-machine project",
        "participants": participants,
        "builders": builders,
    }


def write_project(path: str, project: dict) -> str:
    """Write a project dict as YAML (``nvflare`` depends on PyYAML)."""
    import yaml

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(project, f, sort_keys=False)
    return path


def kit_env(state_dir: str, base: Optional[dict] = None) -> Dict[str, str]:
    """Environment for nvflare commands and kits: HOME and TMPDIR inside ``state_dir`` (nvflare keeps
    ``~/.nvflare/config.conf``, torch its caches there) and this interpreter's folder first on PATH
    (``sub_start.sh`` runs ``python3`` from PATH)."""
    env = dict(os.environ if base is None else base)
    home, tmp = os.path.join(state_dir, "home"), os.path.join(state_dir, "tmp")
    os.makedirs(home, exist_ok=True)
    os.makedirs(tmp, exist_ok=True)
    env.update(HOME=home, TMPDIR=tmp, PYTHONUNBUFFERED="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("NVFLARE_STARTUP_KIT_DIR", None)
    return env


def provision(project_file: str, workspace: str, env: Optional[dict] = None, timeout: float = 120) -> str:
    """``nvflare provision -p project_file -w workspace``; returns the new ``prod_NN`` folder.

    Re-running it on the same workspace keeps ``<workspace>/<project>/state/cert.json`` (root CA and
    key), so kits of a later run (e.g. a site added) trust and are trusted by the earlier ones.
    """
    cmd = nvflare_cmd() + ["provision", "-p", os.path.abspath(project_file), "-w", os.path.abspath(workspace),
                           "--force"]
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TOOLS_ROOT, env.get("PYTHONPATH", "")) if p)
    # from the project file's folder, as provisioning/provision.sh: relative paths in it are read from there
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                         cwd=os.path.dirname(os.path.abspath(project_file)))
    if res.returncode != 0:
        raise RuntimeError(f"'{' '.join(cmd)}' failed (exit {res.returncode}):\n{res.stdout}\n{res.stderr}")
    import yaml

    name = yaml.safe_load(open(project_file))["name"]
    return latest_prod_dir(workspace, name)


def latest_prod_dir(workspace: str, project_name: str) -> str:
    prods = sorted(glob.glob(os.path.join(workspace, project_name, "prod_*")))
    if not prods:
        raise FileNotFoundError(f"no {workspace}/{project_name}/prod_* folder: provisioning produced no kits")
    return prods[-1]


def keep_server_storage_in(server_kit: str, root: str) -> str:
    """Point the server's job store and snapshot store (default ``/tmp/nvflare/...``) into ``root``:
    writes ``local/resources.json`` from ``local/resources.json.default``. Returns the file written."""
    local = os.path.join(server_kit, "local")
    src = os.path.join(local, "resources.json")
    if not os.path.isfile(src):
        src += ".default"
    text = open(src).read().replace("/tmp/nvflare", os.path.abspath(root))
    out = os.path.join(local, "resources.json")
    with open(out, "w") as f:
        f.write(text)
    return out


RUNTIME_DIST = "fedpartial_runtime"


def build_runtime(out_dir: str, timeout: float = 300) -> str:
    """Build the runtime wheel: the package ``fedpartial`` alone (what sites and the server execute;
    not ``fedpartial_tools``, not the ``python -m fedpartial`` shim), version ``fedpartial.__version__``,
    the runtime dependencies of ``pyproject.toml``. Returns the wheel's path.

    Uses ``pip wheel --no-build-isolation`` with this interpreter's setuptools (no download).

    Args:
        out_dir: folder for the wheel (created).
        timeout: seconds for the build.
    """
    import tempfile

    import fedpartial
    from fedpartial_tools.jobtools import NOT_SHIPPED

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(repo, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    version = fedpartial.__version__
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as stage:
        shutil.copytree(os.path.dirname(os.path.abspath(fedpartial.__file__)), os.path.join(stage, "fedpartial"),
                        ignore=shutil.ignore_patterns(*NOT_SHIPPED))
        deps = ", ".join(json.dumps(d) for d in project.get("dependencies", []))
        with open(os.path.join(stage, "pyproject.toml"), "w") as f:
            f.write(f"""[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{RUNTIME_DIST}"
version = "{version}"
description = "fedpartial runtime (executors, aggregators, persistor, methods) for FLARE sites and server"
requires-python = {json.dumps(project.get("requires-python", ">=3.10"))}
dependencies = [{deps}]

[tool.setuptools.packages.find]
include = ["fedpartial", "fedpartial.*"]
""")
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
               "-w", os.path.abspath(out_dir), stage]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=stage)
        if res.returncode != 0:
            raise RuntimeError(f"building the runtime wheel failed (exit {res.returncode}):\n{res.stdout}\n{res.stderr}")
    wheel = os.path.join(os.path.abspath(out_dir), f"{RUNTIME_DIST}-{version}-py3-none-any.whl")
    if not os.path.isfile(wheel):
        raise RuntimeError(f"pip wheel succeeded but wrote no '{wheel}'; found {os.listdir(out_dir)}")
    return wheel


DOCKER_BUILDER = "nvflare.lighter.impl.docker.DockerBuilder"
STATIC_FILE_BUILDER = "nvflare.lighter.impl.static_file.StaticFileBuilder"


def docker_project(project: dict, image: str, requirements_file: str = "", project_dir: str = "") -> dict:
    """``project`` (a project.yml dict) with NVFlare's container outputs switched on for ``image``
    (built by ``docker/build.sh``):

    * ``StaticFileBuilder`` ``docker_image``: every server / site / admin kit gets
      ``startup/docker.sh`` (``docker run`` of the image with the kit mounted at /workspace,
      a site's data at /data read-only);
    * ``DockerBuilder`` with ``base_image`` = ``image``: ``prod_NN/compose.yaml`` (one service per
      server and site, each kit mounted as a volume), ``prod_NN/.env`` and
      ``prod_NN/nvflare_compose/Dockerfile`` (``FROM image``).

    Args:
        project: the project dict (not changed).
        image: the fedpartial image, e.g. ``fedpartial:0.1.0``.
        requirements_file: extra packages for ``nvflare_compose/`` ("" = none: the image has the stack).
        project_dir: the folder of the project file, against which its relative ``privacy_file`` is
            made absolute (the derived file may be written elsewhere); "" = leave paths as they are.
    """
    import copy

    out = copy.deepcopy(project)
    builders = out.get("builders") or []
    for b in builders:
        privacy = (b.get("args") or {}).get("privacy_file") if b.get("path") == SITE_POLICY_BUILDER else None
        if privacy and project_dir and not os.path.isabs(privacy):
            b["args"]["privacy_file"] = os.path.abspath(os.path.join(project_dir, privacy))
    static = [b for b in builders if b.get("path") == STATIC_FILE_BUILDER]
    if not static:
        raise ValueError(f"project '{out.get('name')}' has no {STATIC_FILE_BUILDER} among its builders")
    static[0].setdefault("args", {})["docker_image"] = image
    builders[:] = [b for b in builders if b.get("path") != DOCKER_BUILDER]
    builders.insert(builders.index(static[0]) + 1,
                    {"path": DOCKER_BUILDER, "args": {"base_image": image, "requirements_file": requirements_file}})
    return out
