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


def test_step_costs_file_each_collective_under_who_issued_it() -> None:
    from bench.step_costs import _collective, section

    def frame(path: str, name: str) -> dict[str, Any]:
        return {"filename": path, "name": name, "line": 1}

    c10d = frame("/v/site-packages/torch/distributed/distributed_c10d.py", "all_reduce")
    logger = frame("/v/site-packages/torch/distributed/c10d_logger.py", "wrapper")
    mode = frame("/repo/bench/host_reads.py", "__torch_dispatch__")
    ours = frame("/repo/src/ddptrain/train/stepping.py", "rescale_to_global_count")
    fsdp = frame("/v/site-packages/torch/distributed/fsdp/_fully_shard/x.py", "foreach")
    assert _collective({"profiling_name": "gloo:all_reduce", "frames": [mode, c10d, logger,
                        ours]}) == ("ddptrain train/stepping.py:rescale_to_global_count",
                                    "all_reduce")
    scatter = {**c10d, "name": "reduce_scatter_single"}
    assert _collective({"profiling_name": "gloo:all_reduce",
                        "frames": [scatter, logger, fsdp]}) == ("torch", "reduce_scatter_single")
    # DDP's reducer calls from C++: no c10d frame, the backward's frames only
    backward = frame("/v/site-packages/torch/autograd/graph.py", "_engine_run_backward")
    assert _collective({"profiling_name": "gloo:all_reduce", "frames": [backward, ours]}) == (
        "torch", "all_reduce")

    run = {"ranks": 2, "flags": ["--strategy", "fsdp"], "rss_mb": 380.0,
           "collectives": {"torch | all_gather_single": 6, "torch | reduce_scatter_single": 3,
                           "ddptrain train/stepping.py:rescale_to_global_count | all_reduce": 1},
           "reads": {"stepping.py:149 settle": 1}}
    text = section({"machine": {"date_utc": "today", "cpu": "cpu", "cores": 2, "torch": "2"},
                    "suite_s": 60.0, "plain_rss_mb": 360.0,
                    "runs": {"ddp": {**run, "flags": ["--strategy", "ddp"],
                                     "collectives": {"torch | all_reduce": 2}, "reads": {}},
                             "fsdp": run}})
    assert ("| fsdp (`--strategy fsdp`) | 2 | 6 all_gather_single, 3 reduce_scatter_single | "
            "1 at `rescale_to_global_count` (stepping.py) | 1 at `settle` (stepping.py) | 380 |"
            ) in text
    assert "| ddp (`--strategy ddp`) | 2 | 2 all_reduce | none | none | 380 |" in text
    assert "(**+20 MB**, target within 50 MB)" in text
