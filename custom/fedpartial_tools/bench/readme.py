"""The results section of a README: the bench tables with the command that reproduces each, the
plots copied next to it, written between the bench markers."""
from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
from typing import Dict, List, Optional, Sequence

from fedpartial_tools.bench.suites import REPO, SUITES, suites_of
from fedpartial_tools.bench.tables import add_gap_columns, read_rows, suite_table


# ---------------------------------------------------------------------------------------------
# README section
# ---------------------------------------------------------------------------------------------
README_BEGIN = "<!-- bench:results:begin -->"
README_END = "<!-- bench:results:end -->"


def _bench_args(row: dict) -> tuple:
    """``(args dict, inferred)`` of a row: what bench recorded, or for rows written before it
    recorded them, the profile whose round count matches the row (else ``--rounds``)."""
    raw = row.get("bench_args")
    if isinstance(raw, str) and raw.strip():
        try:
            return json.loads(raw), False
        except json.JSONDecodeError as e:
            raise ValueError(f"results.csv row {row['suite']}/{row['method']}/seed {row['seed']}: bad bench_args "
                             f"{raw!r}: {e}") from e
    suite = SUITES[row["suite"]]
    rounds = int(float(row.get("rounds") or 0)) or None
    for profile, items in suite.overrides.items():
        if f"num_rounds={rounds}" in items:
            return {"profile": profile, "rounds": None, "sets": [], "diagnostics": False}, True
    return {"profile": "cpu", "rounds": rounds, "sets": [], "diagnostics": False}, True


def _out_for_command(out_dir: str) -> str:
    """``--out`` as written in the README: relative to the repository when inside it."""
    path = os.path.abspath(out_dir)
    return os.path.relpath(path, REPO) if path.startswith(REPO + os.sep) else path


def bench_commands(rows: List[dict], out_dir: str) -> Dict[str, List[str]]:
    """The bench command lines that reproduce ``rows``, per suite, in the order to run them.

    Rows of a suite run with the same settings merge into one command (their seeds and jobs);
    every command after the first writes with ``--append``. Rows from before bench recorded its
    arguments get a command reconstructed from the suite's profiles, marked with a comment.

    Args:
        rows: results.csv rows.
        out_dir: the bench output folder (``--out``).
    """
    out, first, commands = _out_for_command(out_dir), True, {}
    for name in suites_of(rows):
        suite, groups = SUITES[name], {}
        for r in rows:
            if r["suite"] != name:
                continue
            args, inferred = _bench_args(r)
            g = groups.setdefault(json.dumps(args, sort_keys=True), {"args": args, "seeds": set(), "jobs": set(),
                                                                     "inferred": False})
            g["seeds"].add(int(r["seed"]))
            g["jobs"].add(r["method"])
            g["inferred"] |= inferred
        lines = []
        for g in groups.values():
            a = g["args"]
            parts = ["python -m fedpartial_tools bench", f"--suite {name}",
                     f"--seeds {','.join(str(s) for s in sorted(g['seeds']))}", f"--profile {a.get('profile', 'cpu')}"]
            if a.get("rounds"):
                parts.append(f"--rounds {int(a['rounds'])}")
            if g["jobs"] != set(suite.jobs):
                ordered = dict.fromkeys([*suite.jobs, *sorted(g["jobs"])])  # suite order, then any other job
                parts.append(f"--jobs {','.join(j for j in ordered if j in g['jobs'])}")
            if a.get("diagnostics"):
                parts.append("--diagnostics")
            parts += [f"--set {shlex.quote(s)}" for s in a.get("sets") or []]
            parts.append(f"--out {shlex.quote(out)}")
            if not first:
                parts.append("--append")
            first = False
            cmd = " ".join(parts)
            if g["inferred"]:
                cmd = "# reconstructed (these rows predate the recorded command)\n" + cmd
            lines.append(cmd)
        commands[name] = lines
    return commands


def _plots_of(name: str, folder: str) -> List[tuple]:
    """``(file name, alt text)`` of the suite's plots present in ``folder``."""
    found = [(f"{name}_curves.png", f"{name}: validation {SUITES[name].metrics[0]} per round"),
             (f"{name}_per_class_auc.png", f"{name}: per-class test AUC")]
    overlays = sorted(glob.glob(os.path.join(folder, f"{name}_overlays_seed*.png")))
    found += [(os.path.basename(p), f"{name}: test overlays, {os.path.basename(p)[len(name) + 10:-4]}")
              for p in overlays[:1]]  # one seed is enough in a README
    return [(f, alt) for f, alt in found if os.path.isfile(os.path.join(folder, f))]


