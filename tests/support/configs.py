"""The configuration table of the tests: every way OffloadAdamW runs an update, listed once, with what it supports.

Modelled on torch's ``OptimizerInfo`` table (torch/testing/_internal/common_optimizers.py), crossed with generic
tests as torch's ``TestOptimRenewed`` crosses it: a test module takes its configurations from here instead of
writing its own ``MODES`` dict, and a generic property (tests/test_optim_info.py) is written once over the table.

Three axes:

* :data:`MODES`, where the update of a host group runs in time: ``plain`` (no transfer pipeline, the update at
  step() over ``p.grad`` where it lies), ``kept`` (the pipeline, device gradients kept), ``freed`` (the pipeline,
  device gradients freed after their copy to the host, ``p.grad`` a stand-in for the host gradient) and
  ``update_in_backward`` (freed gradients, each bucket updated as soon as its gradients landed; ``bucket_bytes=1``
  so that every parameter is a bucket of its own and the updates really run during backward).
* :data:`PLACEMENTS`, where a group's update runs (docs/placement.md): ``host``, ``stream`` (streamed through the
  device), ``device`` (resident on the device). With the CPU as device every placement runs on this machine.
* :data:`WRAPPERS`, what runs the model and the backward: ``eager``, ``compiled_model`` (torch.compile's
  ``aot_eager``), ``compiled_autograd``, ``simulated`` (the production stream lane over offload_adamw.testing.simulated_cuda), and
  the 2-rank gloo runs ``DDP`` and ``FSDP2``, whose workers live in tests/support and name their cases themselves.

:data:`CONFIGS` is the cross the generic properties run over: every mode with its host placement, and each
non-host placement with its default mode (``kept``), as the project has always run them. Each entry says what it
supports (:data:`FEATURES`); a feature an entry does not support is refused, and :attr:`Entry.refusals` holds the
message the refusal must match: a generic test asserts the refusal there, never skips. :attr:`Entry.quick` says
whether the quick tier (``-m "not slow and not gpu"``) runs the entry; :func:`params` marks the others ``slow``.

One bitwise helper for every test: :func:`assert_bitwise_equal` (its message names the tensor and where they first
differ) and :func:`same_bits`, the predicate it uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import pytest
import torch

#: What an entry may support, each checked by one generic test of tests/test_optim_info.py over :data:`CONFIGS`:
#:
#: * ``accumulation``: gradients of micro-batches accumulated into ``p.grad`` (with freed gradients: into the host
#:   gradient), ``step()`` after the last;
#: * ``no_sync``: the micro-batches that only accumulate run inside ``opt.no_sync()`` (gradients kept on the device
#:   until the last one; the protocol of updates during backward);
#: * ``clip``: ``max_grad_norm`` given to the optimizer, against torch's ``clip_grad_norm_`` before torch's step;
#: * ``torch_clip``: torch's ``clip_grad_norm_`` on the model's ``p.grad`` before ``step()``;
#: * ``closure``: ``step(closure)``;
#: * ``complex``: complex parameters, trained as their real views;
#: * ``scaler``: fp16 loss scaling with OffloadGradScaler, against torch's GradScaler;
#: * ``compile``: a torch.compile'd model (``aot_eager``) and compiled autograd (the wrappers of :data:`WRAPPERS`);
#: * ``sparse``: sparse gradients (refused everywhere, as torch's fused AdamW refuses them).
FEATURES = frozenset({"accumulation", "no_sync", "clip", "torch_clip", "closure", "complex", "scaler", "compile",
                      "sparse"})

#: The refusal of a sparse gradient: the same message in every mode (optim/update.py checks before anything changes).
SPARSE_REFUSED = "does not support sparse gradients"
#: With updates during backward a gradient may be consumed before step(): touching it through p.grad is refused.
P_GRAD_REFUSED = "gradient cannot be clipped, unscaled or read through p.grad afterwards"
#: With updates during backward each parameter takes one gradient per step, during backward: the next forward (or,
#: where none is seen, as under compiled autograd, the second gradient) is refused, pointing to opt.no_sync().
ACCUMULATION_REFUSED = r"update_in_backward=True.*inside opt\.no_sync\(\)"
#: With updates during backward the updates run before GradScaler knows whether to skip the step.
SCALER_REFUSED = "update_in_backward=True cannot be combined with loss scaling"


@dataclass(frozen=True)
class Entry:
    """One row of a table: a name, the constructor's keyword arguments, what it supports and whether CI's quick tier
    runs it."""

    name: str
    options: Mapping[str, Any]
    """Keyword arguments of OffloadAdamW that select the entry (read-only)."""
    quick: bool
    """Whether the quick tier runs it (else marked ``slow`` by :func:`params`)."""
    supports: frozenset[str]
    """The features of :data:`FEATURES` the entry runs exactly as torch's AdamW would."""
    refusals: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """For each feature it does not support: a regular expression the refusal's message matches."""
    doc: str = ""

    def __post_init__(self) -> None:
        # A feature is either supported or refused, never neither: a generic test has an assertion for every entry.
        unknown = (self.supports | set(self.refusals)) - FEATURES
        assert not unknown, f"{self.name}: unknown features {sorted(unknown)}"
        assert self.supports | set(self.refusals) == FEATURES, f"{self.name}: features neither supported nor refused: " \
            f"{sorted(FEATURES - self.supports - set(self.refusals))}"
        assert not self.supports & set(self.refusals), f"{self.name}: supported and refused"

    def kwargs(self, **more: Any) -> dict[str, Any]:
        """The entry's keyword arguments with ``more`` on top."""
        return {**self.options, **more}


