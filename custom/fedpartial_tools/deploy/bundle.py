"""What each participant receives: one folder per server and site kit, with everything it installs
and its install commands (``python -m fedpartial_tools.deploy site-bundle``).

    OUT/<name>/kit/                                   the startup kit as provisioned
    OUT/<name>/fedpartial_runtime-<v>-py3-none-any.whl        the runtime (and the fedpartial-site command)
    OUT/<name>/fedpartial_runtime-<v>-py3-none-any.whl.sha256 sha256 of the wheel and both locks
    OUT/<name>/requirements-site.lock                 CPU sites: every package, pinned and hashed
    OUT/<name>/requirements-site-cuda.lock            GPU sites: the same with PyTorch's CUDA build
    OUT/<name>/fedpartial-<name>.service              systemd unit: the kit as an unprivileged user
    OUT/<name>/INSTALL.md                             the commands, with this participant's names
"""
from __future__ import annotations

import os
import shutil
from typing import List, Optional

from fedpartial_tools.deploy.provision import SITE_LOCK, SITE_LOCK_CUDA, build_runtime

#: where the install commands put things on the participant's machine (INSTALL.md says how to change them)
INSTALL_ROOT = "/opt/flare"
VENV = "/opt/fedpartial/venv"
SERVER_STORAGE = "/var/lib/fedpartial"
USER = "flare"


def _kits(prod_dir: str) -> List[tuple]:
    out = []
    for name in sorted(os.listdir(prod_dir)):
        startup = os.path.join(prod_dir, name, "startup")
        if os.path.isfile(os.path.join(startup, "fed_server.json")):
            out.append((name, "server"))
        elif os.path.isfile(os.path.join(startup, "fed_client.json")):
            out.append((name, "site"))
    return out


def install_text(name: str, kind: str, wheel: str, identity: str, install_root: str = INSTALL_ROOT,
                 venv: str = VENV, user: str = USER, storage: str = SERVER_STORAGE) -> str:
    """INSTALL.md of one participant: the exact commands, in order, with their expected output."""
    kit = f"{install_root}/{name}"
    server_storage = (f"\nsudo mkdir -p {storage} && sudo chown {user}: {storage} && sudo chmod 700 {storage}"
                      f"   # the server's job store" if kind == "server" else "")
    site_cmd = f"{venv}/bin/fedpartial-site"
    start = f"{site_cmd} start {kit}" + (f" --storage {storage}" if kind == "server" else "")
    data = "" if kind == "server" else f"""
## 4. Offer the site's data (sites only)
A job names a dataset, never a path. Make the site files (`python -m fedpartial import ...` on a
machine with the tooling, or files the consortium sends) readable by `{user}`, then:
```bash
sudo -u {user} {site_cmd} offer-dataset {kit} DATASET_NAME /data/fedpartial/DATASET_FOLDER
```
`DATASET_NAME` is the name the consortium's jobs give (`package-job --dataset DATASET_NAME`); the
folder holds `{name}.npz`. One name per federation or study; a job can read nothing else.
"""
    return f"""# Installing {name} ({kind}), fedpartial runtime {identity}

Run on the {kind}'s machine, in this folder, as an administrator. Linux x86_64 with CPython 3.11
(the locks are for it). Each step says what a healthy run prints.

## 1. Check what you received
```bash
sha256sum -c {os.path.basename(wheel)}.sha256
```
Expected: `... OK` for the wheel and both locks. Anything else: stop, and ask the consortium for the files again.

## 2. The user and the kit
```bash
sudo useradd --system --home-dir {install_root} --shell /usr/sbin/nologin {user}    # once per machine
sudo mkdir -p {install_root} && sudo cp -r kit {kit}
sudo chown -R {user}: {kit} && sudo chmod 700 {kit}{server_storage}
```
The kit holds this participant's private key (`startup/*.key`): only `{user}` may read it. The kit
never needs root.

## 3. The runtime, from the hashed lock
```bash
sudo python3.11 -m venv {venv}
# CPU machine: torch's CPU build is not on PyPI; give pip the folder holding the torch file the
# consortium sent (--find-links) or PyTorch's CPU index (--extra-index-url .../whl/cpu):
sudo {venv}/bin/pip install --require-hashes -r {SITE_LOCK} --find-links TORCH_FOLDER
# or a machine with an NVIDIA GPU (PyPI's CUDA build of torch):
#   sudo {venv}/bin/pip install --require-hashes -r {SITE_LOCK_CUDA}
sudo {venv}/bin/pip install --no-deps {os.path.basename(wheel)}
sudo -u {user} {venv}/bin/fedpartial-site status {kit}
```
pip refuses any file whose sha256 is not in the lock, and any package the lock does not name (a
torch file other than the one the lock was made from included: then ask the consortium for it).
`status` prints `runtime     {identity}`: the code every job of the consortium names.
{data}
## 5. Check, then run it as a service
```bash
sudo -u {user} {site_cmd} preflight {kit}                 # every line 'ok'; exit 1 names what failed
sudo cp fedpartial-{name}.service /etc/systemd/system/
sudo systemctl daemon-reload && sudo systemctl enable --now fedpartial-{name}
systemctl status fedpartial-{name}                         # active (running)
sudo -u {user} {site_cmd} status {kit}                    # running
```
The unit restarts the kit after a crash or a reboot. Without systemd: `sudo -u {user} {start}`
and `sudo -u {user} {site_cmd} stop {kit}`.

## 6. Daily and monthly
```bash
sudo -u {user} {site_cmd} cert-expiry {kit} --warn-days 30   # exit 1 under 30 days: ask for a renewed kit
sudo -u {user} {site_cmd} clean {kit} --older-than 30 --dry-run   # then without --dry-run
```
Logs: `{kit}/log.txt` and each job's `{kit}/<job_id>/log.txt`; they stay on this machine.
"""


