"""One-shot accelerator check of OffloadAdamW's device path (issue #5), under 8 minutes on an H200.

Sections (each one is timed and guarded: a failure is recorded and the next runs):

1. parity   -- a small Llama trained 20 steps with OffloadAdamW (fp32 and bf16
               model, device gradients kept and freed, accumulation 2, clipping in
               the freed runs). The optimizer's gradients of each step (after
               clipping) are also fed to two references: torch.optim.AdamW(fused=True)
               on float32 copies on the HOST (issue #2's parity definition: must be
               bitwise) and on the DEVICE (torch's CUDA kernel: reported as max
               abs / rel difference and the bitwise-equal fraction).
2. memory+time -- a ~1B-parameter bf16 Llama: peak device memory of forward+backward
               alone, then with torch.optim.AdamW(fused=True) on the device, OffloadAdamW
               (gradients kept) and OffloadAdamW(offload_gradients=True); the
               optimizer's share is peak minus the forward+backward peak. Step time
               (forward, backward, step) of each, median of the timed steps.
3. bandwidth -- the host<->device peak of one large page-locked copy each way, and
               the rate the pipeline's own per-tensor copies reach (all gradients
               device->host on its side stream; all parameters host->device), as a
               fraction of that peak; plus bytes moved per training step / step time.

Prints a table and writes JSON (``--json``). ``--cpu-smoke`` runs a reduced version
with the CPU as device (no memory or bandwidth figures) to check the script itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    def tqdm(x, **_):  # type: ignore[no-redef]
        return x

from offload_adamw import OffloadAdamW


@dataclass(frozen=True, kw_only=True)
class CheckConfig:
    """Sizes of the check; --cpu-smoke shrinks all of them."""

    device: str
    """'cuda' or 'cpu' (smoke)."""
    parity_steps: int = 20
    """Optimizer steps per parity run."""
    parity_hidden: int = 256
    """Hidden size of the parity model."""
    big_hidden: int = 2048
    """Hidden size of the timed model (2048 x 20 layers, vocab 32000: about 1.0B parameters)."""
    big_layers: int = 20
    """Layers of the timed model."""
    big_vocab: int = 32000
    """Vocabulary of the timed model."""
    batch: int = 4
    """Sequences per micro-batch of the timed model."""
    seq: int = 512
    """Tokens per sequence of the timed model."""
    warmup: int = 2
    """Untimed steps (state allocation, allocator warm-up)."""
    timed: int = 4
    """Timed steps."""
    peak_copy_bytes: int = 1 << 30
    """Bytes of the single large copy that measures the link's peak."""
    budget_s: float = 450.0
    """Sections that would start after this many seconds are skipped (the limit is 8 minutes)."""


