"""``fedpartial-site``: the site operator's command, installed with the runtime wheel.

    fedpartial-site start KIT [--storage DIR] [--foreground]   # the kit's restart loop
    fedpartial-site stop KIT [--wait S]                         # and wait until every process is gone
    fedpartial-site status KIT [--json]
    fedpartial-site preflight KIT                               # exit 1 when a check fails
    fedpartial-site cert-expiry KIT [--warn-days N] [--json]    # exit 1: expired or < N days left
    fedpartial-site clean KIT --older-than DAYS [--dry-run]     # old job folders, never a running job's
    fedpartial-site offer-dataset KIT NAME FOLDER               # which data jobs may read
    fedpartial-site systemd-unit KIT [--user flare] [--storage DIR] [--gpu] [--memory-max 80%] [--cpu-quota 400%]

Also ``python -m fedpartial.site.command ...``. Errors are one line naming the kit or file (exit 2).
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _cmd_start(args):
    from fedpartial.site.kit import start

    pid = start(args.kit, storage=args.storage, foreground=args.foreground)
    print(f"started {os.path.basename(os.path.abspath(args.kit))} (restart loop pid {pid}, python {sys.executable}); "
          f"log: {os.path.join(os.path.abspath(args.kit), 'log.txt')}")


def _cmd_stop(args):
    from fedpartial.site.kit import stop

    killed = stop(args.kit, wait=args.wait)
    for pid, cmd in sorted(killed.items()):
        print(f"killed {pid}: {cmd[:120]}", file=sys.stderr)
    print(f"stopped {os.path.basename(os.path.abspath(args.kit))}: no process of it is running")


def _cmd_status(args):
    from fedpartial.site.kit import status

    info = status(args.kit)
    if args.json:
        print(json.dumps(info, indent=1))
        return
    datasets = info["datasets"]
    print(f"{info['kind']} {info['name']} ({info['kit']}): {'running' if info['running'] else 'stopped'} "
          f"({info['processes']} process(es))\n"
          f"runtime     {info['runtime']}\n"
          f"datasets    {', '.join(f'{k} -> {v}' for k, v in sorted(datasets.items())) if datasets else datasets}\n"
          f"certificate {info['certificate_days_left']} days left\n"
          f"job folders {info['job_folders']} ({info['job_bytes'] / 2 ** 20:.1f} MiB)\n"
          + (f"job store   {info['job_store']}: {info['job_store_jobs']} job(s) "
             f"({info['job_store_bytes'] / 2 ** 20:.1f} MiB)\n" if info["kind"] == "server" else "") +
          f"last log    {info['last_log_line'][:160]}")


def _cmd_preflight(args):
    from fedpartial.site.kit import preflight

    rows = preflight(args.kit, warn_days=args.warn_days, timeout=args.timeout)
    for r in rows:
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['check']:22s} {r['detail']}")
    failed = [r["check"] for r in rows if not r["ok"]]
    if failed:
        print(f"{len(failed)} check(s) failed: {', '.join(failed)}")
        raise SystemExit(1)


def print_cert_expiry(path: str, warn_days: float, as_json: bool) -> None:
    """Print the expiry report of the kits at / under ``path``; exit 1 when a certificate has
    expired or has fewer than ``warn_days`` days left (for a daily cron job)."""
    from fedpartial.site.certificates import expiry_report, format_report

    rows = expiry_report(path, warn_days=warn_days)
    print(json.dumps(rows, indent=1) if as_json else format_report(rows, warn_days))
    if any(r["status"] != "ok" for r in rows):
        raise SystemExit(1)


def _cmd_cert_expiry(args):
    print_cert_expiry(args.kit, args.warn_days, args.json)


def _cmd_clean(args):
    from fedpartial.site.kit import clean

    gone = clean(args.kit, args.older_than, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for job in gone:
        print(f"{verb} {job['path']} ({job['bytes'] / 2 ** 20:.1f} MiB)")
    print(f"{verb} {len(gone)} job folder(s), {sum(j['bytes'] for j in gone) / 2 ** 20:.1f} MiB")


def offer_dataset_here(kit: str, name: str, folder: str) -> str:
    """Offer ``folder`` under ``name`` in the kit (a site kit only); print what was written and, on
    stderr, a warning when the folder does not (yet) hold this site's file readable by this user."""
    from fedpartial.flare.site_config import offer_dataset
    from fedpartial.site.kit import dataset_problem, kit_kind

    if kit_kind(kit) != "site":
        raise ValueError(f"'{kit}' is the server's kit: datasets are offered by site kits")
    path = offer_dataset(kit, name, folder)
    print(f"jobs may now name dataset '{name}' ({os.path.abspath(folder)}): {path}; a running kit reads it at "
          f"each job's start")
    problem, _ = dataset_problem(kit, os.path.abspath(folder))
    if problem:
        print(f"warning: {problem}: a job naming '{name}' fails at this site until it is there", file=sys.stderr)
    return path


