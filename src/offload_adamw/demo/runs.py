"""`offload-adamw demo`: train a small Llama four ways and show where a naive offload drifts.

Contract:

* Builds a small ``LlamaForCausalLM`` (random init, a few million parameters, byte vocabulary)
  and a byte-level corpus from the standard library's sources (:mod:`offload_adamw.demo.data`), then
  trains it from *identical* initial weights on *identical* batches, with the same warmup-cosine
  schedule, four times:

  1. ``torch.optim.AdamW(fused=True)`` in float32: the reference;
  2. :class:`~offload_adamw.OffloadAdamW` in float32: its default path is defined to be bitwise
     equal to (1), so the largest parameter and loss differences reported must be exactly 0;
  3. OffloadAdamW on the same model in bf16 (float32 master and moments on the host);
  4. :class:`~offload_adamw.demo.naive.NaiveOffloadAdamW` on the bf16 model (bf16 moments, decay after
     the update).

  (3) and (4) are both compared with the float32 reference: the reader sees (3) track it and (4)
  drift (parameter distance, loss, elements that never moved). The bf16 runs keep parameters and
  gradients in bf16 and compute the forward and backward on their float32 upcast, so that the only
  difference between the runs is the optimizer (and CPUs run bf16 matmuls slowly).
* The regime is chosen so that the defect shows within a short run, and the choice is stated:
  weights initialised at std 0.08 (about 1/sqrt(hidden), the scale of a trained model's weights)
  and a fine-tuning-sized peak lr of 3e-4. An update smaller than half a bf16 spacing of its weight
  (|w| * 2**-9) is lost, so at lr 3e-4 the naive offload stops moving weights above about 0.15.
  Measured here: from transformers' default std 0.02 at lr 1e-3, the runs are chaotic after about
  50 steps (a float32 run started from the bf16-rounded initial weights ends as far from the
  reference as the bf16 runs do), and the naive offload's drift is hidden in that noise.
* Then runs the conformance checker (:mod:`offload_adamw.conformance`) on the naive optimizer and
  reports the clauses it fails, and includes the planner's memory bill
  (:mod:`offload_adamw.planning.planner`). Both are imported where they are used, so that an error in
  either is reported in the demo's output instead of ending the run.
* Writes ``loss_curves.png``, ``report.md`` and ``results.json`` (a JSON document with
  ``schema_version``, :mod:`offload_adamw._output`) into the output directory. The command line
  (``--out``, ``--json``, the printed summary) is :mod:`offload_adamw.cli.demo`.
* The default ``--steps`` keeps the whole run under 3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from offload_adamw._output import json_document
from offload_adamw.demo.data import VOCAB_SIZE, CorpusConfig, load_corpus
from offload_adamw.demo.naive import NaiveOffloadAdamW
from offload_adamw.optim.optimizer import OffloadAdamW
from offload_adamw.optim.state import state_tensor_bytes

__all__ = ["DemoConfig", "RunResult", "run_demo"]

DEFAULT_STEPS = 100


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Everything that decides what the demo computes (same config, same numbers)."""

    steps: int = DEFAULT_STEPS
    """Optimizer steps per run (four runs)."""
    batch_size: int = 8
    """Sequences per batch."""
    seq_len: int = 128
    """Bytes per sequence."""
    hidden_size: int = 192
    """Llama hidden size."""
    intermediate_size: int = 512
    """Llama MLP width."""
    num_layers: int = 4
    """Llama decoder layers."""
    num_heads: int = 4
    """Attention heads (as many key/value heads)."""
    init_std: float = 0.08
    """Std of the initial weights, about 1/sqrt(hidden_size): the scale of a trained model's weights.
    With transformers' default 0.02 the weights are so small that bf16 spacing rarely swallows an
    update in a short run, and the naive offload's defect hides (see the module docstring)."""
    lr: float = 3e-4
    """Peak learning rate of the warmup-cosine schedule (a fine-tuning-sized rate)."""
    warmup_steps: int = 10
    """Linear warmup from lr/warmup_steps to lr."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr * min_lr_ratio at the last step."""
    weight_decay: float = 0.1
    """Decoupled weight decay of every parameter (as many recipes do)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas (0.95 as in Llama's recipe)."""
    eval_points: int = 6
    """Validation evaluations besides the one before training."""
    eval_batches: int = 4
    """Validation batches per evaluation."""
    seed: int = 0
    """Seed of the initial weights and of the batch order."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    """Which standard-library bytes are read."""
    check: bool = True
    """Run the conformance checker on the naive optimizer (when it is installed)."""


@dataclass
class RunResult:
    """What one training run produced."""

    key: str
    label: str
    dtype: str
    train_loss: list[float]
    val_steps: list[int]
    val_loss: list[float]
    step_ms: list[float]
    optimizer_ms: list[float]
    state_bytes: int
    param_distance: list[float] = field(default_factory=list)
    """||theta - theta_ref|| / ||theta_ref - theta_0|| at each validation step after 0."""
    max_param_diff: float | None = None
    """Largest |theta - theta_ref| over all elements at the end."""
    max_loss_diff: float | None = None
    """Largest |loss - loss_ref| over all training steps."""
    unmoved_fraction: float = 0.0
    """Share of parameter elements whose (model-dtype) value never changed from its initial value."""
    norm_weights_unmoved: float = 0.0
    """Share of RMSNorm weight elements that never changed."""


RUNS = (
    ("torch_fp32", "torch.optim.AdamW(fused=True), float32 (reference)", torch.float32),
    ("offload_fp32", "OffloadAdamW, float32", torch.float32),
    ("offload_bf16", "OffloadAdamW, bf16 model (fp32 master, m, v)", torch.bfloat16),
    ("naive_bf16", "naive offload, bf16 model (bf16 m, v, decay after update)", torch.bfloat16),
)


def build_model(config: DemoConfig):
    """A randomly initialised byte-level LlamaForCausalLM (float32), seeded by ``config.seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    llama_config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=max(256, config.seq_len),
        tie_word_embeddings=False,
        initializer_range=config.init_std,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(config.seed)
    return LlamaForCausalLM(llama_config)


