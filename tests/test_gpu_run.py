"""benchmarks/gpu_run.py, the prepared GPU run: rehearsed on the CPU so that it cannot rot unnoticed.

The GPU machine is lent rarely and briefly; these tests make sure that what it will run still runs
(the CPU rehearsal), that a hanging or crashing row loses only itself (the driver's limits), and that
the trace analysis the overlap figures come from reads a Kineto trace as expected.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_run.sh"


sys.path.insert(0, str(ROOT / "benchmarks"))  # the GPU run's modules import each other as siblings, as when run
import gpu_run  # noqa: E402
import gpu_run_report  # noqa: E402
import gpu_run_rows  # noqa: E402

from offload_adamw.benchmarking.device_trace import overlap_from_trace  # noqa: E402


def _run(outdir: Path, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), str(outdir), *args], check=False, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def _every_row_has_a_status(result: dict) -> None:
    sizes = gpu_run_rows.Sizes(**{**result["sizes"], "host_threads": tuple(result["sizes"]["host_threads"])})
    for section in gpu_run_rows.all_sections(sizes):
        rows = result["sections"][section.name]["rows"]
        assert list(rows) == [r.name for r in section.rows], f"{section.name}: rows missing or out of order"
        for name, row in rows.items():
            assert row["status"] != "not run", f"{section.name}/{name} never ran and was not skipped"


@pytest.mark.slow  # the GPU run driver waits out a row time limit (5 s)
def test_a_hanging_row_and_a_crashing_row_lose_only_themselves(tmp_path: Path) -> None:
    """The driver kills a row past its limit and a child that dies, and runs the rows after each."""
    done = _run(tmp_path, "--cpu-rehearsal", "--quick", "--only", "selftest",
                env={gpu_run_rows.SELFTEST_ENV: "1", "GPU_RUN_SELFTEST_LIMIT": "2"}, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr  # the two lost rows are reported
    result = json.loads((tmp_path / "gpu_run.json").read_text())
    assert result["schema_version"] == gpu_run.SCHEMA_VERSION and result["mode"] == "cpu-rehearsal"
    rows = result["sections"]["selftest"]["rows"]
    assert rows["hangs"]["status"].startswith("timeout"), rows["hangs"]
    assert rows["hangs"]["partial"] == {"measured_before_the_hang": 1}  # what it reported before hanging is kept
    assert rows["crashes"]["status"] == "error: child exited with 3", rows["crashes"]
    assert rows["after"]["status"] == "ok"
    assert all(r["status"] == "skipped: not selected (--only)" for r in result["sections"]["parity"]["rows"].values())
    assert result["sections"]["pcie"]["rows"]["pinned-peak"]["status"] == "skipped: not selected (--only)"
    _every_row_has_a_status(result)
    assert "rows not ok: selftest/hangs, selftest/crashes" in done.stdout
    assert (tmp_path / "gpu_run.log").read_text().count("selftest/after: ok") == 1


@pytest.mark.slow  # 20 s: every section of the GPU run, rehearsed on the CPU
def test_quick_cpu_rehearsal_runs_every_section(tmp_path: Path) -> None:
    """Every section has a status; what runs on the CPU runs and finds parity; the CUDA rows say why not."""
    done = _run(tmp_path, "--cpu-rehearsal", "--quick")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "gpu_run.json").read_text())
    assert result["schema_version"] == gpu_run.SCHEMA_VERSION
    _every_row_has_a_status(result)
    sections = result["sections"]
    assert {r["status"] for r in sections["pcie"]["rows"].values()} == {"skipped: no CUDA"}
    assert sections["gpu_tests"]["rows"]["pytest -m gpu"]["status"] == "skipped: no CUDA"
    resumed = sections["parity"]["rows"]["bf16-freed-checkpoint-resume"]  # a checkpoint after the device's steps
    assert resumed["status"] == "ok" and resumed["continuation_bitwise"] and resumed["rng_restored"], resumed
    for name, row in sections["parity"]["rows"].items():
        if name == "bf16-freed-checkpoint-resume":
            continue
        if row["status"] == "ok":
            assert row["bitwise"] and row["first_step_gradients_bitwise"], name
        else:
            assert row["status"].startswith("skipped: compile rows off"), (name, row)
    # FSDP2 with the host updates during backward: one bucket per FSDP group, a timeline for every step after the first
    for name in gpu_run_rows.FSDP_OVERLAP_CASES:
        row = sections["parity"]["rows"][name]
        assert row["status"] == "ok" and row["buckets"] == row["fsdp_groups"] == 3, (name, row)
        overlaps = row["timeline_overlap_after_first_step"]
        assert len(overlaps) == result["sizes"]["parity_steps"] - 1 and all(0.0 <= o <= 1.0 for o in overlaps), row
        if row["max_grad_norm"] is not None:  # clipped: every update waits for the global norm, after backward
            assert row["clip_norms_bitwise"] and overlaps == [0.0] * len(overlaps), row
    assert {k for k, r in sections["llama"]["rows"].items() if r["status"] == "ok"} == set(gpu_run_rows.LLAMA_VARIANTS)
    for key, variant in gpu_run_rows.LLAMA_VARIANTS.items():  # the placements: parity, PCIe bytes, device buffers
        if variant.placement is not None:
            row = sections["llama"]["rows"][key]
            assert row["parity"]["bitwise"] and row["parity"]["steps"] == variant.parity_steps, (key, row["parity"])
            assert row["transfer_bytes_per_step"] > 0 and row["device_buffer_bytes"] > 0 and row["pcie_GBps_achieved"] > 0
    assert sections["llama"]["rows"]["h"]["placements"] == ["stream", "host"]  # --quick: one layer, none resident
    # (e) starts the host updates in backward: its timeline says how much of them ran before backward ended
    assert 0.0 <= sections["llama"]["rows"]["e"]["timeline_overlap"] <= 1.0
    overlap = sections["llama"]["rows"]["d"]["overlap"]  # the trace was exported and its ranges found; no device
    assert not overlap["measured"] and overlap["why"] == "no kernels correlated with the fwd_bwd range", overlap
    assert set(sections["host"]["rows"]["threads-1"]["cases"]) == {
        "ours-bf16 (default kernel)", "torch-fused-fp32", "naive-bf16-preallocated"}
    assert {t["target"].split(":")[0] for t in result["targets"]} >= {"pcie h2d", "pcie d2h"}
    assert all(t["met"] is None for t in result["targets"])  # CPU stand-ins judge no target
    assert "targets (reported against, not tuned to):" in done.stdout
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    if importlib.util.find_spec("matplotlib") is not None:
        assert pngs == ["gpu_run_host_threads.png", "gpu_run_llama.png"]
    else:
        assert "matplotlib is not installed" in done.stdout


def test_without_cuda_the_gpu_run_refuses_and_says_how_to_rehearse(tmp_path: Path) -> None:
    if gpu_run_cuda_available():
        pytest.skip("CUDA is available")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_run.py"), str(tmp_path)],
                          check=False, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2 and "--cpu-rehearsal" in done.stderr



def test_usage_errors_exit_2(tmp_path: Path) -> None:
    bad = _run(tmp_path, "--cpu-rehearsal", "--only", "nonsense", timeout=120)
    assert bad.returncode == 2 and "unknown section(s) ['nonsense']" in bad.stdout + bad.stderr
    assert not (tmp_path / "gpu_run.json").exists()
    no_outdir = subprocess.run(["bash", str(SCRIPT)], check=False, capture_output=True, text=True)
    assert no_outdir.returncode == 2 and "usage:" in no_outdir.stderr


def gpu_run_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------------ trace analysis


def _trace() -> dict:
    """Two steps as the profiler exports them: runtime launches (CPU) correlated with device events."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "fwd_bwd#0", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "step#0", "ts": 100, "dur": 60},
        {"ph": "X", "cat": "user_annotation", "name": "fwd_bwd#1", "ts": 160, "dur": 100},
    ]
    launches = [  # (correlation, launch ts, category, name, device start, device duration, stream, bytes)
        (1, 5, "kernel", "forward_gemm", 10, 40, 7, None),
        (2, 50, "kernel", "backward_gemm", 50, 50, 7, None),  # backward ends at 100
        (3, 60, "gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 70, 20, 20, 2000),  # entirely before
        (4, 95, "gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 90, 30, 20, 3000),  # 10 before, 20 after
        (5, 120, "gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 130, 40, 21, 4000),  # 150..170 over the kernel
        (6, 165, "kernel", "next_forward", 150, 60, 7, None),
    ]
    for corr, launch, cat, name, start, dur, stream, nbytes in launches:
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launch, "dur": 1,
                       "args": {"correlation": corr}})
        args = {"correlation": corr, "stream": stream, "device": 0}
        if nbytes is not None:
            args["bytes"] = nbytes
        events.append({"ph": "X", "cat": cat, "name": name, "ts": start, "dur": dur, "args": args})
    events.append({"ph": "i", "cat": "instant", "name": "ignored", "ts": 3})
    return {"traceEvents": events}


def test_overlap_from_a_kineto_trace() -> None:
    out = overlap_from_trace(_trace())
    assert out["measured"] and out["backward_end_us"] == 100 and out["compute_streams"] == [7]
    assert out["d2h_copies"] == 2 and out["d2h_bytes"] == 5000 and out["d2h_busy_us"] == 50
    assert out["d2h_busy_before_backward_end_us"] == 30
    assert out["d2h_overlap_fraction"] == pytest.approx(0.6)
    assert out["d2h_tail_after_backward_us"] == 20
    assert out["d2h_GBps_while_busy"] == pytest.approx(5000 / 50e-6 / 1e9)
    assert out["h2d_copies"] == 1 and out["h2d_bytes"] == 4000 and out["h2d_streams"] == [21]
    assert out["h2d_overlapped_with_kernels_us"] == 20


def test_overlap_says_why_when_the_trace_has_no_ranges() -> None:
    assert overlap_from_trace({"traceEvents": []}) == {
        "measured": False, "why": "no fwd_bwd#0/step#0 ranges in the trace"}
    only_ranges = {"traceEvents": _trace()["traceEvents"][:3]}
    assert overlap_from_trace(only_ranges)["why"] == "no kernels correlated with the fwd_bwd range"


def test_targets_and_pytest_summary() -> None:
    result = {"sections": {
        "llama": {"rows": {
            "a": {"status": "ok", "step_s_median": 1.0},
            "d": {"status": "ok", "step_s_median": 1.3, "parameters": 1000, "optimizer_share_bytes": 10,
                  "overlap": {"d2h_GBps_while_busy": 40.0, "h2d_GBps_while_busy": 30.0}},
            "e": {"status": "ok", "step_s_median": 1.08, "parameters": 1000, "optimizer_share_bytes": 200,
                  "timeline_overlap": 0.8},
            "f": {"status": "failed", "step_s_median": 1.25},  # a failed row's figures are still read
        }},
        "pcie": {"rows": {
            "pinned-peak": {"status": "ok", "h2d_GBps": 50.0, "d2h_GBps": 50.0},
            "per-tensor-1b-shapes": {"status": "ok", "h2d_GBps": 45.0, "d2h_GBps": 40.0},
        }},
    }}
    got = {t["target"]: (t["value"], t["met"]) for t in gpu_run_report.targets(result)}
    assert got["llama (e) freed, updates in backward, no clipping: step time / (a) fp32-master torch AdamW"] == (
        pytest.approx(1.08), True)
    assert got["llama (f) the same with max_grad_norm: step time / (a) fp32-master torch AdamW"] == (
        pytest.approx(1.25), False)
    assert got["llama (d) optimizer share of peak device memory, GiB"][1] is True  # 10 B <= 5% of 2000 B
    assert got["llama (e) optimizer share of peak device memory, GiB"][1] is False  # 200 B > 100 B
    hidden = "llama (e) share of the host update hidden behind backward (the optimizer's timeline, host clock)"
    assert got[hidden] == (0.8, True)
    assert got["pcie h2d: per-tensor copies of the 1B shapes / pinned peak"] == (pytest.approx(0.9), True)
    assert got["pcie d2h: per-tensor copies of the 1B shapes / pinned peak"] == (pytest.approx(0.8), False)  # < 0.85
    assert got["pcie h2d: the pipeline's own copies in (d) (profiler, while busy) / pinned peak"][1] is False
    assert all(met is None for _, met in (got[k] for k in got)) is False
    assert all(t["met"] is None for t in gpu_run_report.targets({"sections": {}}))
    assert gpu_run.parse_pytest_summary("....\n8 passed, 3 skipped, 1 error in 4.20s\n") == {
        "passed": 8, "skipped": 3, "errors": 1}
    assert gpu_run.parse_pytest_summary("no tests ran") == {}


def _gpu_like_result() -> dict:
    """A result shaped as the GPU run writes it, so the CUDA-only report paths run here too."""
    memory = {"peak_allocated_bytes": 30 * 2**30, "peak_reserved_bytes": 32 * 2**30}
    fb_memory = {"peak_allocated_bytes": 20 * 2**30, "peak_reserved_bytes": 22 * 2**30}
    overlap = {"measured": True, "d2h_overlap_fraction": 0.9, "d2h_tail_after_backward_us": 1500.0,
               "d2h_GBps_while_busy": 45.0, "h2d_GBps_while_busy": 48.0}

    def llama(step_s: float, share: int) -> dict:
        return {"status": "ok", "parameters": 1_003_000_000, "tokens_per_step": 4096, "step_s_median": step_s,
                "forward_backward_s_median": 0.2, "exposed_optimizer_s": step_s - 0.2, "step_memory": memory,
                "forward_backward_memory": fb_memory, "optimizer_share_bytes": share, "overlap": overlap}

    return {
        "schema_version": 1, "mode": "gpu", "sizes_preset": "gpu", "started_utc": "2026-12-01T10:00:00+00:00",
        "elapsed_s": 300.0, "machine": {"gpu": "NVIDIA H200", "cpu": "Xeon", "logical_cpus": 16, "torch": "2.11.0"},
        "sections": {
            "pcie": {"rows": {
                "pinned-peak": {"status": "ok", "h2d_GBps": 55.0, "d2h_GBps": 55.0, "both_GBps": 100.0, "seconds": 3.0},
                "per-tensor-1b-shapes": {"status": "ok", "h2d_GBps": 50.0, "d2h_GBps": 52.0, "both_GBps": 90.0},
            }},
            "gpu_tests": {"rows": {"pytest -m gpu": {"status": "ok", "counts": {"passed": 8, "deselected": 700}}}},
            "parity": {"rows": {"bf16-freed-amsgrad": {
                "status": "ok", "bitwise": True, "first_step_gradients_bitwise": True, "clip_norms_bitwise": None,
                "loss_scales_equal": None, "mismatch_count": 0, "max_abs_param_diff": 0.0},
                "fp32-fsdp2-ws1-freed-inbwd": {
                    "status": "ok", "bitwise": True, "first_step_gradients_bitwise": True, "clip_norms_bitwise": None,
                    "mismatch_count": 0, "max_abs_param_diff": 0.0, "buckets": 3, "fsdp_groups": 3,
                    "timeline_overlap_median": 0.4}}},
            "llama": {"rows": {"a": llama(0.5, 8 * 2**30), "d": llama(0.55, -2**30), "e": {"status": "timeout: over 110 s"}}},
            "host": {"rows": {
                "triad": {"status": "ok", "inplace_triad_gbps": 120.0, "triad_gbps": 90.0, "threads": 16},
                **{f"threads-{n}": {"status": "ok", "threads": n, "elements": 2**27, "cases": {
                    "ours-bf16 (default kernel)": {"ms_per_step": 400 / n, "GBps_at_28B": 9.0 * n},
                    "torch-fused-fp32": {"ms_per_step": 300 / n, "GBps_at_28B": 12.0 * n}}} for n in (1, 2, 4)},
            }},
        },
    }


def test_summary_targets_and_plots_of_a_gpu_result(tmp_path: Path) -> None:
    result = _gpu_like_result()
    result["targets"] = gpu_run_report.targets(result)
    verdicts = {t["target"]: t["met"] for t in result["targets"]}
    assert verdicts["llama (e) freed, updates in backward, no clipping: step time / (a) fp32-master torch AdamW"] is None
    assert verdicts["llama (d) optimizer share of peak device memory, GiB"] is True  # below zero: freed gradients
    table = gpu_run_report.summary_table(result)
    assert "NVIDIA H200" in table and "h2d 55.0 GB/s, d2h 55.0 GB/s, both 100.0 GB/s" in table
    assert "8 passed, 700 deselected" in table and "d2h before end of backward 90%, tail 1.5 ms" in table
    assert "optimizer share 8.00 GiB" in table and "timeout: over 110 s" in table
    assert "buckets=3/3 overlap=0.40" in table
    assert gpu_run_report.bad_rows(result) == ["llama/e"]
    path = tmp_path / "gpu_run.json"
    path.write_text(json.dumps(result))
    notes = gpu_run_report.plot(path)
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in notes[0]
    else:
        assert sorted(p.name for p in tmp_path.glob("*.png")) == [
            "gpu_run_host_threads.png", "gpu_run_llama.png", "gpu_run_pcie.png"]


# ------------------------------------------------------------------------ the order and the children


def test_the_run_takes_its_rows_by_value_and_groups_them_into_children() -> None:
    table = gpu_run_rows.sections(gpu_run_rows.GPU_SIZES)
    order = [(section.name, row.name) for section, row in gpu_run_rows.run_order(table)]
    assert sorted(order) == sorted((s.name, r.name) for s in table for r in s.rows)  # every row once
    assert order[0] == ("gpu_tests", "pytest -m gpu")
    llama = ("d", "e", "f", "g", "h", "a", "b", "c")  # the rows the targets read (and the placements), their reference, the rest
    assert order[1:9] == [("llama", key) for key in llama]
    compiled = [name for name, case in gpu_run_rows.PARITY_CASES.items() if case[6]]
    assert order[-len(compiled):] == [("parity", name) for name in compiled]
    sections_in_order = [name for name, _ in order[9:-len(compiled)]]
    assert sections_in_order == sorted(sections_in_order, key=["parity", "pcie", "host"].index)
    assert {("parity", name) for name in gpu_run_rows.FSDP_OVERLAP_CASES} <= set(order[9:-len(compiled)])

    pending = gpu_run_rows.run_order(table)
    on_gpu = [(kind, [name for _, row in items for name in [row.name]]) for kind, items in
              gpu_run.child_batches(pending, cuda=True)]
    assert on_gpu[0] == ("command", ["pytest -m gpu"])
    assert on_gpu[1:9] == [("llama", [key]) for key in llama]  # a clean process each
    assert [kind for kind, _ in on_gpu[9:]] == ["parity", "pcie", "host", "parity"]  # the compiled row alone, last
    assert on_gpu[-1][1] == compiled
    on_cpu = gpu_run.child_batches([item for item in pending if not item[0].command], cuda=False)
    assert [kind for kind, _ in on_cpu] == ["cpu", "cpu"]  # the rehearsal: one child, and the compiled row's own
    assert [row.name for _, row in on_cpu[1][1]] == compiled


def test_children_talk_nccl_over_loopback_unless_told_otherwise(monkeypatch) -> None:
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_IB_DISABLE", raising=False)
    env = gpu_run.child_env()
    assert env["NCCL_SOCKET_IFNAME"] == "lo" and env["NCCL_IB_DISABLE"] == "1"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("NCCL_IB_DISABLE", "0")
    env = gpu_run.child_env()
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["NCCL_IB_DISABLE"] == "0"


def test_the_checkpoint_row_resumes_bitwise_and_fails_when_the_load_restores_nothing(tmp_path: Path, monkeypatch) -> None:
    """The row passes on the CPU, and a load that leaves the fresh model, optimizer and RNG as they were fails it."""
    import torch

    from offload_adamw import checkpoint

    deterministic = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        _checkpoint_row_passes_and_can_fail(tmp_path, monkeypatch, checkpoint)
    finally:  # the row makes the process deterministic, as parity rows do in their child
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])


def _checkpoint_row_passes_and_can_fail(tmp_path: Path, monkeypatch, checkpoint) -> None:
    sizes = gpu_run_rows.QUICK_SIZES
    row = next(r for s in gpu_run_rows.sections(sizes) for r in s.rows if r.name == "bf16-freed-checkpoint-resume")
    result = row.run(gpu_run_rows.Context(sizes, "cpu", tmp_path), row)
    assert result["status"] == "ok", result
    assert result["continuation_bitwise"] and result["rng_restored"] and result["optimizer_restored"], result
    assert list(tmp_path.iterdir()) == []  # the checkpoint was written to a temporary directory and removed
    monkeypatch.setattr(checkpoint, "load", lambda path, *objects, **kw: checkpoint.LoadReport(path=str(path)))
    broken = row.run(gpu_run_rows.Context(sizes, "cpu", tmp_path), row)
    assert broken["status"] == "failed" and not broken["continuation_bitwise"] and not broken["rng_restored"], broken