def site_bundle(prod_dir: str, out_dir: str, wheel: Optional[str] = None, install_root: str = INSTALL_ROOT,
                venv: str = VENV, user: str = USER) -> List[dict]:
    """Write one bundle folder per server and site kit of ``prod_dir``.

    Args:
        prod_dir: a provisioned ``prod_NN`` folder.
        out_dir: where the bundles go (one folder per participant; replaced when present).
        wheel: a runtime wheel built before (its ``.sha256`` and locks beside it); default: build one.
        install_root: the folder the kits go to on the participants' machines.
        venv: the venv the runtime goes to there.
        user: the unprivileged OS user that runs the kit there.

    Returns:
        ``[{"name", "kind", "path", "files": {file: bytes}}]``.
    """
    from fedpartial.flare.common import runtime_identity
    from fedpartial.site.kit import systemd_unit

    kits = _kits(prod_dir)
    if not kits:
        raise FileNotFoundError(f"no server or site kit in '{prod_dir}' (a prod_NN folder of a provisioning)")
    os.makedirs(out_dir, exist_ok=True)
    wheel = os.path.abspath(wheel) if wheel else build_runtime(os.path.join(out_dir, "runtime"))
    runtime_files = [wheel, wheel + ".sha256"] + [os.path.join(os.path.dirname(wheel), n)
                                                 for n in (SITE_LOCK, SITE_LOCK_CUDA)]
    missing = [f for f in runtime_files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"runtime files missing beside the wheel: {missing} (build-runtime writes them)")
    identity = runtime_identity()
    out = []
    for name, kind in kits:
        dest = os.path.join(out_dir, name)
        if os.path.exists(dest):
            shutil.rmtree(dest)
        shutil.copytree(os.path.join(prod_dir, name), os.path.join(dest, "kit"), symlinks=True)
        for f in runtime_files:
            shutil.copyfile(f, os.path.join(dest, os.path.basename(f)))
        storage = SERVER_STORAGE if kind == "server" else None
        unit = systemd_unit(f"{install_root}/{name}", user=user, python=f"{venv}/bin/python", storage=storage)
        with open(os.path.join(dest, f"fedpartial-{name}.service"), "w") as f:
            f.write(unit)
        with open(os.path.join(dest, "INSTALL.md"), "w") as f:
            f.write(install_text(name, kind, wheel, identity, install_root, venv, user))
        files = {}
        for folder, _, names in os.walk(dest):
            for n in names:
                path = os.path.join(folder, n)
                files[os.path.relpath(path, dest)] = os.path.getsize(path)
        out.append({"name": name, "kind": kind, "path": dest, "files": files})
    return out
