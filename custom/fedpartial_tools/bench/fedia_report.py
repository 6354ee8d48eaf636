"""What segmentation bench runs did round by round: how many rounds each run's global model
predicted no lesion on any site's val images, FedIA's completeness estimates against the share of
lesions the split kept (counted), and the per-round aggregation weights, from the runs'
metrics.json (``server`` entries) and the splits' split_summary.json.

    python -m fedpartial_tools.bench.fedia_report --out runs/bench_ms7 [--weights-of ms-p7-m2/seed0/fedia_lesions]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
from typing import Dict, List, Optional, Tuple

def _rounds(ws: str) -> List[dict]:
    path = os.path.join(ws, "metrics.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return json.load(f).get("rounds", [])


def completeness_rows(out_dir: str) -> List[dict]:
    """One row per suite, seed, FedIA run and site: the estimate the sites sent (the first round
    at which every site was ready, as the server used it) and the counted truth. A FedIA run is
    any job whose metrics.json holds the server's completeness entries.

    Args:
        out_dir: a bench output folder (``<suite>/seed<k>/<job>/metrics.json``).
    """
    rows = []
    for summary_path in sorted(glob.glob(os.path.join(out_dir, "*", "seed*", "sites", "split_summary.json"))):
        seed_dir = os.path.dirname(os.path.dirname(summary_path))
        suite, seed = os.path.basename(os.path.dirname(seed_dir)), os.path.basename(seed_dir)
        with open(summary_path) as f:
            per_site = json.load(f)["per_site"]
        for ws in sorted(glob.glob(os.path.join(seed_dir, "*", "metrics.json"))):
            job = os.path.basename(os.path.dirname(ws))
            rounds = _rounds(os.path.dirname(ws))
            if not any("completeness" in r.get("server", {}) for r in rounds):
                continue
            ready = [r for r in rounds if r.get("server", {}).get("completeness_ready")
                     and all(r["server"]["completeness_ready"].values())]
            first = ready[0] if ready else None
            for site, info in sorted(per_site.items()):
                true = info["lesions_kept"] / info["lesions_total"] if info.get("lesions_total") else None
                rows.append({"suite": suite, "seed": seed, "job": job, "site": site, "true": true,
                             "estimate": first["server"]["completeness"].get(site) if first else None,
                             "round": first["round"] if first else None})
    return rows


def blank_rounds(ws: str) -> Optional[Tuple[int, int]]:
    """``(rounds whose received global model predicted no lesion on any site's val images,
    rounds)``; None without pooled validation (e.g. classification)."""
    from fedpartial.metrics.segmentation import pooled_validation

    pooled = [pooled_validation({k: s.get("val") for k, s in r.get("sites", {}).items()}) for r in _rounds(ws)]
    if not pooled or any(p is None for p in pooled):
        return None
    return sum(1 for p in pooled if p["n_images"] and p["predicted_lesion_share"] == 0), len(pooled)


def blank_rounds_table(out_dir: str) -> str:
    """Markdown: per suite and job, the rounds without any predicted lesion of each seed's run."""
    runs: Dict[tuple, Dict[str, int]] = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "*", "seed*", "*", "metrics.json"))):
        ws = os.path.dirname(path)
        seed_dir = os.path.dirname(ws)
        key = (os.path.basename(os.path.dirname(seed_dir)), os.path.basename(ws))
        counts = blank_rounds(ws)
        if counts is not None:
            runs.setdefault(key, {})[os.path.basename(seed_dir)] = f"{counts[0]}/{counts[1]}"
    lines = ["| suite | job | rounds without a predicted lesion, per seed |", "|---|---|---|"]
    for (suite, job), seeds in sorted(runs.items()):
        lines.append(f"| {suite} | {job} | " + ", ".join(f"{s}: {v}" for s, v in sorted(seeds.items())) + " |")
    return "\n".join(lines) + "\n"


