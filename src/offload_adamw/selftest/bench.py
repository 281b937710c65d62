"""``offload-adamw selftest --bench``: how fast this machine moves and updates, and a Llama's step with every placement.

Contract: :func:`run_bench` runs the sections in the order that answers the most first, each section's rows one
after another, and returns a JSON-ready dict; a row that would start after ``budget_s`` seconds (counted from the
first row) is ``skipped: time budget``, a row that cannot run here is ``skipped`` with the reason, a row that raises
is ``error`` with its message on one line (the sections after it still run). :func:`format_bench` prints it.

1. ``pcie`` (CUDA only): host-to-device and device-to-host copies of one large buffer from page-locked memory,
   timed with CUDA events, best and median of the repeats, in GB/s (decimal).
2. ``host``: the STREAM triads (:func:`offload_adamw.benchmarking.bandwidth.measure_host_bandwidth`), and one host
   step of the default mixed kernel (bf16 gradients and model copy, float32 master and moments) against torch's
   fused float32 step over the same arrays (:func:`offload_adamw.benchmarking.host_step.run_size`).
3. ``llama``: a Llama (``1b``: about 1.1 B parameters, bf16, sequence 2048; ``tiny``: a few hundred thousand, for a
   CPU rehearsal in seconds; transformers, the ``hf`` extra) trained on random tokens: forward+backward alone
   (gradients kept, no update), the on-device reference (``torch.optim.AdamW(fused=True)`` on float32 masters on
   the device, fed the upcast gradients, the model given the rounded copy), and OffloadAdamW with freed gradients
   per placement: host with the updates during backward, streamed, resident, the mix (embeddings and head on the
   host, the first half of the layers resident, the rest streamed; during backward), and host at the step.
   Per row: the median step seconds over the timed steps (after warm-up steps: the first teaches
   ``update_in_backward`` the order), what that adds to forward+backward alone (``exposed_s``), tokens/s, peak
   device memory (``torch.cuda.max_memory_allocated``) and how far the process's peak resident host memory rose
   during the timed steps, and the update's overlap with backward from the optimizer's timeline.
   **The token count per step** is chosen from the measurements, so that backward can hide the host update:
   the host update of N parameters takes about N x (the measured host step's seconds per element) plus the
   gradient and parameter copies (4 bytes per parameter at the slower measured PCIe direction); backward takes
   about two thirds of a forward+backward, probed at one sequence; the tokens are enough for backward to last 1.25x
   the host update, a whole number of sequences, at least one. Where they do not fit the device (activation
   memory measured in the probe, the reference's 16 bytes per parameter of state and a quarter of the device
   kept free), activation checkpointing is turned on and the probe repeated; where they still do not fit they
   are capped, and the output says so. The choice and its inputs are in ``llama.tokens``.
   **Host memory**: the rows need about :data:`HOST_BYTES_PER_PARAMETER` bytes per parameter (float32 master and
   moments, the gradient buffers); the section is skipped, saying so, where the figure to size by
   (:func:`offload_adamw.selftest.environment.host_memory_for_sizing`: MemTotal where MemAvailable is under a
   quarter of it, as on a fresh VM) is smaller. Where that figure is MemTotal, the optimizer's own pre-flight is
   given it too (``OFFLOAD_ADAMW_HOST_AVAILABLE_BYTES`` while the rows run), since it reads MemAvailable and would
   refuse what fits; ``llama.host_memory`` says which figure was used.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from offload_adamw.benchmarking.bandwidth import measure_host_bandwidth
from offload_adamw.benchmarking.host_step import BenchConfig, run_size
from offload_adamw.benchmarking.timing import measure_step
from offload_adamw.optim.optimizer import OffloadAdamW

__all__ = ["SIZES", "run_bench", "format_bench", "LLAMA_ROWS"]

SIZES: dict[str, dict[str, Any]] = {
    # TinyLlama-1.1B's shape: 22 layers of 2048, grouped-query attention (4 key-value heads), a 32k vocabulary
    "1b": {"llama": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4), "seq": 2048,
           "pcie_bytes": 1 << 30, "triad_elements": 64 << 20, "host_step_elements": 64 << 20,
           "repeats": 5, "warmup_steps": 2, "timed_steps": 3, "max_tokens": 1 << 20},
    "tiny": {"llama": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2), "seq": 64,
             "pcie_bytes": 16 << 20, "triad_elements": 4 << 20, "host_step_elements": 1 << 20,
             "repeats": 2, "warmup_steps": 2, "timed_steps": 2, "max_tokens": 4096},
}

LLAMA_ROWS: dict[str, dict[str, Any]] = {
    # name -> what the row runs: None (forward+backward only), "reference", or OffloadAdamW's placement and mode
    "forward+backward": {"optimizer": None},
    "device fp32-master AdamW": {"optimizer": "reference"},
    "host, during backward": {"optimizer": "offload", "placement": "host", "in_backward": True},
    "stream": {"optimizer": "offload", "placement": "stream", "in_backward": False},
    "device": {"optimizer": "offload", "placement": "device", "in_backward": False},
    "mix, during backward": {"optimizer": "offload", "placement": "mix", "in_backward": True},
    "host, at step": {"optimizer": "offload", "placement": "host", "in_backward": False},
}
"""In the order that answers the most first (a row past the budget is skipped): the two baselines, the design's
claim (the host update hidden behind backward), the device placements, the host update after backward last."""
HIDE_MARGIN = 1.25
HOST_BYTES_PER_PARAMETER = 20
"""Host bytes per parameter of an offloaded row: float32 master, exp_avg and exp_avg_sq (12), the bf16 gradient's
host buffer and its float32 accumulation where freed gradients accumulate (up to 6), and room for the pipeline's
staging (2)."""
DEVICE_FREE_SHARE = 0.25


class _Clock:
    def __init__(self, budget_s: float) -> None:
        self.start = time.monotonic()
        self.budget_s = budget_s

    def over(self) -> bool:
        return time.monotonic() - self.start > self.budget_s


def _row(name: str, clock: _Clock, fn: Callable[[], dict[str, Any]], log: Callable[..., None]) -> dict[str, Any]:
    if clock.over():
        return {"row": name, "status": "skipped", "why": f"time budget ({clock.budget_s:.0f} s) spent"}
    log(f"bench: {name} ...")
    start = time.monotonic()
    try:
        found = fn()
        result = {"row": name, "status": found.pop("status", "ok"), **found}
    except Exception as exc:  # a row that raises is a result: the rows after it still run
        text = f"{type(exc).__name__}: {exc}".splitlines()
        result = {"row": name, "status": "error", "why": text[0] if text else type(exc).__name__}
    result["seconds"] = time.monotonic() - start
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------- pcie

def _pcie(device: torch.device, nbytes: int, repeats: int) -> dict[str, Any]:
    if device.type != "cuda":
        return {"status": "skipped", "why": "needs a CUDA device"}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.fill_(1)
    found: dict[str, Any] = {"bytes": nbytes}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        times = times[1:]
        found[f"{name}_gbps"] = nbytes / min(times) / 1e9
        found[f"{name}_gbps_median"] = nbytes / statistics.median(times) / 1e9
    del host, dev
    return found


# ------------------------------------------------------------------- host

def _host_step(elements: int, repeats: int) -> dict[str, Any]:
    ours, theirs = "ours-bf16", "torch-fused-fp32"
    result = run_size(elements, BenchConfig(cases=(ours, theirs), repeats=repeats, warmup=1), {})
    cases = result["cases"]
    return {"elements": result["elements"], "ours_ms": cases[ours]["ms_per_step"],
            "torch_fused_fp32_ms": cases[theirs]["ms_per_step"],
            "ours_gbps": cases[ours]["effective_gbps"], "torch_fused_fp32_gbps": cases[theirs]["effective_gbps"],
            "ratio": cases[ours]["ms_per_step"] / cases[theirs]["ms_per_step"],
            "s_per_element": cases[ours]["ms_per_step"] / 1e3 / result["elements"]}


# ------------------------------------------------------------------- llama

def _llama(size: dict[str, Any], device: torch.device) -> Any:
    import transformers

    config = transformers.LlamaConfig(**size["llama"], max_position_embeddings=size["seq"], tie_word_embeddings=False)
    with torch.device(device):
        model: Any = transformers.LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    model.config.use_cache = False
    return model


def _forward_backward(model: Any, ids: torch.Tensor, no_sync: Any = None) -> None:
    with no_sync if no_sync is not None else contextlib.nullcontext():
        model(input_ids=ids, labels=ids).loss.backward()


def _tokens_batch(tokens: int, size: dict[str, Any], device: torch.device) -> torch.Tensor:
    seq = size["seq"]
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, size["llama"]["vocab_size"], (max(1, tokens // seq), seq), generator=gen).to(device)


@contextlib.contextmanager
def _device_peak(device: torch.device) -> Iterator[dict[str, Any]]:
    found: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    yield found
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        found["peak_device_bytes"] = int(torch.cuda.max_memory_allocated(device))


def _probe(model: Any, size: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Forward+backward of one sequence: seconds per token and device bytes of activations per token."""
    ids = _tokens_batch(size["seq"], size, device)
    _forward_backward(model, ids)  # warm-up: kernels chosen, gradients allocated
    model.zero_grad(set_to_none=False)
    _sync(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with _device_peak(device) as peak:
        start = time.perf_counter()
        _forward_backward(model, ids)
        _sync(device)
        seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    per_token = (peak.get("peak_device_bytes", base) - base) / ids.numel()
    return {"tokens": ids.numel(), "seconds": seconds, "backward_s_per_token": seconds * 2 / 3 / ids.numel(),
            "activation_bytes_per_token": per_token}


def choose_tokens(params: int, host_s_per_element: float | None, pcie_gbps: float | None, probe: dict[str, Any],
                  seq: int, max_tokens: int, device_room: float | None) -> dict[str, Any]:
    """How many tokens per step let backward hide the host update (module docstring), and why."""
    host_s = params * (host_s_per_element or 0.0)
    copy_s = params * 4 / (pcie_gbps * 1e9) if pcie_gbps else 0.0
    update_s = host_s + copy_s
    wanted = math.ceil(HIDE_MARGIN * update_s / probe["backward_s_per_token"]) if update_s > 0 else seq
    sequences = max(1, math.ceil(wanted / seq))
    why = (f"host update ~{update_s:.3g} s ({host_s:.3g} s of host step at the measured rate, {copy_s:.3g} s of "
           f"copies); backward ~{probe['backward_s_per_token'] * 1e6:.3g} us per token: {HIDE_MARGIN}x needs "
           f"{wanted:,} tokens")
    capped = None
    limit = max_tokens
    if device_room is not None and probe["activation_bytes_per_token"] > 0:
        limit = min(limit, int(device_room / probe["activation_bytes_per_token"]))
    if sequences * seq > limit:
        sequences = max(1, limit // seq)
        capped = f"capped at {sequences * seq:,} tokens ({'device memory' if limit < max_tokens else 'the size limit'})"
    return {"tokens": sequences * seq, "sequences": sequences, "seq": seq, "wanted": wanted, "update_s": update_s,
            "why": why + (f"; {capped}" if capped else ""), "capped": capped is not None}


def _groups(model: Any, placement: str) -> list[dict[str, Any]]:
    if placement != "mix":
        return [{"params": list(model.parameters()), "update_on": placement}]
    layers = model.model.layers
    half = len(layers) // 2
    inner = {id(p) for layer in layers for p in layer.parameters()}
    return [{"params": [p for p in model.parameters() if id(p) not in inner], "update_on": "host"},
            {"params": [p for layer in layers[:half] for p in layer.parameters()], "update_on": "device"},
            {"params": [p for layer in layers[half:] for p in layer.parameters()], "update_on": "stream"}]


class _Reference:
    """torch.optim.AdamW(fused=True) on float32 masters on the device: the on-device fp32-master baseline."""

    def __init__(self, model: Any) -> None:
        self.params = list(model.parameters())
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=1e-5, fused=True)

    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)  # round to nearest into bf16
        for p in self.params:
            p.grad = None


