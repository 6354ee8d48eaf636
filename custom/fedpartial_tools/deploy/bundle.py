"""What each participant receives: one folder per kit of a provisioning, with everything it installs
and its install commands (``python -m fedpartial_tools.deploy site-bundle``).

    OUT/<name>/kit/                                       the startup kit as provisioned
    OUT/<name>/fedpartial_runtime-<v>-py3-none-any.whl        the runtime (and the fedpartial-site command)
    OUT/<name>/fedpartial_runtime-<v>-py3-none-any.whl.sha256 sha256 of that wheel and both site locks
    OUT/<name>/requirements-site.lock                     CPU machines: every package, pinned and hashed
    OUT/<name>/requirements-site-cuda.lock                GPU machines: the same with PyPI's CUDA build of torch
    OUT/<name>/fedpartial_tools-<v>-py3-none-any.whl          sites, admins: the model user's commands
    OUT/<name>/fedpartial_tools-<v>-py3-none-any.whl.sha256   sha256 of the tools wheel and its lock
    OUT/<name>/requirements-tools.lock                    sites, admins: the tools venv's packages
    OUT/<name>/fedpartial-<name>.service                  server, sites: systemd unit, the kit confined
    OUT/<name>/INSTALL.md                                 the commands, with this participant's names

The server gets no tools (nobody uses a model there); admins (lead, project admin, org admin) get
no runtime venv of their own and no unit, only the tools venv, which also holds the ``nvflare`` CLI.
"""
from __future__ import annotations

import os
import shutil
from typing import Iterable, List, Optional

from fedpartial_tools.deploy.provision import SITE_LOCK, SITE_LOCK_CUDA, TOOLS_LOCK, build_runtime

#: where the install commands put things on the participant's machine (INSTALL.md says how to change them)
INSTALL_ROOT = "/opt/flare"
VENV = "/opt/fedpartial/venv"
TOOLS_VENV = "/opt/fedpartial/tools"
SERVER_STORAGE = "/var/lib/fedpartial"
USER = "flare"


def _kits(prod_dir: str) -> List[tuple]:
    out = []
    for name in sorted(os.listdir(prod_dir)):
        startup = os.path.join(prod_dir, name, "startup")
        for config, kind in (("fed_server.json", "server"), ("fed_client.json", "site"), ("fed_admin.json", "admin")):
            if os.path.isfile(os.path.join(startup, config)):
                out.append((name, kind))
                break
    return out


def _tools_install(venv: str, runtime: str, tools: str, sudo: str) -> str:
    return f"""```bash
{sudo}python3.11 -m venv {venv}
{sudo}{venv}/bin/pip install --require-hashes -r {TOOLS_LOCK} --find-links TORCH_FOLDER
{sudo}{venv}/bin/pip install --no-deps {runtime} {tools}
{venv}/bin/python -m fedpartial --help            # usage: python -m fedpartial [-h] {{import,evaluate,predict,export}}
```
The tools venv runs `python -m fedpartial import | evaluate | predict | export` (also as the command
`{venv}/bin/fedpartial`) and MONAI's bundle runner `python -m monai.bundle run` on an exported
model; no checkout is needed. Its lock holds every package of the site lock, at the same versions,
plus the DICOM / image / NIfTI readers and `fire` (MONAI's runner); it takes torch's CPU build,
enough to use a model (also on a GPU machine)."""


def _use_text(venv: str) -> str:
    py = f"{venv}/bin/python"
    return f"""```bash
{py} -m fedpartial evaluate --model RESULT/workspace/global_model.pt --data TEST.npz      # metrics table
{py} -m fedpartial predict dicom --model global_model.pt --folder DICOM_DIR --window brain --out PRED
head -3 PRED/predictions.csv                       # per image: each class's probability and decision
{py} -m fedpartial export --model global_model.pt --format monai-bundle --out BUNDLE
{py} -m monai.bundle run --config_file BUNDLE/configs/inference.json --dataset_dir PNG_DIR --output_dir OUT
```"""