def _entry(name: str, options: dict[str, Any], quick: bool, supports: Iterable[str], refusals: dict[str, str],
           doc: str) -> Entry:
    return Entry(name, MappingProxyType(dict(options)), quick, frozenset(supports), MappingProxyType(dict(refusals)), doc)


_EVERYTHING_BUT_SPARSE = FEATURES - {"sparse"}
_IN_BACKWARD = FEATURES - {"sparse", "accumulation", "torch_clip", "scaler"}

MODES: dict[str, Entry] = {e.name: e for e in (
    _entry("plain", {}, True, _EVERYTHING_BUT_SPARSE, {"sparse": SPARSE_REFUSED},
           "no transfer pipeline: the update at step(), over p.grad where it lies"),
    _entry("kept", {"transfer_pipeline": True}, True, _EVERYTHING_BUT_SPARSE, {"sparse": SPARSE_REFUSED},
           "the transfer pipeline (CPU as device), device gradients kept"),
    _entry("freed", {"offload_gradients": True}, True, _EVERYTHING_BUT_SPARSE, {"sparse": SPARSE_REFUSED},
           "the transfer pipeline, device gradients freed after their copy to the host"),
    # bucket_bytes=1: one bucket per parameter, so the updates of the earlier buckets run while backward goes on
    # (one bucket for the whole model would update only after backward's end: the plain freed step again).
    _entry("update_in_backward", {"offload_gradients": True, "update_in_backward": True, "bucket_bytes": 1}, True,
           _IN_BACKWARD, {"sparse": SPARSE_REFUSED, "accumulation": ACCUMULATION_REFUSED, "torch_clip": P_GRAD_REFUSED,
                          "scaler": SCALER_REFUSED},
           "freed gradients, each bucket updated during backward as soon as its gradients landed"),
)}

PLACEMENTS: dict[str, Entry] = {e.name: e for e in (
    _entry("host", {}, True, _EVERYTHING_BUT_SPARSE, {"sparse": SPARSE_REFUSED}, "the update on the host"),
    _entry("stream", {"update_on": "stream"}, True, _EVERYTHING_BUT_SPARSE, {"sparse": SPARSE_REFUSED},
           "the states streamed through the device in chunks, the update there"),
    _entry("device", {"update_on": "device"}, True, _EVERYTHING_BUT_SPARSE, {"sparse": SPARSE_REFUSED},
           "the states resident on the device, the update there"),
)}


def config(mode: str, placement: str = "host") -> Entry:
    """The cross of a mode and a placement: named by the mode alone on the host, by the placement alone in the
    ``kept`` mode (the default once a group is placed on the device), else ``mode-placement``."""
    # a group placed on the device needs the transfer pipeline (OffloadAdamW refuses transfer_pipeline=False there)
    assert mode != "plain" or placement == "host", "the plain step updates on the host only"
    m, p = MODES[mode], PLACEMENTS[placement]
    name = mode if placement == "host" else placement if mode == "kept" else f"{mode}-{placement}"
    refusals = {**m.refusals, **p.refusals}
    supports = (m.supports & p.supports) - set(refusals)
    options = dict(m.options) if placement == "host" else {k: v for k, v in m.options.items() if k != "transfer_pipeline"}
    return _entry(name, {**options, **p.options}, m.quick and p.quick, supports, refusals, f"{m.doc}; {p.doc}")


#: The configurations every generic property runs over (tests/test_optim_info.py).
CONFIGS: dict[str, Entry] = {e.name: e for e in (
    *(config(mode) for mode in MODES),
    *(config("kept", placement) for placement in PLACEMENTS if placement != "host"),
)}


@dataclass(frozen=True)
class Wrapper:
    """What runs the model and its backward around the optimizer, and which configurations the quick tier crosses with
    it (the others run under ``-m slow``)."""

    name: str
    quick: frozenset[str]
    """The names of :data:`CONFIGS` the quick tier runs under this wrapper."""
    where: str
    """The tests that cross it with the configurations."""
    doc: str = ""