def _llama_row(model: Any, spec: dict[str, Any], ids: torch.Tensor, size: dict[str, Any],
               device: torch.device) -> dict[str, Any]:
    kind = spec["optimizer"]
    opt: Any = None
    if kind == "reference":
        opt = _Reference(model)
    elif kind == "offload":
        opt = OffloadAdamW(_groups(model, spec["placement"]), lr=1e-5, offload_gradients=True,
                           update_in_backward=spec["in_backward"])

    def step() -> None:
        _forward_backward(model, ids)
        if kind == "reference":
            opt.step()
        elif kind == "offload":
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        _sync(device)

    try:
        for _ in range(size["warmup_steps"]):
            step()
        times, rises = [], []
        with _device_peak(device) as peak:
            for _ in range(size["timed_steps"]):
                seconds, rise = measure_step(step)
                times.append(seconds)
                rises.append(rise)
        median = statistics.median(times)
        found: dict[str, Any] = {"step_s": median, "step_s_all": times, "tokens_per_s": ids.numel() / median,
                                 "peak_host_rise_bytes": max((r for r in rises if r is not None), default=None), **peak}
        if kind == "offload":
            timeline = opt.last_step_timeline()
            found["overlap"] = None if timeline is None else timeline.overlap
        return found
    finally:
        opt = None  # its pipeline (hooks, buffers, threads) closes when it goes, before the next row builds its own
        model.zero_grad(set_to_none=True)