def install_text(name: str, kind: str, wheel: str, identity: str, install_root: str = INSTALL_ROOT,
                 venv: str = VENV, user: str = USER, storage: str = SERVER_STORAGE, tools_wheel: str = "",
                 tools_venv: str = TOOLS_VENV, gpu: bool = False, memory_max: str = "80%", cpu_quota: str = "") -> str:
    """INSTALL.md of one participant: the exact commands, in order, with their expected output.

    Args:
        name: the participant (its kit's folder name).
        kind: ``server``, ``site`` or ``admin``.
        wheel: the runtime wheel (its file name is used).
        identity: the runtime's identity (version and hash), for what ``status`` prints.
        install_root, venv, user, storage: as :func:`site_bundle`.
        tools_wheel: the tools wheel (sites and admins).
        tools_venv: where a site installs the tools venv (an admin installs it in its home).
        gpu: a site with NVIDIA GPUs (the CUDA lock first; the unit keeps the devices visible).
        memory_max, cpu_quota: the unit's limits, as :func:`site_bundle` (for the text).
    """
    runtime, tools = os.path.basename(wheel), os.path.basename(tools_wheel)
    sums = f"{runtime}.sha256" + (f" {tools}.sha256" if tools_wheel else "")
    checked = "the runtime wheel, both site locks" + (", the tools wheel and its lock" if tools_wheel else "")
    head = f"""# Installing {name} ({kind}), fedpartial runtime {identity}

Linux x86_64 with CPython 3.11 (the locks are for it). Run in this folder; each step says what a
healthy run prints.

## 1. Check what you received
```bash
sha256sum -c {sums}
```
Expected: `... OK` for {checked}. Anything else: stop, and ask the consortium for the files again.
"""
    if kind == "admin":
        home_kit, home_venv = f"~/fedpartial/{name}", "~/fedpartial/tools"
        return head + f"""
## 2. The kit
```bash
mkdir -p ~/fedpartial && cp -r kit {home_kit} && chmod 700 {home_kit}
```
The kit holds this admin's private key (`startup/client.key`): keep it on this machine, readable by
you only. Its user name is `{name}` (the console `startup/fl_admin.sh` asks for it).

## 3. The tools venv (no root needed)
{_tools_install(home_venv, runtime, tools, "")}

## 4. Use it
```bash
{home_venv}/bin/nvflare system status --startup-kit {home_kit}     # Registered clients: N, Engine status
{home_venv}/bin/nvflare job submit -j JOB_FOLDER --startup-kit {home_kit}   # prints the job id
{home_venv}/bin/nvflare job wait JOB_ID --timeout 3600 --startup-kit {home_kit}
{home_venv}/bin/nvflare job download JOB_ID -o RESULTS --startup-kit {home_kit}
```
{_use_text(home_venv)}
Jobs are packaged from the consortium's checkout (`python -m fedpartial package-job ... --installed-runtime
--dataset NAME`, docs/DEPLOYMENT.md), or sent to you packaged; the tools venv runs what comes after.
"""
    kit = f"{install_root}/{name}"
    site_cmd = f"{venv}/bin/fedpartial-site"
    start = f"{site_cmd} start {kit}" + (f" --storage {storage}" if kind == "server" else "")
    server_storage = (f"\nsudo mkdir -p {storage} && sudo chown {user}: {storage} && sudo chmod 700 {storage}"
                      f"   # the server's job store" if kind == "server" else "")
    cpu = f"sudo {venv}/bin/pip install --require-hashes -r {SITE_LOCK} --find-links TORCH_FOLDER"
    cuda = f"sudo {venv}/bin/pip install --require-hashes -r {SITE_LOCK_CUDA}"
    lock = (f"# a machine with an NVIDIA GPU (PyPI's CUDA build of torch):\n{cuda}\n# (a CPU machine: {cpu})"
            if gpu else
            f"# CPU machine: torch's CPU build is not on PyPI; give pip the folder holding the torch file the\n"
            f"# consortium sent (--find-links) or PyTorch's CPU index (--extra-index-url .../whl/cpu):\n{cpu}\n"
            f"# or a machine with an NVIDIA GPU (PyPI's CUDA build of torch):\n#   {cuda}")
    limits = ", ".join([f"MemoryMax={memory_max}" if memory_max else "no memory limit",
                        f"CPUQuota={cpu_quota}" if cpu_quota else "no CPU limit"])
    home = ("" if kind == "server" else " Data folders under `/home` are not readable under `ProtectHome=yes`: "
            "keep them elsewhere (e.g. `/data`) or set `ProtectHome=read-only`.")
    text = head + f"""
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
{lock}
sudo {venv}/bin/pip install --no-deps {runtime}
sudo -u {user} {venv}/bin/fedpartial-site status {kit}
```
pip refuses any file whose sha256 is not in the lock, and any package the lock does not name (a
torch file other than the one the lock was made from included: then ask the consortium for it).
`status` prints `runtime     {identity}`: the code every job of the consortium names. This venv
runs the kit and `fedpartial-site` only.
"""
    n = 4
    if kind == "site":
        text += f"""
## 4. The tools venv: your data in, a result model used
A second venv, for whoever imports the site's data and uses the consortium's models (not the kit's
user; the kit's venv stays what the consortium reviewed):
{_tools_install(tools_venv, runtime, tools, "sudo ")}

## 5. Offer the site's data
A job names a dataset, never a path. Make the site file `{name}.npz` with the tools venv
(`{tools_venv}/bin/python -m fedpartial import dicom|images|nifti ... --site {name} --out
/data/fedpartial/DATASET_FOLDER/{name}.npz`, README "Your own data") or take the file the consortium
sends, make it readable by `{user}`, then:
```bash
sudo -u {user} {site_cmd} offer-dataset {kit} DATASET_NAME /data/fedpartial/DATASET_FOLDER
```
`DATASET_NAME` is the name the consortium's jobs give (`package-job --dataset DATASET_NAME`); the
folder holds `{name}.npz` (offer-dataset says so when it does not yet). One name per federation or
study; a job can read nothing else.
"""
        n = 6
    text += f"""
## {n}. Check, then run it as a service
```bash
sudo -u {user} {site_cmd} preflight {kit}                 # every line 'ok'; exit 1 names what failed
sudo cp fedpartial-{name}.service /etc/systemd/system/
sudo systemctl daemon-reload && sudo systemctl enable --now fedpartial-{name}
systemctl status fedpartial-{name}                         # active (running)
sudo -u {user} {site_cmd} status {kit}                    # running
```
`preflight` also connects to the server's port ({'this server: the port is free or the kit answers' if kind == 'server'
else 'start the server first'}). The unit restarts the kit after a crash or a reboot and confines it: it may write only
{kit}{' and ' + storage if kind == 'server' else ''} (temporary files go to {kit}/tmp), it sees
no home folder{'' if gpu else ', no device'}, and it has no capability;
`systemd-analyze security fedpartial-{name}` rates it. Its limits: {limits}; edit
`MemoryMax=` / `CPUQuota=` in the unit to change them.{home}
Without systemd: `sudo -u {user} {start}` and `sudo -u {user} {site_cmd} stop {kit}`.

## {n + 1}. Daily and monthly
```bash
sudo -u {user} {site_cmd} cert-expiry {kit} --warn-days 30   # exit 1 under 30 days: ask for a renewed kit
sudo -u {user} {site_cmd} clean {kit} --older-than 30 --dry-run   # then without --dry-run
```
Logs: `{kit}/log.txt` and each job's `{kit}/<job_id>/log.txt`; they stay on this machine.{'''
`status` and `clean` also cover the job store (`clean` removes finished jobs only).''' if kind == 'server' else ''}
"""
    if kind == "site":
        text += f"""
## {n + 2}. Use a result model
{_use_text(tools_venv)}
"""
    return text