def copy_outputs(out_dir: str, dest: str, suites: Sequence[str]) -> List[str]:
    """Copy results.csv / results.md and the suites' plots and pseudo-label tables to ``dest``.

    Args:
        out_dir: bench output folder.
        dest: folder to copy to (created), e.g. ``docs/results``.
        suites: suites whose files to copy.

    Returns:
        the copied file names.
    """
    os.makedirs(dest, exist_ok=True)
    names = ["results.csv", "results.md", "fedia_dice_per_completeness.png"]
    for name in suites:
        names += [os.path.basename(p) for p in glob.glob(os.path.join(out_dir, f"{name}_*"))
                  if p.endswith((".png", "_pseudo_labels.csv", "_pseudo_labels.md"))]
    copied = []
    for fname in sorted(set(names)):
        src = os.path.join(out_dir, fname)
        if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(dest, fname)):
            shutil.copyfile(src, os.path.join(dest, fname))
            copied.append(fname)
    return copied


def readme_section(out_dir: str, readme: str, plots_dir: Optional[str] = None) -> str:
    """Markdown for the README: per suite of results.csv its table, the bench command that
    produced it, the plots and (when present) the pseudo-label table.

    Args:
        out_dir: bench output folder (results.csv, ``<suite>_pseudo_labels.md``).
        readme: the README the section goes into (image links are relative to it).
        plots_dir: where the plots are (default ``out_dir``), e.g. a ``copy_outputs`` folder.
    """
    csv_path = os.path.join(out_dir, "results.csv")
    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"{csv_path} does not exist (run python -m fedpartial_tools bench --out {out_dir} first)")
    rows = read_rows(csv_path)
    add_gap_columns(rows)
    plots_dir = plots_dir or out_dir
    base = os.path.dirname(os.path.abspath(readme))
    link = lambda f: os.path.relpath(os.path.join(os.path.abspath(plots_dir), f), base).replace(os.sep, "/")  # noqa
    commands = bench_commands(rows, out_dir)
    parts = [f"<!-- generated by python -m fedpartial_tools bench-report --out {_out_for_command(out_dir)}: "
             f"edits between these markers are overwritten -->"]
    for name in suites_of(rows):
        parts.append(suite_table(name, rows).strip("\n"))
        parts.append("```bash\n" + "\n".join(commands[name]) + "\n```")
        images = [f"![{alt}]({link(f)})" for f, alt in _plots_of(name, plots_dir)]
        if images:
            parts.append("\n".join(images))
        pseudo = os.path.join(out_dir, f"{name}_pseudo_labels.md")
        if os.path.isfile(pseudo):
            parts.append(open(pseudo).read().strip("\n"))
    if os.path.isfile(os.path.join(plots_dir, "fedia_dice_per_completeness.png")):
        parts.append(f"![FedIA: test Dice per completeness setting]({link('fedia_dice_per_completeness.png')})")
    parts.append(f"All rows: [{os.path.basename(csv_path)}]({link('results.csv')})"
                 if os.path.isfile(os.path.join(plots_dir, "results.csv")) else "")
    return "\n\n".join(p for p in parts if p) + "\n"


def replace_between_markers(path: str, text: str, begin: str = README_BEGIN, end: str = README_END) -> None:
    """Replace what lies between the ``begin`` and ``end`` marker lines of ``path`` by ``text``
    (the markers stay; the file is written atomically).

    Raises:
        ValueError: a marker is missing, repeated, or the end comes before the begin.
    """
    with open(path) as f:
        content = f.read()
    for marker in (begin, end):
        count = content.count(marker)
        if count != 1:
            raise ValueError(f"{path}: needs exactly one '{marker}' marker, found {count}")
    i, j = content.index(begin) + len(begin), content.index(end)
    if j < i:
        raise ValueError(f"{path}: '{end}' comes before '{begin}'")
    new = content[:i] + "\n" + text.strip("\n") + "\n" + content[j:]
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(new)
    os.replace(tmp, path)


def update_readme(out_dir: str, readme: str, copy_plots: Optional[str] = None) -> str:
    """Write the results of ``out_dir`` between the bench markers of ``readme``.

    Args:
        out_dir: bench output folder.
        readme: markdown file holding the :data:`README_BEGIN` / :data:`README_END` markers.
        copy_plots: copy results and plots there first and link to the copies.

    Returns:
        the section written.
    """
    if not os.path.isfile(readme):
        raise FileNotFoundError(f"README '{readme}' does not exist")
    csv_path = os.path.join(out_dir, "results.csv")
    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"{csv_path} does not exist (run python -m fedpartial_tools bench --out {out_dir} first)")
    if copy_plots:
        suites = list(dict.fromkeys(r["suite"] for r in read_rows(csv_path)))
        copy_outputs(out_dir, copy_plots, suites)
    section = readme_section(out_dir, readme, plots_dir=copy_plots)
    replace_between_markers(readme, section)
    return section