def make_optimizer(key: str, params, config: DemoConfig) -> torch.optim.Optimizer:
    common: dict[str, Any] = dict(lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    if key == "torch_fp32":
        return torch.optim.AdamW(params, fused=True, **common)
    if key in ("offload_fp32", "offload_bf16"):
        return OffloadAdamW(params, **common)
    if key == "naive_bf16":
        return NaiveOffloadAdamW(params, **common)
    raise ValueError(f"unknown run {key!r}")


def lr_lambda(config: DemoConfig) -> Callable[[int], float]:
    """Warmup then cosine decay to ``min_lr_ratio``, as a multiplier of the peak lr."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        span = max(1, config.steps - config.warmup_steps)
        progress = min(1.0, (step - config.warmup_steps) / span)
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _loss(model, inputs: Tensor, targets: Tensor) -> Tensor:
    params = dict(model.named_parameters())
    if any(p.dtype != torch.float32 for p in params.values()):
        # Low-precision parameters (and so gradients) are what the optimizers see; the arithmetic
        # runs on their float32 upcast: CPUs without bf16 matrix units run bf16 several times
        # slower, and float32 arithmetic keeps bf16 rounding noise of the forward out of the
        # comparison, so that what differs between runs is the optimizer and nothing else.
        upcast = {name: p.float() for name, p in params.items()}
        logits = torch.func.functional_call(model, upcast, args=(), kwargs={"input_ids": inputs}).logits
    else:
        logits = model(input_ids=inputs).logits
    # The loss in float32 whatever the model dtype, as transformers' own loss does.
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def _evaluate(model, batches: list[tuple[Tensor, Tensor]]) -> float:
    model.eval()
    losses = [_loss(model, x, y).item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def _flat_params(model) -> Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _eval_steps(config: DemoConfig) -> list[int]:
    points = {0, config.steps}
    for i in range(1, config.eval_points):
        points.add(round(i * config.steps / config.eval_points))
    return sorted(points)


def train_one(
    key: str,
    label: str,
    dtype: torch.dtype,
    initial_model,
    config: DemoConfig,
    train_batches: list[tuple[Tensor, Tensor]],
    val_batches: list[tuple[Tensor, Tensor]],
    reference: dict[str, Any] | None,
    progress: bool,
) -> tuple[RunResult, dict[str, Any]]:
    """Train a copy of ``initial_model`` in ``dtype`` with the optimizer named ``key``.

    Returns the result and the snapshots (flat float32 parameters at each validation step, the
    per-step losses) that later runs are compared with.
    """
    from tqdm.auto import tqdm

    model = copy.deepcopy(initial_model)
    for p in model.parameters():  # parameters only: buffers (rotary frequencies) stay float32
        p.data = p.data.to(dtype)
    model.train()
    initial_flat = _flat_params(model)
    norm_mask = torch.cat(
        [torch.full((p.numel(),), "norm" in name, dtype=torch.bool) for name, p in model.named_parameters()]
    )
    optimizer = make_optimizer(key, model.parameters(), config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    eval_at = set(_eval_steps(config))
    snapshots: dict[int, Tensor] = {}
    result = RunResult(
        key=key, label=label, dtype=str(dtype).replace("torch.", ""), train_loss=[], val_steps=[], val_loss=[],
        step_ms=[], optimizer_ms=[], state_bytes=0,
    )
    moved = torch.zeros_like(initial_flat, dtype=torch.bool)

    def record_eval(step: int) -> None:
        result.val_steps.append(step)
        result.val_loss.append(_evaluate(model, val_batches))
        flat = _flat_params(model)
        snapshots[step] = flat
        if reference is not None and step > 0:
            ref, ref0 = reference["snapshots"][step], reference["snapshots"][0]
            travelled = (ref - ref0).norm().item()
            result.param_distance.append((flat - ref).norm().item() / travelled if travelled > 0 else float("nan"))

    record_eval(0)
    bar = tqdm(train_batches, desc=f"{key:>12}", unit="step", disable=not progress, leave=True, file=sys.stderr)
    for step, (inputs, targets) in enumerate(bar, start=1):
        start = time.perf_counter()
        loss = _loss(model, inputs, targets)
        loss.backward()
        opt_start = time.perf_counter()
        optimizer.step()
        opt_end = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        result.step_ms.append((time.perf_counter() - start) * 1e3)
        result.optimizer_ms.append((opt_end - opt_start) * 1e3)
        result.train_loss.append(loss.item())
        if step in eval_at:
            record_eval(step)
            moved |= snapshots[step] != initial_flat
        bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()

    result.state_bytes = state_tensor_bytes(optimizer)
    final = snapshots[config.steps]
    # "Never moved" is judged at the validation points, where the snapshots are taken.
    result.unmoved_fraction = float((~moved).float().mean())
    result.norm_weights_unmoved = float((~moved[norm_mask]).float().mean()) if norm_mask.any() else 0.0
    if reference is not None:
        result.max_param_diff = float((final - reference["snapshots"][config.steps]).abs().max())
        result.max_loss_diff = max(abs(a - b) for a, b in zip(result.train_loss, reference["train_loss"]))
    return result, {"snapshots": snapshots, "train_loss": result.train_loss}


# ----------------------------------------------------------------------------- optional parts


def conformance_findings(dtype: torch.dtype = torch.bfloat16, *, progress: bool = False) -> dict[str, Any]:
    """Clauses of the AdamW contract the naive optimizer fails, from the checker when installed."""
    try:
        conformance = importlib.import_module("offload_adamw.conformance")
    except ImportError as exc:
        return {"available": False, "reason": f"the conformance checker is not installed ({exc})"}
    try:
        kwargs = {"progress": progress} if "progress" in inspect.signature(conformance.check).parameters else {}
        report = conformance.check(NaiveOffloadAdamW, dtype=dtype, **kwargs)
    except Exception as exc:  # the demo reports a checker problem, it does not die of it
        return {"available": False, "reason": f"the conformance checker raised {type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=3)}
    failed = []
    for clause in getattr(report, "failed", []):
        failed.append({
            "number": getattr(clause, "number", None),
            "name": getattr(clause, "name", ""),
            "verdict": str(getattr(clause, "verdict", "fail")),
            "deviation": _jsonable(getattr(clause, "deviation", None)),
            "consequence": getattr(clause, "consequence", ""),
        })
    table = None
    if hasattr(report, "to_table"):
        try:
            table = report.to_table()
        except Exception:  # a table is a nicety
            table = None
    return {"available": True, "dtype": str(dtype).replace("torch.", ""), "failed": failed, "table": table}


def planner_bill(named_shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    """The planner's bill for this model with bf16 parameters and OffloadAdamW, when the planner is installed.

    Gives the bill of docs/contract.md#memory-bill (bytes by item) and the planner's prediction of the host
    bytes OffloadAdamW allocates for these tensors, which the demo sets beside what it measured.
    """
    try:
        planner = importlib.import_module("offload_adamw.planning.planner")
        n_params = sum(math.prod(shape) for _, shape in named_shapes)
        bill = planner.memory_bill(n_params, param_dtype="bfloat16")
        specs = [planner.ParamSpec(name=name, shape=tuple(shape), dtype="bfloat16", on_host=True)
                 for name, shape in named_shapes]
        predicted = planner.predict_host_optimizer_bytes(specs)
    except ImportError as exc:
        return {"available": False, "reason": f"the planner is not installed ({exc})"}
    except Exception as exc:  # an incompatible planner must not take the demo down
        return {"available": False, "reason": f"the planner raised {type(exc).__name__}: {exc}"}
    items = bill.as_dict() if hasattr(bill, "as_dict") else _jsonable(bill)
    return {
        "available": True,
        "bill": {k: int(v) for k, v in items.items() if v},
        "predicted_host_optimizer_bytes": int(predicted),
    }


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value  # a non-finite one becomes null (named under "nonfinite") when the JSON is written
    if isinstance(value, Tensor):
        return _jsonable(value.item() if value.numel() == 1 else value.tolist())
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return _jsonable(asdict(value))
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    return str(value)


# ----------------------------------------------------------------------------- the whole demo


def run_demo(config: DemoConfig, out_dir: Path, *, progress: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the four trainings, write the plot, the report and results.json; return the results."""
    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(config.corpus)
    model = build_model(config)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"model: LlamaForCausalLM, {n_params / 1e6:.2f} M parameters; corpus: {corpus.train.numel() / 1e6:.1f} MB "
        f"train ({corpus.train_files} files), {corpus.val.numel() / 1e6:.2f} MB validation ({corpus.val_files} files) "
        f"from {corpus.root}"
    )
    train_batches = list(corpus.batches("train", config.steps, config.batch_size, config.seq_len, seed=config.seed))
    val_batches = list(corpus.batches("val", config.eval_batches, config.batch_size, config.seq_len, seed=config.seed + 1))

    results: list[RunResult] = []
    reference = None
    for key, label, dtype in RUNS:
        result, snaps = train_one(key, label, dtype, model, config, train_batches, val_batches, reference, progress)
        if reference is None:
            reference = snaps
        results.append(result)

    findings = conformance_findings(progress=progress) if config.check else {"available": False, "reason": "skipped (--no-check)"}
    bill = planner_bill([(name, tuple(p.shape)) for name, p in model.named_parameters()])
    if bill.get("available"):
        bill["measured_host_optimizer_bytes"] = next(r.state_bytes for r in results if r.key == "offload_bf16")
    summary = {
        "config": _jsonable(asdict(config)),
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "cpu": platform.processor() or platform.machine()},
        "n_params": n_params,
        "runs": {r.key: _jsonable(asdict(r)) | {"final_train_loss": r.train_loss[-1], "final_val_loss": r.val_loss[-1],
                                                "median_step_ms": statistics.median(r.step_ms),
                                                "median_optimizer_ms": statistics.median(r.optimizer_ms),
                                                "state_bytes_per_param": r.state_bytes / n_params}
                 for r in results},
        "conformance": findings,
        "planner": bill,
        "seconds": time.perf_counter() - started,
    }
    files = {"plot": str(out_dir / "loss_curves.png"), "report": str(out_dir / "report.md"),
             "results": str(out_dir / "results.json")}
    summary["files"] = files
    _plot(results, config, Path(files["plot"]))
    Path(files["report"]).write_text(_report_markdown(summary, results))
    Path(files["results"]).write_text(json.dumps(json_document("demo", summary), indent=2, allow_nan=False))
    return summary


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