WRAPPERS: dict[str, Wrapper] = {w.name: w for w in (
    Wrapper("eager", frozenset(CONFIGS), "tests/test_optim_info.py", "the model run eagerly, in this process"),
    # The compiled runs cost about 2 s each on 2 cores: the quick tier keeps the modes it always ran compiled.
    Wrapper("compiled_model", frozenset({"plain", "kept", "freed"}), "tests/test_optim_info.py",
            "torch.compile(model, backend='aot_eager'): the compiled backward one autograd node, the hooks after it"),
    Wrapper("compiled_autograd", frozenset({"plain", "kept", "freed"}), "tests/test_optim_info.py",
            "the compiled model's backward under compiled autograd: the pipeline's hooks run as opaque calls"),
    Wrapper("simulated", frozenset({"freed", "update_in_backward", "stream", "device"}), "tests/test_optim_info.py",
            "the production stream lane on the simulated CUDA device (conftest's simulated_device fixture)"),
    # The 2-rank runs are worker processes: their test modules name their quick cases (tests/support/_quick.py);
    # what is listed here is the configurations those quick cases cover, for the reader of the table.
    Wrapper("DDP", frozenset({"kept", "freed", "update_in_backward"}),
            "tests/test_wrappers_distributed.py (kept, freed), tests/test_overlap_ddp.py (update_in_backward), "
            "tests/test_placement_distributed.py (stream, device)",
            "2 gloo ranks, DistributedDataParallel, in a worker process (tests/support/_overlap_common.py)"),
    Wrapper("FSDP2", frozenset({"kept", "freed", "update_in_backward"}),
            "tests/test_wrappers_distributed.py (kept, freed), tests/test_overlap_fsdp.py (update_in_backward, freed), "
            "tests/test_placement_distributed.py (stream, device)",
            "2 gloo ranks, fully_shard, in a worker process (tests/support/_overlap_common.py)"),
)}


def crossed(wrappers: Iterable[str], configs: Iterable[str] | None = None) -> list[Any]:
    """pytest parameters ``(config, wrapper)`` of every configuration (or ``configs``) under each of ``wrappers``, id
    ``config-wrapper``; a pair is quick when the configuration is and the wrapper names it quick, else ``slow``."""
    return [pytest.param(c, w, id=f"{c}-{w}",
                         marks=() if CONFIGS[c].quick and c in WRAPPERS[w].quick else pytest.mark.slow)
            for w in wrappers for c in (CONFIGS if configs is None else configs)]


def params(table: Mapping[str, Entry], names: Iterable[str] | None = None, *, slow: Iterable[str] = ()) -> list[Any]:
    """pytest parameters of a table's entries (all, or ``names``), each the entry's name, the entries that are not
    ``quick`` (and the names in ``slow``) marked ``slow``."""
    slow = set(slow)
    chosen = list(table) if names is None else list(names)
    return [pytest.param(n, id=n, marks=() if table[n].quick and n not in slow else pytest.mark.slow) for n in chosen]


def options(name: str, **more: Any) -> dict[str, Any]:
    """The keyword arguments of a configuration, a mode or a placement named ``name`` (in that order of lookup)."""
    for table in (CONFIGS, MODES, PLACEMENTS):
        if name in table:
            return table[name].kwargs(**more)
    raise KeyError(name)


# ---------------------------------------------------------------------------------------------------- bitwise

_AS_INTEGERS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its element size (a complex tensor: its real view's), on the host."""
    t = t.detach()
    if hasattr(t, "to_local"):  # a DTensor: the local shard
        t = t.to_local()
    t = t.cpu().contiguous()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t
    return t.view(_AS_INTEGERS[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: shape, dtype and every bit (NaN equal to the same NaN, -0.0 distinct from 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.numel() == 0 or torch.equal(_bits(a), _bits(b))


def assert_bitwise_equal(actual: Any, expected: Any, name: str = "tensor") -> None:
    """``actual`` and ``expected`` (tensors, or dicts or sequences of them) are bitwise equal; the message names the
    tensor (``name``, with the key or index inside it), and says the shape, dtype or first element that differs."""
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{name}: a {type(actual).__name__}, expected a mapping"
        assert actual.keys() == expected.keys(), f"{name}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}"
        for key in expected:
            assert_bitwise_equal(actual[key], expected[key], f"{name}[{key!r}]")
        return
    if isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)), f"{name}: a {type(actual).__name__}, expected {len(expected)} items"
        assert len(actual) == len(expected), f"{name}: {len(actual)} items, expected {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_bitwise_equal(a, e, f"{name}[{i}]")
        return
    if not isinstance(expected, torch.Tensor):
        assert actual == expected, f"{name}: {actual!r} != {expected!r}"
        return
    assert isinstance(actual, torch.Tensor), f"{name}: a {type(actual).__name__}, expected a tensor"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    if same_bits(actual, expected):
        return
    differ = _bits(actual) != _bits(expected)
    if expected.is_complex():  # the real view: a pair of bits per element
        differ = differ.any(-1)
    differ = differ.reshape(-1)
    first = int(differ.nonzero()[0].item())
    a, e = actual.detach().cpu().reshape(-1)[first].item(), expected.detach().cpu().reshape(-1)[first].item()
    raise AssertionError(f"{name}: {int(differ.sum())} of {expected.numel()} elements differ in their bits; "
                         f"the first at flat index {first}: {a!r} != {e!r}")
