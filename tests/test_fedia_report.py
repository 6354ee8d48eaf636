"""fedpartial_tools.bench.fedia_report on a hand-made bench folder."""
from __future__ import annotations

import json

from fedpartial_tools.bench import fedia_report


def _val(share):
    return {"tp": 3 if share else 0, "fp": 1 if share else 0, "fn": 2, "n_images": 4, "predicted_lesion_share": share}


def test_blank_rounds_completeness_and_weights(tmp_path):
    seed = tmp_path / "ms-x-m2" / "seed0"
    (seed / "sites").mkdir(parents=True)
    (seed / "sites" / "split_summary.json").write_text(json.dumps({"per_site": {
        "site-1": {"lesions_kept": 1, "lesions_total": 4}, "site-2": {"lesions_kept": 3, "lesions_total": 4}}}))
    (seed / "fedia_lesions").mkdir()
    rounds = [  # round 0: no lesion predicted anywhere, not ready; round 1: ready, estimates 0.3 / 0.6
        {"round": 0, "sites": {"site-1": {"val": _val(0.0)}, "site-2": {"val": _val(0.0)}},
         "server": {"rule": "fedavg", "weights": {"site-1": 0.5, "site-2": 0.5},
                    "completeness": {"site-1": 1.0, "site-2": 1.0}, "completeness_ready": {"site-1": 0, "site-2": 0}}},
        {"round": 1, "sites": {"site-1": {"val": _val(0.5)}, "site-2": {"val": _val(0.0)}},
         "server": {"rule": "completeness_aware", "weights": {"site-1": 0.4, "site-2": 0.6},
                    "completeness": {"site-1": 0.3, "site-2": 0.6}, "completeness_ready": {"site-1": 1, "site-2": 1}}}]
    (seed / "fedia_lesions" / "metrics.json").write_text(json.dumps({"rounds": rounds}))
    assert fedia_report.blank_rounds(str(seed / "fedia_lesions")) == (1, 2)
    assert "| ms-x-m2 | fedia_lesions | seed0: 1/2 |" in fedia_report.blank_rounds_table(str(tmp_path))
    rows = fedia_report.completeness_rows(str(tmp_path))
    assert [(r["site"], r["estimate"], r["true"], r["round"]) for r in rows] == [
        ("site-1", 0.3, 0.25, 1), ("site-2", 0.6, 0.75, 1)]
    assert "| ms-x-m2 | seed0 | fedia_lesions | 1 | 0.30 / 0.25 | 0.60 / 0.75 |" in fedia_report.completeness_table(rows)
    table = fedia_report.weights_table(str(seed / "fedia_lesions"))
    assert "| 0 | fedavg | 0.500 | 0.500 |" in table and "| 1 | completeness_aware | 0.400 | 0.600 |" in table