def llama(hidden: int, layers: int, vocab: int, dtype: torch.dtype, device: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(hidden // 128, 2)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
        max_position_embeddings=4096, tie_word_embeddings=False,
    )
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def diff_stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """(max abs diff, max rel diff, fraction of bitwise-equal elements)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.numel() == 0:
        return 0.0, 0.0, 1.0
    d = (a - b).abs()
    rel = d / b.abs().clamp_min(1e-30)
    return float(d.max()), float(rel.max()), float((a == b).double().mean())


# ------------------------------------------------------------------------ parity


def parity_run(cfg: CheckConfig, dtype: torch.dtype, freed: bool) -> dict:
    dev = cfg.device
    torch.manual_seed(0)
    model = llama(cfg.parity_hidden, 2, 512, dtype, dev)
    params = list(model.parameters())
    opt = OffloadAdamW(params, lr=1e-3, weight_decay=0.1, offload_gradients=freed, transfer_pipeline=True)
    host_copies = [nn.Parameter(p.detach().float().cpu().clone()) for p in params]
    dev_copies = [nn.Parameter(p.detach().float().clone()) for p in params]
    ref_host = torch.optim.AdamW(host_copies, lr=1e-3, weight_decay=0.1, fused=True)
    ref_dev = torch.optim.AdamW(dev_copies, lr=1e-3, weight_decay=0.1, fused=True)
    gen = torch.Generator(dev).manual_seed(1)
    host_equal = True
    for step in range(cfg.parity_steps):
        for _ in range(2):
            ids = torch.randint(0, 512, (2, 64), device=dev, generator=gen)
            (model(input_ids=ids, labels=ids).loss / 2).backward()
        if freed:
            opt.clip_grad_norm_(1.0)
        grads = [opt.gradient(p) for p in params]
        for hc, dc, g in zip(host_copies, dev_copies, grads):
            hc.grad = None if g is None else g.detach().float().cpu().clone()
            dc.grad = None if g is None else g.detach().to(dc.device).float().clone()
        opt.step()
        ref_host.step()
        ref_dev.step()
        opt.zero_grad()
        ref_host.zero_grad()
        ref_dev.zero_grad()
    sync(dev)
    worst = (0.0, 0.0, 1.0)
    rounding_ok = True
    for p, hc, dc in zip(params, host_copies, dev_copies):
        master = opt.master_param(p).detach().cpu()
        host_equal &= torch.equal(master, hc.detach())
        host_equal &= torch.equal(opt.state[p]["exp_avg"].cpu(), ref_host.state[hc]["exp_avg"])
        host_equal &= torch.equal(opt.state[p]["exp_avg_sq"].cpu(), ref_host.state[hc]["exp_avg_sq"])
        rounding_ok &= torch.equal(p.detach().cpu(), master.to(p.dtype))
        s = diff_stats(master, dc)
        worst = (max(worst[0], s[0]), max(worst[1], s[1]), min(worst[2], s[2]))
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "offload_gradients": freed,
        "steps": cfg.parity_steps,
        "bitwise_vs_host_fused_adamw": bool(host_equal),
        "param_is_round_of_master": bool(rounding_ok),
        "vs_device_fused_adamw_max_abs": worst[0],
        "vs_device_fused_adamw_max_rel": worst[1],
        "vs_device_fused_adamw_equal_fraction": worst[2],
    }


# ------------------------------------------------------------------ memory, time


def train_steps(model, opt, cfg: CheckConfig, gen, n: int) -> list[float]:
    times = []
    dev = cfg.device
    for _ in range(n):
        ids = torch.randint(0, cfg.big_vocab, (cfg.batch, cfg.seq), device=dev, generator=gen)
        sync(dev)
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        sync(dev)
        times.append(time.perf_counter() - t0)
    return times


def memory_and_time(cfg: CheckConfig) -> dict:
    dev = cfg.device
    torch.manual_seed(0)
    model = llama(cfg.big_hidden, cfg.big_layers, cfg.big_vocab, torch.bfloat16, dev)
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator(dev).manual_seed(2)
    runs = {}
    makers = {
        "forward+backward only": lambda: None,
        "torch.optim.AdamW(fused=True) on device": lambda: torch.optim.AdamW(model.parameters(), fused=True),
        "OffloadAdamW (grads kept)": lambda: OffloadAdamW(model.parameters()),
        "OffloadAdamW(offload_gradients=True)": lambda: OffloadAdamW(model.parameters(), offload_gradients=True),
        # the host step as one compiled loop (bitwise the same; needs a C++ compiler on the GPU machine)
        "OffloadAdamW(offload_grads, compiled_kernel)": lambda: OffloadAdamW(
            model.parameters(), offload_gradients=True, compiled_kernel=True
        ),
    }
    for name, make in tqdm(makers.items(), desc="memory+time", leave=False):
        if dev == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        opt = make()
        train_steps(model, opt, cfg, gen, cfg.warmup)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = train_steps(model, opt, cfg, gen, cfg.timed)
        row = {"step_s_median": statistics.median(times), "step_s_all": times}
        if dev == "cuda":
            row["peak_device_bytes"] = torch.cuda.max_memory_allocated()
        if isinstance(opt, OffloadAdamW):
            row["pinned_bytes"] = opt.pinned_bytes()
            row["host_state_bytes"] = opt.host_state_bytes()
            row["pipeline_buffers"] = opt._pipeline.host_buffer_bytes() if opt._pipeline else {}
        runs[name] = row
        if opt is not None and getattr(opt, "_pipeline", None) is not None:
            opt._pipeline.close()
        del opt
        gc.collect()  # the pipeline and the optimizer reference each other
    base = runs["forward+backward only"].get("peak_device_bytes")
    for row in runs.values():
        if base is not None:
            row["optimizer_share_bytes"] = row["peak_device_bytes"] - base
    return {"parameters": n_params, "tokens_per_step": cfg.batch * cfg.seq, "runs": runs}


# -------------------------------------------------------------------- bandwidth


def _timed_copy(dst: torch.Tensor, src: torch.Tensor, repeats: int = 5) -> float:
    """Best seconds of one non-blocking copy, timed with CUDA events on a side stream."""
    stream = torch.cuda.Stream()
    best = math.inf
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def bandwidth(cfg: CheckConfig, mem: dict | None) -> dict:
    from offload_adamw.accel.host_memory import HostArena

    n = cfg.peak_copy_bytes // 2
    arena = HostArena([("x", torch.Size([n]), torch.bfloat16)], pin=True, label="probe")
    host = arena.views["x"]
    device = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    peak_d2h = cfg.peak_copy_bytes / _timed_copy(host, device)
    peak_h2d = cfg.peak_copy_bytes / _timed_copy(device, host)
    del device

    # The pipeline's own per-tensor copies, as backward and step issue them.
    torch.manual_seed(0)
    model = llama(cfg.big_hidden, max(cfg.big_layers // 4, 1), cfg.big_vocab, torch.bfloat16, "cuda")
    opt = OffloadAdamW(model.parameters(), offload_gradients=False)
    pipe = opt._pipeline
    slots = list(pipe._slots.values())
    grads = [torch.randn_like(s.param) for s in slots]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    d2h_stream = pipe._stream(torch.device("cuda", torch.cuda.current_device()), "d2h")
    best_d2h = best_h2d = math.inf
    for _ in range(3):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(d2h_stream)
        for s, g in zip(slots, grads):
            pipe._transfer(s, g, s.host_grad)
        end.record(d2h_stream)
        end.synchronize()
        best_d2h = min(best_d2h, start.elapsed_time(end) / 1e3)
        h2d_stream = pipe._stream(torch.device("cuda", torch.cuda.current_device()), "h2d")
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(h2d_stream)
        pipe._send_back(slots)
        end.record(h2d_stream)
        end.synchronize()
        best_h2d = min(best_h2d, start.elapsed_time(end) / 1e3)
    out = {
        "peak_d2h_GBps": peak_d2h / 1e9,
        "peak_h2d_GBps": peak_h2d / 1e9,
        "peak_probe_registered_exactly": arena.rounded_bytes == 0,
        "pipeline_tensors": len(slots),
        "pipeline_bytes": nbytes,
        "pipeline_d2h_GBps": nbytes / best_d2h / 1e9,
        "pipeline_h2d_GBps": nbytes / best_h2d / 1e9,
        "pipeline_d2h_fraction_of_peak": (nbytes / best_d2h) / peak_d2h,
        "pipeline_h2d_fraction_of_peak": (nbytes / best_h2d) / peak_h2d,
    }
    pipe.close()
    if mem is not None:
        row = mem["runs"].get("OffloadAdamW(offload_gradients=True)")
        if row:
            per_step = 2 * 2 * mem["parameters"]  # bf16 gradients down, bf16 parameters up
            out["training_bytes_per_step"] = per_step
            out["training_link_fraction"] = per_step / row["step_s_median"] / ((peak_d2h + peak_h2d) / 2)
    return out


# -------------------------------------------------------------------- CPU smoke


def cpu_smoke_sizes() -> CheckConfig:
    return CheckConfig(
        device="cpu", parity_steps=3, parity_hidden=32, big_hidden=64, big_layers=2, big_vocab=256,
        batch=2, seq=16, warmup=1, timed=2, budget_s=120.0,
    )


# ------------------------------------------------------------------------ report


def table(result: dict) -> str:
    lines = []
    for row in result.get("parity", []):
        lines.append(
            f"parity {row['dtype']:>8} freed={str(row['offload_gradients']):5}  bitwise vs host fused: {row['bitwise_vs_host_fused_adamw']!s:5}  "
            f"round(master): {row['param_is_round_of_master']!s:5}  vs device fused: max abs {row['vs_device_fused_adamw_max_abs']:.2e} "
            f"rel {row['vs_device_fused_adamw_max_rel']:.2e} equal {row['vs_device_fused_adamw_equal_fraction']:.4f}"
        )
    mem = result.get("memory_time")
    if isinstance(mem, dict) and "runs" in mem:
        lines.append(f"model: {mem['parameters'] / 1e9:.3f} B parameters, {mem['tokens_per_step']} tokens/step")
        base_t = mem["runs"]["torch.optim.AdamW(fused=True) on device"]["step_s_median"]
        lines.append(f"{'run':42} {'step s':>8} {'x torch':>8} {'peak GiB':>9} {'opt share GiB':>14} {'pinned GiB':>10}")
        for name, row in mem["runs"].items():
            peak = row.get("peak_device_bytes")
            share = row.get("optimizer_share_bytes")
            lines.append(
                f"{name:42} {row['step_s_median']:8.3f} {row['step_s_median'] / base_t:8.2f} "
                f"{(peak or 0) / 2**30:9.2f} {(share or 0) / 2**30:14.2f} {row.get('pinned_bytes', 0) / 2**30:10.2f}"
            )
    bw = result.get("bandwidth")
    if isinstance(bw, dict) and "peak_d2h_GBps" in bw:
        lines.append(
            f"link peak d2h {bw['peak_d2h_GBps']:.1f} GB/s, h2d {bw['peak_h2d_GBps']:.1f} GB/s; pipeline per-tensor copies: "
            f"d2h {bw['pipeline_d2h_GBps']:.1f} GB/s ({bw['pipeline_d2h_fraction_of_peak']:.0%}), "
            f"h2d {bw['pipeline_h2d_GBps']:.1f} GB/s ({bw['pipeline_h2d_fraction_of_peak']:.0%})"
        )
        if "training_link_fraction" in bw:
            lines.append(f"training: {bw['training_bytes_per_step'] / 1e9:.2f} GB moved per step = {bw['training_link_fraction']:.0%} of the link over the step")
    for name, err in result.get("errors", {}).items():
        lines.append(f"ERROR in {name}: {err.splitlines()[-1] if err else err}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="reduced run with the CPU as device (checks the script)")
    parser.add_argument("--json", type=Path, default=Path("bench-out/gpu_check.json"), help="where to write the results")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        cfg = cpu_smoke_sizes()
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke to check the script", file=sys.stderr)
        return 2
    else:
        cfg = CheckConfig(device="cuda")
    started = time.perf_counter()
    result: dict = {
        "config": asdict(cfg),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cfg.device == "cuda" else platform.processor() or "cpu",
        "errors": {},
    }

    def section(name: str, fn):
        if time.perf_counter() - started > cfg.budget_s:
            result["errors"][name] = "skipped: time budget spent"
            return None
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception:  # recorded (torch.OutOfMemoryError included), the next section still runs
            result["errors"][name] = traceback.format_exc()
            out = None
        if name in result["errors"]:
            # A failed section's model and optimizer (the optimizer and its pipeline form a reference
            # cycle) still hold device, pinned and host memory: free them before the next section.
            gc.collect()
            if cfg.device == "cuda":
                try:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                except Exception:  # a sticky CUDA error: the next sections will record it too
                    pass
        result.setdefault("section_seconds", {})[name] = time.perf_counter() - t0
        return out

    def parity_all():
        rows = []
        cases = [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True)]
        for dtype, freed in tqdm(cases, desc="parity", leave=False):
            rows.append(parity_run(cfg, dtype, freed))
        return rows

    result["parity"] = section("parity", parity_all) or []
    mem = section("memory_time", lambda: memory_and_time(cfg))
    result["memory_time"] = mem
    if cfg.device == "cuda":
        result["bandwidth"] = section("bandwidth", lambda: bandwidth(cfg, mem))
    from offload_adamw import compiled_kernel_status

    result["compiled_kernel"] = compiled_kernel_status()  # per variant: usable, compile seconds, reason
    result["total_seconds"] = time.perf_counter() - started
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, default=str))
    print(table(result))
    print(f"total {result['total_seconds']:.1f} s; JSON: {args.json}")
    ok = not result["errors"] and all(r["bitwise_vs_host_fused_adamw"] and r["param_is_round_of_master"] for r in result["parity"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