def _llama_section(device: torch.device, size: dict[str, Any], host: dict[str, Any], pcie: dict[str, Any],
                   clock: _Clock, log: Callable[..., None]) -> dict[str, Any]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"status": "skipped", "why": "needs transformers: pip install 'offload-adamw[hf]'", "rows": []}
    from offload_adamw.optim.preflight import ENV_AVAILABLE
    from offload_adamw.selftest.environment import host_memory_for_sizing, meminfo

    model = _llama(size, device)
    params = sum(p.numel() for p in model.parameters())
    sizing, source = host_memory_for_sizing(meminfo())
    host_memory = {"needs_bytes": params * HOST_BYTES_PER_PARAMETER, "sized_by_bytes": sizing, "source": source,
                   "preflight_given": None}
    if sizing is not None and params * HOST_BYTES_PER_PARAMETER > sizing:
        return {"status": "skipped", "rows": [], "parameters": params, "host_memory": host_memory,
                "why": f"needs about {params * HOST_BYTES_PER_PARAMETER / 2**30:,.1f} GiB of host memory, "
                       f"{sizing / 2**30:,.1f} GiB here ({source})"}
    given = sizing if source.startswith("MemTotal") and ENV_AVAILABLE not in os.environ else None
    host_memory["preflight_given"] = given
    probe = _probe(model, size, device)
    pcie_gbps = min(pcie["h2d_gbps"], pcie["d2h_gbps"]) if pcie.get("status", "ok") == "ok" else None
    room = None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        room = free - DEVICE_FREE_SHARE * total - 16 * params  # the reference's float32 master and moments, grads
    host_rate = host.get("s_per_element") if host.get("status", "ok") == "ok" else None
    tokens = choose_tokens(params, host_rate, pcie_gbps, probe, size["seq"], size["max_tokens"], room)
    checkpointing = False
    if tokens["capped"] and device.type == "cuda":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        checkpointing = True
        probe = _probe(model, size, device)
        tokens = choose_tokens(params, host_rate, pcie_gbps, probe, size["seq"], size["max_tokens"], room)
    tokens["activation_checkpointing"] = checkpointing
    tokens["probe"] = probe
    ids = _tokens_batch(tokens["tokens"], size, device)
    rows: list[dict[str, Any]] = []
    try:
        if given is not None:  # the optimizer's pre-flight reads MemAvailable: give it the figure this run sizes by
            os.environ[ENV_AVAILABLE] = str(given)
        for name, spec in LLAMA_ROWS.items():
            def one(spec: dict[str, Any] = spec) -> dict[str, Any]:
                return _llama_row(model, spec, ids, size, device)

            rows.append(_row(name, clock, one, log))
    finally:
        if given is not None:
            os.environ.pop(ENV_AVAILABLE, None)
    alone = rows[0].get("step_s") if rows and rows[0]["status"] == "ok" else None
    for row in rows:  # what the optimizer adds to a step: the row's time over forward+backward alone
        row["exposed_s"] = row["step_s"] - alone if alone is not None and row.get("status") == "ok" else None
    return {"parameters": params, "tokens": tokens, "rows": rows, "host_memory": host_memory}