def _names(value, kits: List[tuple]) -> set:
    names = {n for n, kind in kits if kind == "site"}
    if value in ("all", ["all"]):
        return names
    wanted = set(value or ())
    unknown = wanted - names
    if unknown:
        raise ValueError(f"--gpu names {sorted(unknown)}, not site kits of this provisioning ({sorted(names)})")
    return wanted


def site_bundle(prod_dir: str, out_dir: str, wheel: Optional[str] = None, install_root: str = INSTALL_ROOT,
                venv: str = VENV, user: str = USER, storage: str = SERVER_STORAGE, tools_wheel: Optional[str] = None,
                tools_venv: str = TOOLS_VENV, gpu: Iterable[str] = (), memory_max: str = "80%",
                cpu_quota: str = "") -> List[dict]:
    """Write one bundle folder per kit (server, sites, admins) of ``prod_dir``.

    Args:
        prod_dir: a provisioned ``prod_NN`` folder.
        out_dir: where the bundles go (one folder per participant; replaced when present).
        wheel: a runtime wheel built before (its ``.sha256`` and locks beside it); default: build one.
        install_root: the folder the kits go to on the participants' machines.
        venv: the venv the runtime goes to there.
        user: the unprivileged OS user that runs the kit there.
        storage: the server's job store there (its unit may write it; ``start --storage``).
        tools_wheel: a tools wheel built before (its ``.sha256`` and lock beside it); default: build one.
        tools_venv: the venv a site installs the tools in.
        gpu: site names whose machines train on NVIDIA GPUs (``"all"`` = every site): their units
            keep the devices visible and their INSTALL.md puts the CUDA lock first.
        memory_max: ``MemoryMax=`` of the units ("" = none).
        cpu_quota: ``CPUQuota=`` of the units ("" = none).

    Returns:
        ``[{"name", "kind", "path", "files": {file: bytes}}]``.
    """
    from fedpartial.flare.common import runtime_identity
    from fedpartial.site.kit import systemd_unit
    from fedpartial_tools.deploy.tools_wheel import build_tools

    kits = _kits(prod_dir)
    if not any(kind != "admin" for _, kind in kits):
        raise FileNotFoundError(f"no server or site kit in '{prod_dir}' (a prod_NN folder of a provisioning)")
    gpu_sites = _names(gpu, kits)
    os.makedirs(out_dir, exist_ok=True)
    wheel = os.path.abspath(wheel) if wheel else build_runtime(os.path.join(out_dir, "runtime"))
    tools_wheel = os.path.abspath(tools_wheel) if tools_wheel else build_tools(os.path.join(out_dir, "tools"))
    runtime_files = [wheel, wheel + ".sha256"] + [os.path.join(os.path.dirname(wheel), n)
                                                 for n in (SITE_LOCK, SITE_LOCK_CUDA)]
    tools_files = [tools_wheel, tools_wheel + ".sha256", os.path.join(os.path.dirname(tools_wheel), TOOLS_LOCK)]
    missing = [f for f in runtime_files + tools_files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"files missing beside the wheels: {missing} (build-runtime and build-tools "
                                f"write them)")
    identity = runtime_identity()
    out = []
    for name, kind in kits:
        dest = os.path.join(out_dir, name)
        if os.path.exists(dest):
            shutil.rmtree(dest)
        shutil.copytree(os.path.join(prod_dir, name), os.path.join(dest, "kit"), symlinks=True)
        for f in runtime_files + (tools_files if kind != "server" else []):
            shutil.copyfile(f, os.path.join(dest, os.path.basename(f)))
        if kind != "admin":
            unit = systemd_unit(f"{install_root}/{name}", user=user, python=f"{venv}/bin/python",
                                storage=storage if kind == "server" else None, gpu=name in gpu_sites,
                                memory_max=memory_max, cpu_quota=cpu_quota)
            with open(os.path.join(dest, f"fedpartial-{name}.service"), "w") as f:
                f.write(unit)
        with open(os.path.join(dest, "INSTALL.md"), "w") as f:
            f.write(install_text(name, kind, wheel, identity, install_root, venv, user, storage,
                                 tools_wheel if kind != "server" else "", tools_venv, gpu=name in gpu_sites,
                                 memory_max=memory_max, cpu_quota=cpu_quota))
        files = {}
        for folder, _, names in os.walk(dest):
            for n in names:
                path = os.path.join(folder, n)
                files[os.path.relpath(path, dest)] = os.path.getsize(path)
        out.append({"name": name, "kind": kind, "path": dest, "files": files})
    return out