def val_scores(ws: str) -> Dict[str, Optional[float]]:
    """Pooled val Dice of the run's last aggregate and best model on the sites' val splits (slices
    of the training patients that no site trained on, complete masks), from cross_site_val.json."""
    from fedpartial_tools.run.results import server_model_validation

    path = os.path.join(ws, "cross_site_val.json")
    if not os.path.isfile(path):
        return {"val_last": None, "val_best": None}
    with open(path) as f:
        scores = server_model_validation(json.load(f))
    return {"val_last": scores.get("global_model.pt", {}).get("dice_pooled"),
            "val_best": scores.get("best_global_model.pt", {}).get("dice_pooled")}


def seed_table(out_dir: str) -> str:
    """Markdown: per suite, seed and job, the held-out test Dice (pooled, per image) of the last
    aggregate and of best_global_model.pt, and the pooled val Dice of both (results.csv + runs)."""
    import csv

    path = os.path.join(out_dir, "results.csv")
    if not os.path.isfile(path):
        return f"(no results.csv in {out_dir})\n"
    with open(path) as f:
        rows = list(csv.DictReader(f))

    def cell(value) -> str:
        try:
            return f"{float(value):.3f}"
        except (TypeError, ValueError):
            return "-"

    lines = ["| suite | seed | job | test pooled (last / best) | test per image (last / best) | val pooled (last / best) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        val = val_scores(os.path.join(out_dir, row["suite"], f"seed{row['seed']}", row["method"]))
        lines.append(f"| {row['suite']} | {row['seed']} | {row['method']} | {cell(row.get('dice_pooled'))} / "
                     f"{cell(row.get('dice_pooled_best'))} | {cell(row.get('dice_per_image'))} / "
                     f"{cell(row.get('dice_per_image_best'))} | {cell(val['val_last'])} / {cell(val['val_best'])} |")
    return "\n".join(lines) + "\n"


def weights_table(ws: str) -> str:
    """Markdown: the rule and each site's weight per round of one run."""
    rounds = _rounds(ws)
    if not rounds:
        return f"(no metrics.json in {ws})\n"
    sites = sorted(rounds[0].get("server", {}).get("weights", {}))
    lines = ["| round | rule | " + " | ".join(sites) + " |", "|---|---|" + "---|" * len(sites)]
    for r in rounds:
        server = r.get("server", {})
        weights = server.get("weights", {})
        lines.append(f"| {r['round']} | {server.get('rule', '-')} | "
                     + " | ".join(f"{weights[s]:.3f}" if s in weights else "-" for s in sites) + " |")
    return "\n".join(lines) + "\n"


def completeness_table(rows: List[dict]) -> str:
    """Markdown: estimated vs counted completeness per site, one line per suite / seed / job."""
    def cell(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.2f}"

    groups: Dict[tuple, List[dict]] = {}
    for row in rows:
        groups.setdefault((row["suite"], row["seed"], row["job"]), []).append(row)
    sites = sorted({r["site"] for r in rows})
    lines = ["| suite | seed | job | estimated at round | " + " | ".join(f"{s} est. / true" for s in sites) + " |",
             "|---|---|---|---|" + "---|" * len(sites)]
    for (suite, seed, job), group in groups.items():
        by_site = {r["site"]: r for r in group}
        lines.append(f"| {suite} | {seed} | {job} | {cell(group[0]['round']) if group[0]['round'] is None else group[0]['round']} | "
                     + " | ".join(f"{cell(by_site[s]['estimate'])} / {cell(by_site[s]['true'])}" if s in by_site else "-"
                                  for s in sites) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedpartial_tools.bench.fedia_report",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="bench output folder")
    parser.add_argument("--weights-of", default=None, metavar="SUITE/SEED/JOB",
                        help="also print the per-round weights of this run (relative to --out)")
    args = parser.parse_args(argv)
    print(seed_table(args.out))
    print(blank_rounds_table(args.out))
    print(completeness_table(completeness_rows(args.out)))
    if args.weights_of:
        print(weights_table(os.path.join(args.out, args.weights_of)))


if __name__ == "__main__":
    main()