def _peak_rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def run_bench(device: torch.device, *, size: str = "tiny", budget_s: float = 420.0,
              log: Callable[..., None] = print) -> dict[str, Any]:
    """Every section (module docstring) on ``device`` with the sizes of ``size`` (:data:`SIZES`); ``log`` hears
    each row as it starts (where a run that is stopped was)."""
    spec = SIZES[size]
    clock = _Clock(budget_s)
    pcie = _row("pcie", clock, lambda: _pcie(device, spec["pcie_bytes"], spec["repeats"]), log)
    triad = _row("host triad", clock, lambda: measure_host_bandwidth(elements=spec["triad_elements"],
                                                                       repeats=spec["repeats"]), log)
    host = _row("host step", clock, lambda: _host_step(spec["host_step_elements"], spec["repeats"]), log)
    llama = _row("llama", clock, lambda: _llama_section(device, spec, host, pcie, clock, log), log)
    return {"size": size, "budget_s": budget_s, "seconds": time.monotonic() - clock.start, "pcie": pcie,
            "host_triad": triad, "host_step": host, "llama": llama, "peak_host_rss_bytes": _peak_rss_bytes(),
            "peak_device_bytes": int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None}


def _gb(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 2**30:,.2f} GiB" if value >= 2**30 else f"{value / 2**20:,.1f} MiB"