def _cmd_offer_dataset(args):
    offer_dataset_here(args.kit, args.name, args.folder)


def _cmd_systemd_unit(args):
    from fedpartial.site.kit import systemd_unit

    print(systemd_unit(args.kit, user=args.user, storage=args.storage, gpu=args.gpu, memory_max=args.memory_max,
                       cpu_quota=args.cpu_quota), end="")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedpartial-site", description="operate a fedpartial server or site kit")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start", help="start the kit's restart loop (background; --foreground for systemd)")
    s.add_argument("kit")
    s.add_argument("--storage", default=None, help="server only: the job store (default /tmp/nvflare)")
    s.add_argument("--foreground", action="store_true")
    s.set_defaults(func=_cmd_start)
    s = sub.add_parser("stop", help="stop the kit; wait until every process of it is gone")
    s.add_argument("kit")
    s.add_argument("--wait", type=float, default=60.0, help="seconds before the rest is killed (default 60)")
    s.set_defaults(func=_cmd_stop)
    s = sub.add_parser("status", help="running or not, runtime, datasets, certificate, job folders")
    s.add_argument("kit")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_status)
    s = sub.add_parser("preflight", help="check the kit before it goes live; exit 1 when a check fails")
    s.add_argument("kit")
    s.add_argument("--warn-days", type=float, default=30)
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server's port")
    s.set_defaults(func=_cmd_preflight)
    s = sub.add_parser("cert-expiry", help="certificate expiry; exit 1 when expired or under --warn-days")
    s.add_argument("kit")
    s.add_argument("--warn-days", type=float, default=30)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_cert_expiry)
    s = sub.add_parser("clean", help="remove job folders older than --older-than days (never a running job's)")
    s.add_argument("kit")
    s.add_argument("--older-than", type=float, required=True, metavar="DAYS")
    s.add_argument("--dry-run", action="store_true")
    s.set_defaults(func=_cmd_clean)
    s = sub.add_parser("offer-dataset", help="let jobs read FOLDER under NAME (local/fedpartial_site.json)")
    s.add_argument("kit")
    s.add_argument("name")
    s.add_argument("folder")
    s.set_defaults(func=_cmd_offer_dataset)
    s = sub.add_parser("systemd-unit", help="print a systemd unit running the kit as an unprivileged user")
    s.add_argument("kit")
    s.add_argument("--user", default="flare")
    s.add_argument("--storage", default=None, help="server only: its job store, writable besides the kit")
    s.add_argument("--gpu", action="store_true", help="a GPU site: the devices stay visible")
    s.add_argument("--memory-max", default="80%", help="MemoryMax= (e.g. 48G or 80%%; '' = none)")
    s.add_argument("--cpu-quota", default="", help="CPUQuota= (e.g. 800%% = 8 cores; '' = none)")
    s.set_defaults(func=_cmd_systemd_unit)
    return p


def run(parser: argparse.ArgumentParser, argv=None, errors=(ValueError, FileNotFoundError, RuntimeError, OSError)):
    """Parse ``argv`` and run the chosen command; an expected error is one line on stderr, exit 2.

    Args:
        parser: a parser whose subcommands set ``func``.
        argv: the arguments (default: the command line).
        errors: the exception types reported as one line instead of a traceback.
    """
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)


def main(argv=None):
    run(build_parser(), argv)


if __name__ == "__main__":
    main()
