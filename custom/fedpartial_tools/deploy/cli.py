"""Command line for running fedpartial jobs on a real FLARE system (POC or provisioned startup
kits), behind ``poc/*.sh`` and ``provisioning/*.sh`` (thin wrappers), plus the job-folder helpers
they need (resource spec, task, demo data). The work itself lives by responsibility:

* :mod:`fedpartial_tools.deploy.provision`: one-machine ``project.yml``, ``nvflare provision``, the kits'
  environment (``kit_env``) and job store (``keep_server_storage_in``), the runtime wheel, Docker.
* :mod:`fedpartial_tools.deploy.processes`: start a kit, stop its process group, find and end every
  process whose command line names a state folder (no broad ``pkill``).
* :mod:`fedpartial_tools.deploy.admin`: admin kits and sessions, waiting for the sites, ``run_job``
  (submit, wait, download) and ``find_results``.

Command line (used by the shell scripts)::

    python -m fedpartial_tools.deploy poc-project --sites 3 --port 8102 --out STATE/project.yml
    python -m fedpartial_tools.deploy run-job --admin-kit KIT --job JOBDIR --out DIR [--timeout S] [--json]
    python -m fedpartial_tools.deploy results DIR          # where global_model.pt / metrics.json are
    python -m fedpartial_tools.deploy resource-spec JOBDIR --gpus 1 --gpu-mem 8
    python -m fedpartial_tools.deploy admin-kit PROD_DIR --role project_admin
    python -m fedpartial_tools.deploy job-task JOBDIR | data-overrides DATA_ROOT
    python -m fedpartial_tools.deploy stop-leftovers ROOT  # end processes naming ROOT; rc 1 if any survive
    python -m fedpartial_tools.deploy build-runtime --out DIR   # DIR/fedpartial_runtime-<version>-py3-none-any.whl
    python -m fedpartial_tools.deploy build-tools --out DIR     # DIR/fedpartial_tools-<version>-py3-none-any.whl
    python -m fedpartial_tools.deploy verify-runtime DIR/fedpartial_runtime-<version>-py3-none-any.whl
    python -m fedpartial_tools.deploy lock-site-requirements [--tools]   # requirements-site.lock (hashed pins)
    python -m fedpartial_tools.deploy docker-project provisioning/project.yml --out project_docker.yml
    python -m fedpartial_tools.deploy wait-sites PROD_DIR [--timeout S]   # until the server lists every site
    python -m fedpartial_tools.deploy cert-expiry KIT_OR_WORKSPACE [--warn-days 30]  # rc 1 if one is due
    python -m fedpartial_tools.deploy renew-certs WORKSPACE PROJECT_YML NAME... | all
    python -m fedpartial_tools.deploy join-ca WORKSPACE PROJECT_YML   # root CA folder for 'nvflare cert approve'
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from typing import Sequence

from fedpartial_tools.deploy.admin import (admin_kits, find_results, kit_sites, new_admin_session, run_job,
                                           wait_for_clients)
from fedpartial_tools.deploy.processes import kill_workspace_processes, live_workspace_processes
from fedpartial_tools.deploy.provision import (build_runtime, docker_project, free_port, latest_prod_dir,
                                               localhost_project, site_list, write_project)

def set_resource_spec(job_dir: str, sites: Sequence[str], gpus: int, gpu_mem_gib: float = 0) -> dict:
    """Write ``resource_spec`` of a job's meta.json: each site needs ``gpus`` GPUs with
    ``gpu_mem_gib`` GiB. ``gpus=0`` clears it (``{}``: runs on CPU-only sites).

    A site whose resource manager has fewer GPUs (every kit defaults to ``num_of_gpus: 0``; set
    ``capacity`` in project.yml) makes the scheduler hold the job as SUBMITTED and retry with
    back-off (10 tries, ~30 min) before it ends FINISHED_CANT_SCHEDULE.
    """
    path = os.path.join(job_dir, "meta.json")
    meta = json.load(open(path))
    meta["resource_spec"] = ({} if gpus <= 0 else
                             {s: {"num_of_gpus": int(gpus), "mem_per_gpu_in_GiB": gpu_mem_gib} for s in sites})
    with open(path, "w") as f:
        json.dump(meta, f, indent=2)
    return meta["resource_spec"]


def job_model(job_dir: str) -> dict:
    """The ``model`` block of a job's server config (arch, task, class_names, in_channels...)."""
    found = glob.glob(os.path.join(job_dir, "*", "config", "config_fed_server.json"))
    if not found:
        raise FileNotFoundError(f"job '{job_dir}' has no */config/config_fed_server.json")
    model = json.load(open(found[0])).get("model")
    if not isinstance(model, dict):
        raise ValueError(f"'{found[0]}' has no 'model' block")
    return model