def format_bench(result: dict[str, Any], render_table: Callable[..., str] | None = None) -> str:
    """The bench as text: one table of the machine's figures, one of the Llama's rows, the token choice stated."""
    import textwrap

    from offload_adamw._output import render_table as render
    from offload_adamw._output import terminal_width

    table = render_table or render
    lines = [f"bench ({result['size']} sizes, {result['seconds']:.0f} s):"]

    def status(row: dict[str, Any]) -> str | None:
        return None if row["status"] == "ok" else f"{row['status']}: {row.get('why', '')}"

    pcie, triad, host = result["pcie"], result["host_triad"], result["host_step"]
    machine = [["pinned H2D / D2H", status(pcie) or f"{pcie['h2d_gbps']:.1f} / {pcie['d2h_gbps']:.1f} GB/s "
                                                  f"(best; median {pcie['h2d_gbps_median']:.1f} / "
                                                  f"{pcie['d2h_gbps_median']:.1f}), {pcie['bytes'] / 2**20:,.0f} MiB"],
               ["host triad / in-place", status(triad) or f"{triad['triad_gbps']:.1f} / {triad['inplace_triad_gbps']:.1f} "
                                                         f"GB/s on {triad['threads']} threads"],
               ["host step", status(host) or f"{host['ours_ms']:.1f} ms ours (bf16 grads, {host['ours_gbps']:.1f} GB/s) "
                                             f"vs {host['torch_fused_fp32_ms']:.1f} ms torch fused fp32: "
                                             f"{host['ratio']:.2f}x, {host['elements']:,} elements"]]
    lines.append(table(["measured", ""], machine, wrap=1))
    llama = result["llama"]
    if llama["status"] != "ok":
        lines.append(textwrap.fill(f"llama: {status(llama)}", width=terminal_width(), subsequent_indent="  "))
    else:
        tokens = llama["tokens"]
        lines.append(textwrap.fill(f"llama: {llama['parameters']:,} parameters, {tokens['tokens']:,} tokens per step "
                                   f"({tokens['sequences']} x {tokens['seq']}"
                                   f"{', activation checkpointing' if tokens['activation_checkpointing'] else ''}): "
                                   f"{tokens['why']}", width=terminal_width(), subsequent_indent="  "))
        memory = llama["host_memory"]
        given = memory["preflight_given"]
        lines.append(textwrap.fill(f"host memory: the rows need about {_gb(memory['needs_bytes'])}, sized by "
                                   f"{_gb(memory['sized_by_bytes'])} ({memory['source']})"
                                   + (f"; the optimizer's pre-flight given {_gb(given)}" if given else ""),
                                   width=terminal_width(), subsequent_indent="  "))
        shown, notes = [], []
        for row in llama["rows"]:
            if row["status"] != "ok":  # said below the table, where its reason can wrap
                shown.append([row["row"], "-", "-", "-", "-", "-", "-"])
                notes.append(textwrap.fill(f"{row['row']}: {status(row)}", width=terminal_width(),
                                           subsequent_indent="  "))
                continue
            overlap = row.get("overlap")
            exposed = row.get("exposed_s")
            shown.append([row["row"], f"{row['step_s']:.3f}", "-" if exposed is None else f"{exposed:+.3f}",
                          f"{row['tokens_per_s']:,.0f}",
                          _gb(row.get("peak_device_bytes")), _gb(row.get("peak_host_rise_bytes")),
                          "-" if overlap is None else f"{overlap:.2f}"])
        lines.append(table(["row", "step s", "over f+b", "tokens/s", "peak device", "host rise", "overlap"], shown,
                           align="lrrrrrr", wrap=0))
        lines.extend(notes)
    lines.append(textwrap.fill(f"peak host memory (resident): {_gb(result['peak_host_rss_bytes'])}; "
                               f"peak device memory: {_gb(result['peak_device_bytes'])}", width=terminal_width()))
    return "\n".join(lines)