STYLE = {
    "torch_fp32": dict(color="black", linestyle="-", linewidth=2.2),
    "offload_fp32": dict(color="tab:orange", linestyle="--", linewidth=1.4),
    "offload_bf16": dict(color="tab:blue", linestyle="-", linewidth=1.4),
    "naive_bf16": dict(color="tab:red", linestyle="-", linewidth=1.4),
}


def _plot(results: list[RunResult], config: DemoConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    window = max(1, config.steps // 20)
    steps = list(range(1, config.steps + 1))
    for r in results:
        axes[0].plot(steps, _smooth(r.train_loss, window), label=r.label, **STYLE[r.key])
        axes[1].plot(r.val_steps, r.val_loss, marker="o", markersize=3, label=r.label, **STYLE[r.key])
        if r.param_distance and r.key != "offload_fp32":
            axes[2].plot(r.val_steps[1:], r.param_distance, marker="o", markersize=3, label=r.label, **STYLE[r.key])
    axes[0].set_title(f"train loss (moving mean of {window})")
    axes[1].set_title("validation loss")
    axes[2].set_title("distance to the float32 reference\n||θ − θ_ref|| / ||θ_ref − θ_0||")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("cross-entropy (nats/byte)")
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.suptitle("OffloadAdamW vs torch.optim.AdamW vs a naive bf16 offload (same init, same batches)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _report_markdown(summary: dict[str, Any], results: list[RunResult]) -> str:
    n = summary["n_params"]
    cfg = summary["config"]
    lines = [
        "# offload-adamw demo",
        "",
        f"A byte-level LlamaForCausalLM with {n / 1e6:.2f} M parameters, trained {cfg['steps']} steps "
        f"(batch {cfg['batch_size']} x {cfg['seq_len']} bytes of the Python standard library's sources, warmup-cosine lr "
        f"{cfg['lr']}, weight decay {cfg['weight_decay']}) four times from the same initial weights on the same batches. "
        f"torch {summary['machine']['torch']}, {summary['machine']['threads']} threads; the whole demo took "
        f"{summary['seconds']:.0f} s.",
        "",
        f"Weights start at std {cfg['init_std']} (the scale of a trained model's weights at this width) and the peak lr "
        "is fine-tuning-sized: the regime where a bf16 update smaller than half the spacing of its weight "
        "(|w|·2⁻⁹) is lost. The bf16 runs hold parameters and gradients in bf16 and compute in float32, so the "
        "optimizer is the only difference between the runs.",
        "",
        "| run | final train loss | final val loss | max param diff vs ref | max loss diff vs ref | distance to ref | "
        "unmoved elements | optimizer state | ms/step (optimizer) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        info = summary["runs"][r.key]
        diff = "-" if r.max_param_diff is None else f"{r.max_param_diff:.3g}"
        ldiff = "-" if r.max_loss_diff is None else f"{r.max_loss_diff:.3g}"
        dist = "-" if not r.param_distance else f"{r.param_distance[-1]:.3f}"
        lines.append(
            f"| {r.label} | {r.train_loss[-1]:.4f} | {r.val_loss[-1]:.4f} | {diff} | {ldiff} | {dist} | "
            f"{100 * r.unmoved_fraction:.2f}% (norms {100 * r.norm_weights_unmoved:.0f}%) | "
            f"{_fmt_bytes(r.state_bytes)} ({r.state_bytes / n:.1f} B/param) | "
            f"{info['median_step_ms']:.0f} ({info['median_optimizer_ms']:.1f}) |"
        )
    by_key = {r.key: r for r in results}
    lines += ["", "## What it shows", ""]
    off32 = by_key["offload_fp32"]
    lines.append(
        f"- OffloadAdamW in float32 computes torch's AdamW exactly: largest parameter difference "
        f"{off32.max_param_diff}, largest loss difference {off32.max_loss_diff}."
    )
    ob, nb = by_key["offload_bf16"], by_key["naive_bf16"]
    lines.append(
        f"- On the bf16 model, OffloadAdamW ends at distance {ob.param_distance[-1]:.3f} from the float32 reference "
        f"(relative to how far the reference travelled), the naive offload at {nb.param_distance[-1]:.3f}; final "
        f"validation loss {ob.val_loss[-1]:.4f} vs {nb.val_loss[-1]:.4f} (reference {by_key['torch_fp32'].val_loss[-1]:.4f})."
    )
    lines.append(
        f"- Elements that never changed: {100 * ob.unmoved_fraction:.2f}% with OffloadAdamW, "
        f"{100 * nb.unmoved_fraction:.2f}% with the naive offload; of the RMSNorm weights "
        f"{100 * ob.norm_weights_unmoved:.0f}% vs {100 * nb.norm_weights_unmoved:.0f}% (a bf16 1.0 cannot move by less "
        "than about 0.002 per step, so updates made in bf16 vanish; a float32 master accumulates them)."
    )
    lines += ["", "## Memory bill", ""]
    lines.append(
        "Optimizer state measured above, per parameter: float32 AdamW keeps m and v (8 B); OffloadAdamW on a bf16 model "
        "keeps a float32 master, m and v in host memory (12 B), beside the 2 B bf16 parameter and 2 B gradient; "
        "the naive offload saves memory by keeping m and v in bf16 (4 B), which is exactly what breaks it."
    )
    bill = summary["planner"]
    if bill.get("available"):
        lines += [
            "",
            "The planner's bill for this model with bf16 parameters and OffloadAdamW (docs/contract.md, section Memory bill):",
            "",
            "| item | bytes | per parameter |",
            "|---|---|---|",
        ]
        for item, nbytes in bill["bill"].items():
            lines.append(f"| {item} | {_fmt_bytes(nbytes)} | {nbytes / n:.1f} B |")
        predicted, measured = bill["predicted_host_optimizer_bytes"], bill["measured_host_optimizer_bytes"]
        lines += ["", f"Host bytes of OffloadAdamW's state: planner {predicted:,}, measured in the bf16 run {measured:,}"
                  f" ({'equal' if predicted == measured else 'DIFFERENT'})."]
    else:
        lines += ["", f"(Planner bill not included: {bill['reason']}.)"]
    lines += ["", "## What the conformance checker finds in the naive offload", ""]
    findings = summary["conformance"]
    if findings.get("available"):
        if findings["failed"]:
            lines += ["| clause | name | measured deviation | consequence |", "|---|---|---|---|"]
            for c in findings["failed"]:
                lines.append(f"| {c['number']} | {c['name']} | {c['deviation']} | {c['consequence']} |")
        else:
            lines.append("The checker found no failing clause.")
    else:
        lines.append(f"Not run: {findings['reason']}.")
    lines += ["", "![loss curves](loss_curves.png)", ""]
    return "\n".join(lines)