def demo_data(job_dir: str, out_dir: str, sites: int, shared_data: str = "") -> str:
    """Site files for the demo of ``job_dir``: HAM10000 from ``../shared/data`` for single-label
    jobs when it is there, else the built-in synthetic data; the scenario follows the method.
    Returns the source ``.npz`` (its test split is what the demo evaluates on)."""
    from fedpartial_tools.data import synthetic
    from fedpartial.data.npz import save_npz
    from fedpartial_tools.data.partition import split_file

    task = job_model(job_dir).get("task", "multi-label")
    name = os.path.basename(os.path.abspath(job_dir))
    shared_data = shared_data or os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))), "..", "shared", "data")
    ham = os.path.abspath(os.path.join(shared_data, "ham10000_28.npz"))
    os.makedirs(out_dir, exist_ok=True)
    if task == "single-label" and os.path.isfile(ham) and sites >= 3:
        source, num_classes, per_site = ham, 7, 3
    else:
        source, num_classes, per_site = os.path.join(out_dir, "source.npz"), 5, 2
        data = (synthetic.make_segmentation(seed=0) if task == "segmentation"
                else synthetic.make_classification(task=task, num_classes=num_classes, seed=0))
        save_npz(data, source)
    if task == "segmentation":
        options = {"scenario": "incomplete-masks", "completeness": [(0.4, 0.7, 1.0)[k % 3] for k in range(sites)]}
    elif name.startswith("fedirm"):
        options = {"scenario": "semi-supervised", "labelled_sites": max(1, sites // 3)}
    elif name.startswith("fedmlp"):
        options = {"scenario": "missing-classes", "missing_per_site": 2}
    else:
        options = {"scenario": "label-set-mismatch", "classes_per_site": max(per_site, -(-num_classes // sites))}
    scenario = options.pop("scenario")
    split_file(source, scenario, sites=sites, seed=0, out=os.path.join(out_dir, "sites"), **options)
    return source


# ---------------------------------------------------------------- command line

def _cmd_poc_project(args):
    sites = args.site_names.split(",") if args.site_names else site_list(args.sites)
    project = localhost_project(args.name, args.port or free_port(), sites, server_name="server")
    write_project(args.out, project)
    print(args.out)


def _cmd_localhost_project(args):
    sites = args.site_names.split(",") if args.site_names else site_list(args.sites)
    write_project(args.out, localhost_project(args.name, args.port or free_port(), sites))
    print(args.out)


def _cmd_run_job(args):
    import contextlib

    # with --json stdout is the JSON alone: nvflare's "Connecting to FLARE ..." and progress go to stderr
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    with contextlib.redirect_stdout(sys.stderr):
        session = new_admin_session(args.admin_kit, timeout=args.connect_timeout)
    try:
        result = run_job(session, args.job, args.out, timeout=args.timeout, log=say,
                         server_dir=args.server_dir or None, check_sites=not args.allow_waiting)
    finally:
        session.close()
    if args.latest_link:  # OUT/latest -> the newest result of this job
        link = os.path.join(args.out, "latest")
        if os.path.islink(link):
            os.remove(link)
        os.symlink(result["job_id"], link)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        say(f"job {result['job_id']}: {result['status']}; result in {result['result_dir']}")
        for key in ("result_model", "global_model", "best_global_model", "metrics", "cross_site_val", "tensorboard",
                    "server_log"):
            say(f"  {key + ':':18s} {result.get(key) or '-'}")
    if not str(result["status"]).endswith("COMPLETED") or not result["global_model"]:
        print(f"error: job {result['job_id']} ended {result['status']}; server log: {result['server_log']}",
              file=sys.stderr)
        raise SystemExit(1)


def _cmd_results(args):
    print(json.dumps(find_results(args.dir), indent=1))


def _cmd_resource_spec(args):
    meta = json.load(open(os.path.join(args.job, "meta.json")))
    sites = args.site_names.split(",") if args.site_names else None
    if not sites:
        sites = site_list(int(meta.get("min_clients", 2)))
    print(json.dumps(set_resource_spec(args.job, sites, args.gpus, args.gpu_mem)))


def _cmd_admin_kit(args):
    kits = [k for k, role in admin_kits(args.prod_dir).items() if role == args.role]
    if not kits:
        raise FileNotFoundError(f"no admin kit with role '{args.role}' in '{args.prod_dir}'")
    print(kits[0])


def _cmd_job_task(args):
    print(job_model(args.job).get("task", ""))


def _cmd_demo_data(args):
    print(demo_data(args.job, args.out, args.sites))


def _cmd_data_overrides(args):
    from fedpartial_tools.data.sites import dataset_overrides

    print("\n".join(dataset_overrides(args.data_root)))


def _cmd_progress(args):
    from fedpartial_tools.jobs.settings import _config_paths
    from fedpartial_tools.run.progress import RoundProgress

    config = json.load(open(_config_paths(args.job)["server"]))
    progress = RoundProgress(int(config.get("num_rounds", 0)), str(config.get("key_metric", "")),
                             log=lambda m: print(m, flush=True))
    while True:
        progress.update(args.metrics if os.path.isfile(args.metrics) else None)
        if args.while_pid and not os.path.exists(f"/proc/{args.while_pid}") or \
                progress.rounds_done >= progress.num_rounds:
            break
        time.sleep(args.every)


def _cmd_stop_leftovers(args):
    killed = kill_workspace_processes(args.root, wait=args.wait)
    for pid, cmd in sorted(killed.items()):
        print(f"killed leftover {pid}: {cmd[:160]}", file=sys.stderr)
    left = live_workspace_processes(args.root)
    if left:
        for pid, cmd in sorted(left.items()):
            print(f"error: still running {pid}: {cmd[:160]}", file=sys.stderr)
        raise SystemExit(1)
    print(f"no process of {os.path.abspath(args.root)} is running")


def _cmd_docker_project(args):
    import yaml

    import fedpartial

    with open(args.project) as f:
        project = yaml.safe_load(f)
    write_project(args.out, docker_project(project, args.image or f"fedpartial:{fedpartial.__version__}",
                                           project_dir=os.path.dirname(os.path.abspath(args.project))))
    print(args.out)


def _cmd_build_runtime(args):
    print(build_runtime(args.out))


def _cmd_build_tools(args):
    from fedpartial_tools.deploy.tools_wheel import build_tools

    print(build_tools(args.out))


def _cmd_verify_runtime(args):
    from fedpartial_tools.deploy.provision import verify_runtime

    for path in verify_runtime(args.wheel):
        print(f"{path}: OK")


def _cmd_lock_site_requirements(args):
    from fedpartial_tools.deploy.provision import check_site_lock, lock_site_requirements

    started = time.time()
    out = lock_site_requirements(args.out or None, args.requirements or None, torch=args.torch,
                                 pip_args=args.pip_arg, timeout=args.timeout, tools=args.tools)
    print(f"{out}: {len(check_site_lock(out))} hashed requirements ({time.time() - started:.0f} s)")


def _cmd_offer_dataset(args):
    from fedpartial.site.command import offer_dataset_here

    offer_dataset_here(args.kit, args.name, args.folder)


def _cmd_site_bundle(args):
    from fedpartial_tools.deploy.bundle import site_bundle

    started = time.time()
    gpu = "all" if args.gpu == "all" else [n for n in args.gpu.split(",") if n]
    for b in site_bundle(args.prod_dir, args.out, wheel=args.wheel, install_root=args.install_root,
                         venv=args.venv, user=args.user, storage=args.storage, tools_wheel=args.tools_wheel,
                         tools_venv=args.tools_venv, gpu=gpu, memory_max=args.memory_max, cpu_quota=args.cpu_quota):
        top = {f: n for f, n in b["files"].items() if not f.startswith("kit" + os.sep)}
        kit = sum(n for f, n in b["files"].items() if f.startswith("kit" + os.sep))
        print(f"{b['path']} ({b['kind']}): kit/ {kit / 1024:.0f} KiB; "
              + ", ".join(f"{f} {n / 1024:.0f} KiB" for f, n in sorted(top.items())))
    print(f"bundles written in {time.time() - started:.1f} s; each folder's INSTALL.md says what to run")


def _cmd_wait_sites(args):
    sites = args.site_names.split(",") if args.site_names else kit_sites(args.prod_dir)
    if not sites:
        raise FileNotFoundError(f"no site kit (startup/fed_client.json) in '{args.prod_dir}'")
    kit = args.admin_kit or next((k for k, r in admin_kits(args.prod_dir).items() if r == "project_admin"), None)
    if not kit:
        raise FileNotFoundError(f"no project_admin kit in '{args.prod_dir}'; pass --admin-kit")
    import contextlib

    started = time.time()
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # nvflare's "Connecting to FLARE ..."
        session = new_admin_session(kit, timeout=args.timeout)
    try:
        connected = wait_for_clients(session, sites, timeout=max(1.0, args.timeout - (time.time() - started)))
    finally:
        session.close()
    print(f"server lists all {len(sites)} site(s) after {time.time() - started:.0f} s: {', '.join(connected)}")


def _cmd_cert_expiry(args):
    from fedpartial.site.command import print_cert_expiry

    print_cert_expiry(args.path, args.warn_days, args.json)


def _project_name(project_yml: str) -> str:
    import yaml

    return yaml.safe_load(open(project_yml))["name"]


def _cmd_renew_certs(args):
    from fedpartial_tools.deploy.certs import renew

    names = renew(args.workspace, _project_name(args.project), args.names)
    print(f"new keys and certificates for {', '.join(names)} at the next provisioning of {args.workspace} "
          f"(same root CA)")


def _cmd_join_ca(args):
    from fedpartial_tools.deploy.certs import export_ca_dir

    project = _project_name(args.project)
    prod = latest_prod_dir(args.workspace, project)
    servers = glob.glob(os.path.join(prod, "*", "startup", "fed_server.json"))
    if not servers:
        raise FileNotFoundError(f"no server kit in '{prod}'")
    out = export_ca_dir(os.path.abspath(args.workspace), project, os.path.dirname(os.path.dirname(servers[0])))
    print(json.dumps(out, indent=1))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedpartial_tools.deploy", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for cmd, fn, what in (("poc-project", _cmd_poc_project, "project.yml for 'nvflare poc prepare -i'"),
                          ("localhost-project", _cmd_localhost_project, "one-machine project.yml to provision")):
        s = sub.add_parser(cmd, help=what)
        s.add_argument("--sites", type=int, default=2)
        s.add_argument("--site-names", default="", help="comma-separated names (instead of --sites)")
        s.add_argument("--port", type=int, default=0, help="server port (0 = a free one)")
        s.add_argument("--name", default="fedpartial")
        s.add_argument("--out", required=True)
        s.set_defaults(func=fn)
    s = sub.add_parser("run-job", help="submit a job folder, wait, download the result (admin API)")
    s.add_argument("--admin-kit", required=True, help="admin startup kit folder (project_admin or lead)")
    s.add_argument("--job", required=True, help="submit-ready job folder")
    s.add_argument("--out", required=True, help="download folder")
    s.add_argument("--timeout", type=float, default=0, help="seconds (0 = no limit); the job is aborted after")
    s.add_argument("--connect-timeout", type=float, default=30)
    s.add_argument("--server-dir", default="", help="the server's workspace if on this machine (POC): "
                                                    "progress lines from its metrics.json")
    s.add_argument("--latest-link", action="store_true", help="point OUT/latest at this result")
    s.add_argument("--allow-waiting", action="store_true",
                   help="submit even when the job's min_clients exceeds the sites connected now (it waits in "
                        "SUBMITTED until they connect); refused by default")
    s.add_argument("--json", action="store_true", help="print the result as JSON (progress on stderr)")
    s.set_defaults(func=_cmd_run_job)
    s = sub.add_parser("results", help="where the outputs of a downloaded job are")
    s.add_argument("dir")
    s.set_defaults(func=_cmd_results)
    s = sub.add_parser("resource-spec", help="set the GPU resource_spec of a packaged job's meta.json")
    s.add_argument("job")
    s.add_argument("--gpus", type=int, required=True, help="GPUs per site (0 = none: CPU sites accept the job)")
    s.add_argument("--gpu-mem", type=float, default=0, help="GiB per GPU")
    s.add_argument("--site-names", default="", help="comma-separated (default site-1..site-<min_clients>)")
    s.set_defaults(func=_cmd_resource_spec)
    s = sub.add_parser("job-task", help="print the task (single-label | multi-label | segmentation) of a job")
    s.add_argument("job")
    s.set_defaults(func=_cmd_job_task)
    s = sub.add_parser("demo-data", help="make the demo's site files in OUT/sites; print the source .npz")
    s.add_argument("job")
    s.add_argument("--out", required=True)
    s.add_argument("--sites", type=int, default=3)
    s.set_defaults(func=_cmd_demo_data)
    s = sub.add_parser("data-overrides", help="print key=value settings fitting a job's model to site files")
    s.add_argument("data_root")
    s.set_defaults(func=_cmd_data_overrides)
    s = sub.add_parser("admin-kit", help="print the first admin kit of a prod_NN folder with a role")
    s.add_argument("prod_dir")
    s.add_argument("--role", default="project_admin", help="project_admin | lead | org_admin | member")
    s.set_defaults(func=_cmd_admin_kit)
    s = sub.add_parser("progress", help="print round k/N, the key metric and time left from a server's "
                                        "metrics.json until the job's rounds are done or PID ends")
    s.add_argument("--job", required=True, help="the packaged job folder (for num_rounds and key_metric)")
    s.add_argument("--metrics", required=True, help="the server's <job id>/metrics.json (may not exist yet)")
    s.add_argument("--while-pid", type=int, default=0, help="stop when this process has ended")
    s.add_argument("--every", type=float, default=3.0, help="seconds between looks")
    s.set_defaults(func=_cmd_progress)
    s = sub.add_parser("build-runtime", help="build the versioned runtime wheel (package fedpartial only) that "
                                             "every site and the server install")
    s.add_argument("--out", required=True, help="folder for fedpartial_runtime-<version>-py3-none-any.whl, its "
                                                "requirements-site.lock and <wheel>.sha256")
    s.set_defaults(func=_cmd_build_runtime)
    s = sub.add_parser("build-tools", help="build the tools wheel (the model user's import, evaluate, predict, "
                                           "export) for a venv at a site or on a workstation")
    s.add_argument("--out", required=True, help="folder for fedpartial_tools-<version>-py3-none-any.whl, its "
                                                "requirements-tools.lock and <wheel>.sha256")
    s.set_defaults(func=_cmd_build_tools)
    s = sub.add_parser("verify-runtime", help="check the files <wheel>.sha256 names (the wheel, its lock) against "
                                              "their sha256; exit 2 naming the first that differs")
    s.add_argument("wheel", help="fedpartial_runtime-<version>-py3-none-any.whl or fedpartial_tools-<version>-"
                                 "py3-none-any.whl (the .sha256 beside it)")
    s.set_defaults(func=_cmd_verify_runtime)
    s = sub.add_parser("lock-site-requirements",
                       help="write requirements-site.lock: pyproject's runtime dependencies at requirements.txt's "
                            "pins and all they need, each with its sha256 (pip's resolver, --dry-run --report)")
    s.add_argument("--out", default="", help="default: <repo>/requirements-site.lock (--tools: "
                                              "<repo>/requirements-tools.lock)")
    s.add_argument("--tools", action="store_true",
                   help="the tools lock: the runtime's dependencies plus pyproject's 'use' extra (the model "
                        "user's venv: import, evaluate, predict, export, monai.bundle run)")
    s.add_argument("--requirements", default="", help="the pins (default: <repo>/requirements.txt)")
    s.add_argument("--torch", default="", help="a torch pin replacing requirements.txt's, e.g. torch==2.13.0+cu128")
    s.add_argument("--pip-arg", action="append", default=[],
                   help="an argument for 'pip install' (repeat), e.g. --pip-arg=--extra-index-url=URL")
    s.add_argument("--timeout", type=float, default=600, help="seconds for pip")
    s.set_defaults(func=_cmd_lock_site_requirements)
    s = sub.add_parser("docker-project", help="a project.yml whose kits get docker.sh and the provisioning "
                                              "compose.yaml for the fedpartial image")
    s.add_argument("project", help="e.g. provisioning/project.yml")
    s.add_argument("--image", default="", help="default fedpartial:<fedpartial.__version__> (docker/build.sh)")
    s.add_argument("--out", required=True, help="the project file to write (provision it like the original)")
    s.set_defaults(func=_cmd_docker_project)
    s = sub.add_parser("stop-leftovers", help="end every process naming ROOT; exit 1 if one survives")
    s.add_argument("root")
    s.add_argument("--wait", type=float, default=0, help="seconds to let them exit by themselves first")
    s.set_defaults(func=_cmd_stop_leftovers)
    s = sub.add_parser("site-bundle", help="one folder per kit of PROD_DIR (server, sites, admins) with all it "
                                            "installs: kit, runtime wheel and hashed locks (CPU, CUDA), tools wheel "
                                            "and its lock (sites, admins), systemd unit (server, sites), INSTALL.md")
    s.add_argument("prod_dir", help="a provisioned prod_NN folder")
    s.add_argument("--out", required=True)
    s.add_argument("--wheel", default=None, help="a wheel built before (default: build one into OUT/runtime)")
    s.add_argument("--install-root", default="/opt/flare", help="where the kits go on the machines")
    s.add_argument("--venv", default="/opt/fedpartial/venv", help="the venv the runtime goes to on the machines")
    s.add_argument("--user", default="flare", help="the unprivileged OS user that runs each kit")
    s.add_argument("--storage", default="/var/lib/fedpartial", help="the server's job store on its machine")
    s.add_argument("--tools-wheel", default=None, help="a tools wheel built before (default: build one into OUT/tools)")
    s.add_argument("--tools-venv", default="/opt/fedpartial/tools",
                   help="the venv a site installs the tools wheel in (import, evaluate, predict, export)")
    s.add_argument("--gpu", default="", metavar="SITES",
                   help="comma-separated sites that train on NVIDIA GPUs, or 'all': their units keep the devices "
                        "visible (PrivateDevices off) and INSTALL.md puts the CUDA lock first")
    s.add_argument("--memory-max", default="80%", help="MemoryMax= of the units (e.g. 48G or 80%%; '' = none)")
    s.add_argument("--cpu-quota", default="", help="CPUQuota= of the units (e.g. 800%% = 8 cores; '' = none)")
    s.set_defaults(func=_cmd_site_bundle)

    s = sub.add_parser("offer-dataset", help="let jobs read a folder of site files under a name: adds NAME -> "
                                              "FOLDER to KIT/local/fedpartial_site.json (jobs then name it with "
                                              "package-job --dataset NAME)")
    s.add_argument("kit", help="the site's startup kit (its folder holding startup/ and local/)")
    s.add_argument("name", help="the dataset name jobs give")
    s.add_argument("folder", help="the folder holding <site>.npz (or site folders)")
    s.set_defaults(func=_cmd_offer_dataset)

    s = sub.add_parser("wait-sites", help="wait until the server lists every site kit of PROD_DIR (admin API)")
    s.add_argument("prod_dir")
    s.add_argument("--site-names", default="", help="comma-separated (default: every site kit of PROD_DIR)")
    s.add_argument("--admin-kit", default="", help="default: the project_admin kit of PROD_DIR")
    s.add_argument("--timeout", type=float, default=120, help="seconds; exit 2 when a site is still missing")
    s.set_defaults(func=_cmd_wait_sites)
    s = sub.add_parser("cert-expiry", help="expiry of every kit's certificate and the root CA; exit 1 when one "
                                           "is expired or has fewer than --warn-days left")
    s.add_argument("path", help="a startup kit, a prod_NN folder or a provisioning workspace")
    s.add_argument("--warn-days", type=float, default=30)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_cert_expiry)
    s = sub.add_parser("renew-certs", help="make the next provisioning of WORKSPACE issue new certificates for "
                                           "NAMES (same root CA); then run provisioning/provision.sh")
    s.add_argument("workspace")
    s.add_argument("project", help="the project.yml provisioned into WORKSPACE")
    s.add_argument("names", nargs="+", help="participant names, or 'all'")
    s.set_defaults(func=_cmd_renew_certs)
    s = sub.add_parser("join-ca", help="write WORKSPACE's root CA as 'nvflare cert approve' reads it (-c DIR, "
                                       "--profile FILE); print both and the root CA fingerprint")
    s.add_argument("workspace")
    s.add_argument("project", help="the project.yml provisioned into WORKSPACE")
    s.set_defaults(func=_cmd_join_ca)
    return p


def main(argv=None):
    from fedpartial.site.command import run

    run(build_parser(), argv, errors=(ValueError, FileNotFoundError, RuntimeError, TimeoutError))


if __name__ == "__main__":
    main()
