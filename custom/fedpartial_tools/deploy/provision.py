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

from fedpartial.site.kit import keep_server_storage_in  # noqa: F401  (the site command's; tests use it here)

# Admin users of the one-machine projects; roles decide rights (authorization.json.default):
# project_admin = everything; lead = submit / manage own jobs, byoc; org_admin = manage own org's
# sites, may not submit jobs and has no byoc right.
DEFAULT_ADMINS = (("admin@hospital-a.org", "hospital_a", "project_admin"),
                  ("lead@hospital-a.org", "hospital_a", "lead"),
                  ("orgadmin@hospital-b.org", "hospital_b", "org_admin"))
SITE_POLICY_BUILDER = "fedpartial_tools.deploy.builders.SitePolicyBuilder"  # the builder project.yml names
# the folder holding fedpartial_tools: on PYTHONPATH for `nvflare provision` (it imports the builder)
TOOLS_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
        site_policy: args of :class:`fedpartial_tools.deploy.builders.SitePolicyBuilder` (e.g.
            ``{"allow_byoc": False}``: installed runtime, no code with jobs; its defaults: the runtime's
            exact class allow-list, no log streaming, shell commands for the site's own org only);
            ``None`` = FLARE's default policy (byoc jobs allowed, as in POC).
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




RUNTIME_DIST = "fedpartial_runtime"
REPO_ROOT = os.path.dirname(TOOLS_ROOT)
#: the hashed lock of every package a site or the server installs before the runtime wheel
SITE_LOCK = "requirements-site.lock"
#: the same for sites with an NVIDIA GPU (PyPI's CUDA build of torch and its nvidia-* packages)
SITE_LOCK_CUDA = "requirements-site-cuda.lock"
#: the hashed lock of the model user's venv (the tools wheel: import, evaluate, predict, export, MONAI's runner)
TOOLS_LOCK = "requirements-tools.lock"
#: pyproject.toml's extra holding what the tools wheel needs beside the runtime's dependencies
TOOLS_EXTRA = "use"
# wheel timestamps (zip entries): fixed, so the same source builds the same wheel, byte for byte
WHEEL_EPOCH = "315532800"  # 1980-01-01, the earliest date a zip entry holds


def sha256_file(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_runtime(out_dir: str, timeout: float = 300, lock_file: Optional[str] = None) -> str:
    """Build the runtime wheel: the package ``fedpartial`` alone (what sites and the server execute;
    not ``fedpartial_tools``, not the ``python -m fedpartial`` shim), version ``fedpartial.__version__``,
    the runtime dependencies of ``pyproject.toml``. Returns the wheel's path.

    Beside the wheel: ``requirements-site.lock`` (every dependency pinned with its sha256, see
    :func:`lock_site_requirements`) and ``<wheel>.sha256``, the sha256 of the wheel and of the lock in
    ``sha256sum`` format. A site checks and installs them with::

        sha256sum -c fedpartial_runtime-<version>-py3-none-any.whl.sha256
        pip install --require-hashes -r requirements-site.lock
        pip install --no-deps fedpartial_runtime-<version>-py3-none-any.whl

    The ``.sha256`` proves the files are the reviewed ones only when its hashes reach the sites by
    another path than the files (e.g. the consortium's review record). The same source builds the
    same wheel (fixed zip timestamps), so a reviewer can rebuild it and compare.

    Uses ``pip wheel --no-build-isolation`` with this interpreter's setuptools (no download).

    Args:
        out_dir: folder for the wheel (created).
        timeout: seconds for the build.
        lock_file: the lock copied beside the wheel (default: the repository's ``requirements-site.lock``).
    """
    import tempfile

    import fedpartial
    from fedpartial_tools.jobs.packaging import NOT_SHIPPED

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    repo = REPO_ROOT
    lock_file = os.path.abspath(lock_file or os.path.join(repo, SITE_LOCK))
    check_site_lock(lock_file)  # before building: a wheel without its lock is not shipped
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

[project.scripts]
fedpartial-site = "fedpartial.site.command:main"

[tool.setuptools.packages.find]
include = ["fedpartial", "fedpartial.*"]
""")
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
               "-w", os.path.abspath(out_dir), stage]
        env = dict(os.environ, SOURCE_DATE_EPOCH=WHEEL_EPOCH)
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=stage, env=env)
        if res.returncode != 0:
            raise RuntimeError(f"building the runtime wheel failed (exit {res.returncode}):\n{res.stdout}\n{res.stderr}")
    wheel = os.path.join(os.path.abspath(out_dir), f"{RUNTIME_DIST}-{version}-py3-none-any.whl")
    if not os.path.isfile(wheel):
        raise RuntimeError(f"pip wheel succeeded but wrote no '{wheel}'; found {os.listdir(out_dir)}")
    locks = [(lock_file, os.path.join(os.path.abspath(out_dir), SITE_LOCK))]
    cuda = os.path.join(os.path.dirname(lock_file), SITE_LOCK_CUDA)
    if os.path.isfile(cuda):
        check_site_lock(cuda)
        locks.append((cuda, os.path.join(os.path.abspath(out_dir), SITE_LOCK_CUDA)))
    for src, dest in locks:
        if os.path.abspath(dest) != os.path.abspath(src):
            shutil.copyfile(src, dest)
    with open(wheel + ".sha256", "w") as f:  # sha256sum's format: "<hex>  <name>", names relative to out_dir
        for path in [wheel] + [dest for _, dest in locks]:
            f.write(f"{sha256_file(path)}  {os.path.basename(path)}\n")
    return wheel


def verify_runtime(wheel: str) -> List[str]:
    """Check ``<wheel>.sha256`` (written by :func:`build_runtime`): every file it names, read from
    the wheel's folder, has that sha256, the wheel is among them, and a lock among them has a hash
    on every requirement. Returns the files checked; raises naming the first that fails.

    Args:
        wheel: the runtime wheel, e.g. ``dist/fedpartial_runtime-0.1.0-py3-none-any.whl``.
    """
    wheel = os.path.abspath(wheel)
    sums = wheel + ".sha256"
    if not os.path.isfile(wheel):
        raise FileNotFoundError(f"runtime wheel '{wheel}' does not exist")
    if not os.path.isfile(sums):
        raise FileNotFoundError(f"'{sums}' does not exist (build-runtime writes it beside the wheel)")
    folder, checked = os.path.dirname(wheel), []
    with open(sums) as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    for n, line in enumerate(lines, start=1):
        digest, sep, name = line.partition("  ")
        name = name.lstrip("*")
        if not sep or len(digest) != 64 or not name or os.path.basename(name) != name:
            raise ValueError(f"'{sums}' line {n}: expected '<sha256 hex>  <file name>', got {line!r}")
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"'{path}' (named in '{sums}' line {n}) does not exist")
        actual = sha256_file(path)
        if actual != digest.lower():
            raise ValueError(f"'{path}' has sha256 {actual}, but '{sums}' line {n} says {digest}: "
                             f"not the file that was built")
        if name in (SITE_LOCK, SITE_LOCK_CUDA, TOOLS_LOCK):
            check_site_lock(path)
        checked.append(path)
    if wheel not in checked:
        raise ValueError(f"'{sums}' has no line for '{os.path.basename(wheel)}'")
    return checked


def check_site_lock(path: str) -> List[str]:
    """The requirements of a hashed lock (``name==version``), after checking that each is pinned
    with ``==`` and has at least one ``--hash=sha256:``; raises naming the file and the first
    requirement that is not.

    Args:
        path: e.g. ``requirements-site.lock``.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"site lock '{path}' does not exist (python -m fedpartial_tools.deploy "
                                f"lock-site-requirements writes it)")
    text = open(path).read().replace("\\\n", " ")  # join continuation lines
    pins = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        spec, *options = line.split()
        hashes = [o for o in options if o.startswith("--hash=sha256:") and len(o) == len("--hash=sha256:") + 64]
        if "==" not in spec or not hashes or len(hashes) != len(options):
            raise ValueError(f"site lock '{path}': requirement {spec!r} must be pinned with == and carry "
                             f"only --hash=sha256:<64 hex> options, got {line!r}")
        pins.append(spec)
    if not pins:
        raise ValueError(f"site lock '{path}' holds no requirement")
    return pins


def _pinned_runtime_dependencies(pyproject: str, requirements: str, torch: str = "",
                                 extras: Sequence[str] = ()) -> List[str]:
    """pyproject.toml's runtime dependencies (and those of its optional ``extras``), each at its pin
    in ``requirements`` (``torch`` replaces the torch pin when given)."""
    import re

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    def key(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    deps = list(project.get("dependencies", []))
    for extra in extras:
        if extra not in project.get("optional-dependencies", {}):
            raise ValueError(f"'{pyproject}' has no optional-dependencies '{extra}'")
        deps += project["optional-dependencies"][extra]
    pins = {}
    for line in open(requirements):
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            pins[key(line.split("==", 1)[0].strip())] = line
    if torch:
        pins["torch"] = torch
    out = []
    for dep in deps:
        name = key(re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0])
        if name not in pins:
            raise ValueError(f"'{requirements}' pins no version of '{name}', a runtime dependency in '{pyproject}'")
        out.append(pins[name])
    return out


def site_lock_text(report: dict, direct: Sequence[str], source: str, tools: bool = False) -> str:
    """The text of ``requirements-site.lock`` from a ``pip install --dry-run --report`` report: one
    ``name==version`` with the sha256 of the file pip chose, per package, sorted by name.

    Args:
        report: the parsed report (format version 1).
        direct: the pinned requirements resolved (for the header).
        source: how the lock was made (for the header).
        tools: the header of the tools lock (the model user's venv) instead of the site lock's.
    """
    from urllib.parse import unquote

    env = report.get("environment") or {}
    rows, notes = [], []
    for item in report.get("install") or []:
        meta, info = item.get("metadata") or {}, item.get("download_info") or {}
        name, version = meta.get("name"), meta.get("version")
        url = info.get("url", "")
        archive = info.get("archive_info")
        if archive is None or not name or not version:
            raise ValueError(f"pip report: '{name or url}' is not an archive pip could hash ({url}); "
                             f"the lock needs released files, not folders or VCS checkouts")
        digest = (archive.get("hashes") or {}).get("sha256") or ""
        if not digest and str(archive.get("hash", "")).startswith("sha256="):
            digest = archive["hash"].split("=", 1)[1]
        if len(digest) != 64:
            raise ValueError(f"pip report: no sha256 for {name}=={version} ({url})")
        rows.append((name.lower(), f"{name}=={version} \\\n    --hash=sha256:{digest}\n"))
        if "+" in version:  # a local build (torch's +cpu): not on PyPI
            notes.append(f"#   {name}=={version}: {unquote(url.rsplit('/', 1)[-1])}, not on PyPI: give pip its "
                         f"folder (--find-links) or its index\n")
    if not rows:
        raise ValueError("pip report: nothing to install")
    python = f"{env.get('implementation_name', 'python')} {env.get('python_version', '?')}"
    platform = f"{env.get('sys_platform', '?')} {env.get('platform_machine', '?')}"
    if tools:
        head = (f"# {TOOLS_LOCK}: every package the model user's venv (python -m fedpartial import / evaluate /\n"
                "# predict / export, python -m monai.bundle run) installs before the two wheels, pinned with\n"
                "# the sha256 of its file:\n"
                f"#   pip install --require-hashes -r {TOOLS_LOCK}\n"
                "#   pip install --no-deps fedpartial_runtime-<version>-py3-none-any.whl "
                "fedpartial_tools-<version>-py3-none-any.whl\n"
                f"# Resolved by pip for {python} on {platform} from pyproject.toml's runtime dependencies and\n"
                f"# its '{TOOLS_EXTRA}' extra at requirements.txt's pins: {' '.join(direct)}\n"
                f"# Written by {source}; do not edit.\n")
    else:
        head = ("# requirements-site.lock: every package a fedpartial site or server installs before the runtime\n"
                "# wheel, pinned with the sha256 of its file:\n"
                "#   pip install --require-hashes -r requirements-site.lock\n"
                "#   pip install --no-deps fedpartial_runtime-<version>-py3-none-any.whl\n"
                f"# Resolved by pip for {python} on {platform} from pyproject.toml's runtime dependencies\n"
                f"# at requirements.txt's pins: {' '.join(direct)}\n"
                f"# Written by {source}; do not edit.\n")
    if notes:
        head += "# Local builds:\n" + "".join(notes)
    return head + "".join(text for _, text in sorted(rows))


def lock_site_requirements(out: Optional[str] = None, requirements: Optional[str] = None, torch: str = "",
                           pip_args: Sequence[str] = (), timeout: float = 600, tools: bool = False) -> str:
    """Write the hashed site lock (default ``<repo>/requirements-site.lock``): pyproject.toml's
    runtime dependencies (torch, nvflare, monai, numpy, scikit-learn, tensorboard) at their pins in
    ``requirements.txt``, and every package they need, each pinned with the sha256 of the file pip
    chose. Returns the lock's path.

    pip's own resolver decides (``pip install --dry-run --ignore-installed --report``, this
    interpreter's pip configuration: indexes, find-links, constraints): nothing is installed, and
    wheels are downloaded only where an index serves no metadata file. The lock holds this
    interpreter's and platform's files (named in its header); sites need the same Python minor
    version and platform, or a lock made on one like theirs.

    torch: requirements.txt pins ``torch==2.13.0``; on this machine pip resolves it to the CPU build
    ``torch==2.13.0+cpu`` from a local folder (``pip config list``: find-links), whose sha256 the
    lock carries. A site installs it with that folder (``--find-links``) or PyTorch's CPU index
    (``--extra-index-url https://download.pytorch.org/whl/cpu``, whose file must have the same sha256).
    The lock for CUDA sites, ``requirements-site-cuda.lock``, is PyPI's torch (the CUDA 13 build on
    Linux x86_64) with the nvidia-* packages it needs, resolved without this machine's local folder::

        env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null python -m fedpartial_tools.deploy \\
            lock-site-requirements --torch torch==2.13.0 --out requirements-site-cuda.lock

    (another CUDA build: its pin, e.g. ``torch==2.13.0+cu128``, and its index with
    ``--pip-arg=--extra-index-url=...``).

    Args:
        out: the lock to write.
        requirements: the pins (default ``<repo>/requirements.txt``).
        torch: a torch requirement replacing requirements.txt's (e.g. ``torch==2.13.0+cu128``).
        pip_args: further arguments of ``pip install`` (indexes, ``--python-version``, ...).
        timeout: seconds for pip.
        tools: the tools lock instead (default ``<repo>/requirements-tools.lock``): the runtime's
            dependencies plus pyproject.toml's ``use`` extra (DICOM, image and NIfTI readers, MONAI
            bundle runner), what the model user's venv installs before the runtime and tools wheels.
    """
    import tempfile

    name = TOOLS_LOCK if tools else SITE_LOCK
    out = os.path.abspath(out or os.path.join(REPO_ROOT, name))
    requirements = os.path.abspath(requirements or os.path.join(REPO_ROOT, "requirements.txt"))
    direct = _pinned_runtime_dependencies(os.path.join(REPO_ROOT, "pyproject.toml"), requirements, torch,
                                          extras=(TOOLS_EXTRA,) if tools else ())
    with tempfile.TemporaryDirectory() as tmp:
        wanted, report_file = os.path.join(tmp, "site.in"), os.path.join(tmp, "report.json")
        with open(wanted, "w") as f:
            f.write("\n".join(direct) + "\n")
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", report_file, "-r", wanted, *pip_args]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise RuntimeError(f"'{' '.join(cmd)}' failed (exit {res.returncode}):\n{res.stdout}\n{res.stderr}")
        with open(report_file) as f:
            report = json.load(f)
    command = "lock-site-requirements" + (" --tools" if tools else "")
    text = site_lock_text(report, direct, f"python -m fedpartial_tools.deploy {command}", tools=tools)
    text = text.replace(name, os.path.basename(out))  # the header names the file it is in
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        f.write(text)
    os.replace(out + ".tmp", out)
    check_site_lock(out)
    return out


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
