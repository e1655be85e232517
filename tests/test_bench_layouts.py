"""bench/layouts.py without running it: every layout gets the same global batch, and the
report is built from the figures of its runs."""

from __future__ import annotations

from typing import Any

from bench.layouts import BASELINE, GLOBAL_BATCH, LAYOUTS, section


def test_every_layout_trains_the_same_global_batch() -> None:
    batches = {layout.name: GLOBAL_BATCH // layout.data_parallel for layout in LAYOUTS}
    assert batches == {"ddp": 8, "fsdp": 8, "tp 2": 16, "hsdp 2x2": 4, "fsdp x tp 2x2": 8,
                       "pp 2": 16, "fsdp x pp 2x2": 8}
    for layout in LAYOUTS:
        assert GLOBAL_BATCH % layout.data_parallel == 0, layout
    assert LAYOUTS[2].flags == ["--tp", "2"] and LAYOUTS[0].name == BASELINE


def test_the_report_gives_each_layouts_bytes_and_step_time_against_ddp() -> None:
    def run(share: float, step_s: float) -> dict[str, Any]:
        n = int(4_000_000 * share)
        return {"ranks": 2, "flags": ["--x", "1"], "batch_per_rank": 8, "step_s": step_s,
                "bytes": {"params": n, "grads": n, "optimizer": 2 * n}, "val_loss": 4.0}

    results = {
        "machine": {"date_utc": "today", "cpu": "cpu", "cores": 2, "torch": "2"},
        "suite_s": 60.0, "load_1min": 1.0,
        "runs": {"ddp": run(1.0, 0.4), "tp 2": run(0.5, 0.6)},
    }
    text = section(results)
    assert "## Layouts: ddp, fsdp, tp, hsdp" in text
    assert "| tp 2 (`--x 1`) | 2 | 8 | 1.91 | 1.91 | 3.81 | 0.50 | 600 | 1.50 | 4.000000 |" in text
    assert "load average" not in text  # a quiet machine: no caveat


def test_the_hand_written_comparison_reports_each_layouts_ratio() -> None:
    from bench.layouts_raw import section as raw_section

    results = {
        "machine": {"date_utc": "today", "cpu": "cpu", "cores": 2, "torch": "2"},
        "rounds": 2, "suite_s": 90.0,
        "runs": {"pp 2": {"ddptrain": [0.21, 0.19], "raw": [0.2, 0.2]},
                 "tp 2": {"ddptrain": [0.3, 0.3], "raw": [0.25, 0.25]}},
    }
    text = raw_section(results)
    assert "| pp 2 | 200.0 | 200.0 | 1.00 | 210/200, 190/200 |" in text
    assert "| tp 2 | 300.0 | 250.0 | 1.20 |" in text
