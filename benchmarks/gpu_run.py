"""The GPU run: every CUDA path of OffloadAdamW checked and measured in one command, under 8 minutes.

    bash benchmarks/gpu_run.sh OUTDIR                    # on the GPU machine (its own python3, PYTHONPATH=src)
    bash benchmarks/gpu_run.sh OUTDIR --cpu-rehearsal    # here: every section that needs no CUDA, small sizes
    python3 benchmarks/gpu_run.py --plot OUTDIR/gpu_run.json   # the PNGs again, from the JSON (needs matplotlib)

Contract:

* **Sections of rows, each row time-limited, run by value.** The rows run phase by phase
  (``gpu_run_rows.Phase``), so that a budget cut loses what is worth least: the gpu tests, the ~1B rows the
  targets read (freed gradients: (d), (e)), the on-device fp32-master reference (a), the other ~1B rows,
  parity without torch.compile and FSDP2, PCIe and the host, the compiled parity row last. On CUDA consecutive
  rows of one section run in one child process (one per row where a clean process matters: the ~1B model's
  peak memory); without CUDA consecutive rows share one child. The children get ``NCCL_SOCKET_IFNAME=lo`` and
  ``NCCL_IB_DISABLE=1`` unless the environment sets them (NCCL at world size 1 in a VM may otherwise pick a
  virtual NIC). The driver kills a child's process group when its row passes the row's limit or the run's
  budget, records the row as ``timeout`` (with the figures it reported before, under ``partial``) and starts a
  new child for the rows after it, so one hang loses one row; a child that dies loses only the row it was in
  (``error: child exited with N``). A row that raises is ``error`` (the traceback is in the JSON), one whose
  check fails is ``failed``; a row that needs CUDA on a machine without it is ``skipped: no CUDA``; one that
  would start after the budget is ``skipped: time budget``. ``GPU_RUN_SELFTEST=1`` adds a first section whose
  rows hang and crash on purpose (the tests use it).
* **Outputs in OUTDIR**: ``gpu_run.json`` (``schema_version``, the machine, the sizes, every row's
  status, seconds and figures, the targets; rewritten after every row, so a killed run keeps what it
  measured), ``gpu_run.log`` (stdout, from gpu_run.sh), ``logs/*.log`` (the children's output),
  ``traces/llama-d.json.gz`` (the profiler trace of two freed-gradient steps), PNGs (``--plot``; skipped with a note
  when matplotlib is missing), and a summary table on stdout. Exit status 0 when no row failed, errored or timed out; 1 otherwise.
* **Sections.** ``pcie``: host-to-device, device-to-host and both at once from pinned memory, as one large copy
  (the peak) and as the ~1B model's tensors one by one (what the pipeline issues). ``gpu_tests``: ``pytest -m
  gpu tests``. ``parity``: small Llamas trained with OffloadAdamW against ``torch.optim.AdamW(fused=True)`` as
  the README defines parity (bitwise: float32 parameters; for bf16, fused AdamW on float32 copies then
  round-to-nearest), with several buckets, accumulation 4, gradients kept and freed, clipping, fp16 autocast
  with OffloadGradScaler, amsgrad, ``torch.compile(model)`` and FSDP2 at world size 1 (NCCL; gloo on the CPU); a
  checkpoint (``offload_adamw.checkpoint``) saved after device steps and loaded into a fresh model, optimizer
  and scheduler, whose continuation must be bitwise the uninterrupted run's, with the RNG states (the device's
  too) restored; then FSDP2 at world size 1 with freed gradients and the host updates during backward
  (``update_in_backward``), float32 without clipping and bf16 with ``max_grad_norm`` and accumulation 4
  (``set_requires_gradient_sync(False)``), against a model sharded alike whose shards fused AdamW updates on
  float32 host copies, clipped by torch's ``clip_grad_norm_`` on that model; those two rows also report each
  step's timeline overlap after the first and the buckets (one per FSDP group). ``llama``: a bf16 Llama of about
  1B parameters, step time and peak device memory of (a) torch AdamW(fused) with float32 parameters and moments
  under bf16 autocast, (b) torch AdamW(fused) on bf16 parameters, (c) OffloadAdamW with device gradients kept,
  (d) freed, (e) freed with the host updates started during backward (update_in_backward), (f) the same with
  max_grad_norm, (g) the update streamed (``update_on="stream"``: state in pinned host memory, updated on the GPU
  through a ring of device buffers), (h) a mixed placement (half the decoder layers resident on the GPU, half
  streamed, embeddings and head on the host), whose rows also time ``step()`` alone (the PCIe bytes a step moves
  over that time) and hold two more steps bitwise to torch AdamW(fused=True) on float32 masters where each group
  runs (``gpu_run_rows.LLAMA_VARIANTS``, docs/placement.md); each row also times a forward+backward-only step in the same
  process (the exposed optimizer time is the difference) and, for (c)-(f), profiles two steps and reads from the
  device timeline how much of the gradient copies ran before backward ended and the copies' own bandwidth (the
  pipeline's CUDA events are internal and untimed, so they are not read). ``host``: the in-place triad and the
  host step over 1 to 16 threads (the default kernel through OffloadAdamW, torch fused float32, the naive path
  with preallocated float32 gradients).
* **The CPU rehearsal** runs the parity, llama and host sections with the CPU as device and small sizes
  (the pipeline's CPU mode, gloo for FSDP2); ``--quick`` shrinks them further for the test suite.
  ``--only SECTIONS`` reruns some sections (the others are ``skipped: not selected``).
* **Modules**: this one is the driver (the children, the limits, the JSON); ``gpu_run_rows.py`` holds the sizes,
  the table of sections and rows and the function each row runs; ``gpu_run_report.py`` the targets, the summary
  table and the PNGs; the trace analysis is :mod:`offload_adamw.benchmarking.device_trace`.
* Of the library only public APIs are used (OffloadAdamW and its options, clip_grad_norm_,
  OffloadGradScaler, master_param, gradient, last_grad_norm, last_step_timeline, is_host_resident,
  measure_host_bandwidth, offload_adamw.checkpoint), besides what the benchmarks share
  (``offload_adamw.benchmarking``: the workload's shapes, the timing loop, bitwise comparison, the machine's CPU,
  the trace analysis) and torch's clipping over bare gradient tensors (``accel.clipping.clip_gradients_``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gpu_run_report import bad_rows, headline, plot, summary_table, targets
from gpu_run_rows import (
    GPU_SIZES,
    QUICK_SIZES,
    REHEARSAL_SIZES,
    Context,
    Phase,
    Row,
    Section,
    Sizes,
    all_sections,
    run_order,
)

SCHEMA_VERSION = 1
ROOT = Path(__file__).resolve().parents[1]


def _emit(events: Path, record: dict) -> None:
    with events.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def child_main(work: list[tuple[str, str]], sizes: Sizes, device: str, outdir: Path, events: Path) -> int:
    """Run ``(section, row)`` items in order, reporting each start and result to ``events``."""
    if any(section != "selftest" for section, _ in work):
        import torch  # imported before the first row starts its clock

        if device == "cuda":
            torch.cuda.set_device(0)

    current: list[tuple[str, str]] = []
    ctx = Context(sizes, device, outdir, partial=lambda figures: _emit(
        events, {"section": current[-1][0], "row": current[-1][1], "event": "partial", "result": figures}))
    rows = {(s.name, r.name): r for s in all_sections(sizes) for r in s.rows}
    for section_name, name in work:
        current.append((section_name, name))
        _emit(events, {"section": section_name, "row": name, "event": "start"})
        started = time.perf_counter()
        try:
            row = rows[section_name, name]
            if row.run is None:
                raise RuntimeError(f"{section_name}/{name} is a command: the driver runs it, not a child")
            result = row.run(ctx, row)
        except Exception:  # recorded; the next row still runs
            result = {"status": "error", "error": traceback.format_exc()}
        result["seconds"] = time.perf_counter() - started
        _emit(events, {"section": section_name, "row": name, "event": "done", "result": result})
        gc.collect()
    if "mesh" in ctx.cache:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return 0



# ============================================================================ driver side


def child_batches(order: list[tuple[Section, Row]], *, cuda: bool) -> list[tuple[str, list[tuple[str, Row]]]]:
    """The children the run starts, in ``order``, as (kind, rows): a command's row alone (kind ``command``);
    on CUDA one child per row of a fresh-process section and one for each run of consecutive rows of another
    section (kind: the section); without CUDA one child for each run of consecutive rows (kind ``cpu``). The
    rows of Phase.LAST start a child of their own on the CPU too, as they do on CUDA: what the rows before
    leave in a process (a process group, compiled code) is not what the GPU run gives them."""
    batches: list[tuple[str, list[tuple[str, Row]]]] = []
    joinable = False  # whether the last batch takes the next row of the same kind
    last_phase: Phase | None = None
    for section, row in order:
        item = (section.name, row)
        if section.command:
            batches.append(("command", [item]))
            joinable = False
            continue
        kind = section.name if cuda else "cpu"
        if joinable and batches[-1][0] == kind and (row.phase is Phase.LAST) == (last_phase is Phase.LAST):
            batches[-1][1].append(item)
        else:
            batches.append((kind, [item]))
        joinable = not (cuda and section.fresh_process)
        last_phase = row.phase
    return batches


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=10)


def child_env() -> dict:
    env = dict(os.environ)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # world size 1 on one machine: loopback, no InfiniBand probing (a VM's virtual NIC can hang NCCL's start)
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_IB_DISABLE", "1")
    return env


class Driver:
    """Runs the sections, enforces the limits, writes the JSON after every row."""

    def __init__(self, outdir: Path, sizes: Sizes, *, cuda: bool, mode: str, sizes_name: str, only: set | None) -> None:
        self.outdir = outdir
        self.sizes = sizes
        self.cuda = cuda
        self.device = "cuda" if cuda else "cpu"
        self.only = only
        self.started = time.monotonic()
        self.deadline = self.started + sizes.budget_s
        (outdir / "logs").mkdir(parents=True, exist_ok=True)
        self.result: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "mode": mode,
            "sizes_preset": sizes_name,
            "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(cuda),
            "sizes": asdict(sizes),
            "sections": {},
        }

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.result["elapsed_s"] = time.monotonic() - self.started
        self.result["targets"] = targets(self.result)
        path = self.outdir / "gpu_run.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        os.replace(tmp, path)

    def record(self, section: str, row: str, result: dict) -> None:
        self.result["sections"][section]["rows"][row] = result
        status = result.get("status", "?")
        print(f"[{time.monotonic() - self.started:6.1f} s] {section}/{row}: {status}"
              f" ({result.get('seconds', 0.0):.1f} s) {headline(section, row, result)}", flush=True)
        self.save()

    def run(self) -> dict:
        """Every row, phase by phase (run_order); rows that share a child are started together (child_batches)."""
        table = all_sections(self.sizes)
        pending: list[tuple[Section, Row]] = []
        for section in table:  # the JSON in the table's order
            rows = self.result["sections"].setdefault(section.name, {"rows": {}})["rows"]
            for row in section.rows:
                rows[row.name] = {"status": "not run"}
        for section, row in run_order(table):
            rows = self.result["sections"][section.name]["rows"]
            if self.only is not None and section.name not in self.only:
                rows[row.name] = {"status": "skipped: not selected (--only)"}
            elif row.needs_cuda and not self.cuda:
                rows[row.name] = {"status": "skipped: no CUDA"}
            elif row.needs_compile and not self.sizes.compile_rows:
                rows[row.name] = {"status": "skipped: compile rows off (--quick)"}
            else:
                pending.append((section, row))
        batches = child_batches(pending, cuda=self.cuda)
        self.save()
        for kind, items in batches:
            if kind == "command":
                self.run_pytest(*items[0])
            else:
                self.run_rows(kind if kind != "cpu" else "cpu-rehearsal", items)
        self.result["finished_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.save()
        return self.result

    def run_rows(self, log_name: str, items: list[tuple[str, Row]]) -> None:
        """Rows in one child; on a timeout or a crash, the rows after it in a new child."""
        log_path = self.outdir / "logs" / f"{log_name}.log"
        while items:
            if self.left() <= 0:
                for section, row in items:
                    self.record(section, row.name, {"status": "skipped: time budget"})
                return
            events = self.outdir / "logs" / f".{log_name}.events"
            events.unlink(missing_ok=True)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child",
                   json.dumps([[section, row.name] for section, row in items]),
                   "--sizes-json", json.dumps(asdict(self.sizes)), "--device", self.device, str(self.outdir)]
            log = log_path.open("a")
            log.write(f"\n=== {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')} "
                      f"rows {[f'{s}/{r.name}' for s, r in items]}\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env={**child_env(), "GPU_RUN_EVENTS": str(events)}, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            spawned = last_event = time.monotonic()
            seen = 0
            current: tuple[str, Row, float] | None = None
            done: set[tuple[str, str]] = set()
            partial: dict[tuple[str, str], dict] = {}
            by_key = {(section, row.name): row for section, row in items}
            killed: tuple[str, Row] | None = None
            killed_why = ""
            while True:
                finished = proc.poll() is not None
                lines = events.read_text().splitlines() if events.exists() else []
                for line in lines[seen:]:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        break  # a line being written: read it next time
                    seen += 1
                    last_event = time.monotonic()
                    key = (rec["section"], rec["row"])
                    if rec["event"] == "partial":
                        partial[key] = rec["result"]
                    elif rec["event"] == "start":
                        current = (key[0], by_key[key], time.monotonic())
                    else:
                        done.add(key)
                        current = None
                        self.record(key[0], key[1], rec["result"])
                if finished:
                    break
                now = time.monotonic()
                if current is None:
                    waiting = [(s, r) for s, r in items if (s, r.name) not in done]
                    if now - last_event > self.sizes.startup_limit_s:
                        if not waiting:  # every row reported: the child hangs on its way out, nothing is lost
                            _kill_group(proc)
                            break
                        killed = waiting[0]
                        killed_why = f"timeout: no row started within {self.sizes.startup_limit_s:.0f} s"
                    elif now > self.deadline + 15:
                        killed_why = "time budget"
                else:
                    section, row, since = current
                    limit = min(row.limit_s, max(5.0, self.deadline + 15 - since))
                    if now - since > limit:
                        killed, killed_why = (section, row), f"timeout: over {limit:.0f} s"
                if killed_why:
                    _kill_group(proc)
                    break
                time.sleep(0.2)
            log.close()
            events.unlink(missing_ok=True)
            remaining = [(s, r) for s, r in items if (s, r.name) not in done]
            lost: tuple[str, Row] | None = None
            if killed is not None:
                lost, status = killed, killed_why
            elif killed_why:  # the budget ran out between rows
                for section, row in remaining:
                    self.record(section, row.name, {"status": "skipped: time budget"})
                return
            elif remaining:  # the child died inside a row, or before its first
                lost = (current[0], current[1]) if current is not None else remaining[0]
                where = "" if current is not None else " before the row started"
                status = f"error: child exited with {proc.returncode}{where}"
            if lost is not None:
                record = {"status": status, "seconds": time.monotonic() - spawned, "log_tail": _tail(log_path)}
                if (lost[0], lost[1].name) in partial:
                    record["partial"] = partial[lost[0], lost[1].name]  # what the row measured before it was lost
                self.record(lost[0], lost[1].name, record)
                remaining = [(s, r) for s, r in remaining if (s, r.name) != (lost[0], lost[1].name)]
            items = remaining

    def run_pytest(self, section: str, row: Row) -> None:
        if self.left() <= 0:
            self.record(section, row.name, {"status": "skipped: time budget"})
            return
        limit = min(row.limit_s, max(5.0, self.left()))
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider"]
        log_path = self.outdir / "logs" / f"{section}.log"
        started = time.monotonic()
        with log_path.open("a") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = None
        tail = _tail(log_path)
        counts = parse_pytest_summary(tail)
        if rc is None:
            status = f"timeout: over {limit:.0f} s"
        elif rc == 0 and counts.get("failed", 0) == 0 and counts.get("errors", 0) == 0:
            status = "ok"
        else:
            status = "failed"
        self.record(section, row.name, {"status": status, "returncode": rc, "counts": counts,
                                             "seconds": time.monotonic() - started, "command": " ".join(cmd[1:]),
                                             "log_tail": tail if status != "ok" else tail[-600:]})


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def parse_pytest_summary(text: str) -> dict[str, int]:
    """'3 passed, 2 skipped, 1 failed in 4.2s' -> {'passed': 3, 'skipped': 2, 'failed': 1}."""
    import re

    counts: dict[str, int] = {}
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)", ln)]
    if lines:
        for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?)", lines[-1]):
            counts["errors" if word.startswith("error") else word] = int(number)
    return counts


def machine_info(cuda: bool) -> dict:
    import torch

    from offload_adamw.benchmarking.machine import cpu_model

    info: dict[str, Any] = {
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    model = cpu_model()
    if model is not None:
        info["cpu"] = model
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["host_memory_bytes"] = int(line.split()[1]) * 1024
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_bytes"] = props.total_memory
        info["gpu_count"] = torch.cuda.device_count()
        with contextlib.suppress(Exception):
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.max,pcie.link.width.max",
                                  "--format=csv,noheader"], check=False, capture_output=True, text=True, timeout=10)
            info["nvidia_smi"] = smi.stdout.strip()
    from importlib import metadata

    for package in ("transformers", "numpy", "matplotlib"):
        with contextlib.suppress(Exception):
            info[package] = metadata.version(package)
    with contextlib.suppress(Exception):
        git = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=10)
        if git.returncode == 0:
            info["commit"] = git.stdout.strip()
    return info


# ------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, nargs="?", help="where the JSON, logs, traces and PNGs go")
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="run what needs no CUDA with the CPU as device and small sizes; CUDA rows are skipped")
    parser.add_argument("--quick", action="store_true", help="with --cpu-rehearsal: tiny sizes, no compile rows (tests)")
    parser.add_argument("--only", help="comma-separated sections to run (pcie, gpu_tests, parity, llama, host)")
    parser.add_argument("--budget-s", type=float, help="override the run's time budget in seconds")
    parser.add_argument("--plot", type=Path, metavar="GPU_RUN_JSON", help="only draw the PNGs from a JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--sizes-json", help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.plot is not None:
        for note in plot(args.plot):
            print(f"plot: {note}")
        return 0
    if args.outdir is None:
        parser.error("OUTDIR is required")
    if args.child:
        raw = json.loads(args.sizes_json)
        raw["host_threads"] = tuple(raw["host_threads"])
        work = [tuple(item) for item in json.loads(args.child)]
        return child_main(work, Sizes(**raw), args.device, args.outdir, Path(os.environ["GPU_RUN_EVENTS"]))

    only = None
    if args.only:
        only = {s.strip() for s in args.only.split(",") if s.strip()}
        names = [s.name for s in all_sections(GPU_SIZES)]
        unknown = only - set(names)
        if unknown:
            parser.error(f"unknown section(s) {sorted(unknown)}; choose from {names}")
    import torch

    cuda = torch.cuda.is_available() and not args.cpu_rehearsal
    if not cuda and not args.cpu_rehearsal:
        print("gpu_run: no CUDA device; use --cpu-rehearsal to rehearse the run on the CPU", file=sys.stderr)
        return 2
    if args.quick and not args.cpu_rehearsal:
        parser.error("--quick is for --cpu-rehearsal (the GPU run uses its full sizes)")
    sizes, name = (GPU_SIZES, "gpu") if cuda else (QUICK_SIZES, "quick") if args.quick else (REHEARSAL_SIZES, "rehearsal")
    if args.budget_s is not None:
        if not args.budget_s > 0:
            parser.error("--budget-s must be positive")
        sizes = replace(sizes, budget_s=args.budget_s)
    args.outdir.mkdir(parents=True, exist_ok=True)
    driver = Driver(args.outdir, sizes, cuda=cuda, mode="gpu" if cuda else "cpu-rehearsal", sizes_name=name, only=only)
    result = driver.run()
    print()
    print(summary_table(result))
    bad = bad_rows(result)
    print(f"\nJSON: {args.outdir / 'gpu_run.json'}; logs: {args.outdir / 'logs'}")
    if bad:
        print(f"rows not ok: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

