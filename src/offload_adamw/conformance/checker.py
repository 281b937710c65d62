"""Check any optimizer against the AdamW contract (docs/contract.md), clause by clause.

``check(factory) -> Report`` runs each clause on small tensors and reports pass, fail,
n/a or info, with the measured deviation and what a failure does to training. The
candidate never crashes the checker: an exception inside a clause fails that clause and
the report shows it.

Clauses (how each is isolated from the others: :mod:`offload_adamw.conformance.clauses`):

1. the update on step 1 and later steps against :mod:`offload_adamw.reference` (bias
   correction, eps outside the square root, eps moved with the bias correction in
   rearranged forms; amsgrad and maximize where the candidate takes them), in float64
   when the candidate takes float64 parameters and in the checked dtype;
2. decoupled weight decay versus L2 coupled into the gradient;
3. decay applied to the pre-update value;
4. per-tensor step counts with grad None at some step calls;
5. an explicit zero gradient is an update;
6. lr = 0: moments absorb the gradient, theta unchanged;
7. parameter groups keep their own hyperparameters; LR scheduler changes are honoured;
8. bf16 and fp16 parameters over 1051 steps (v decay over 1000 zero-gradient steps,
   weight decay, small updates) against the candidate's own float32 run, and each run's
   distance to the reference;
9. where the state lives between steps (info; n/a without an accelerator);
10. state_dict round trip into a fresh instance: bitwise continuation, state dtypes kept
    (in the checked dtype and in bfloat16);
11. resume into an optimizer over the parameters in another order: correct by name, or
    refused with an error (pass); silently given to the wrong tensor (fail);
12. NaN lr, negative lr/eps/weight_decay, beta1 = 1, beta2 = 1 are rejected at construction;
13. non-finite gradients: the behaviour (propagate, skip, raise) is reported; it fails
    only against a declared policy: ``nonfinite_policy=`` or, when that is None, the
    candidate's own ``nonfinite`` attribute (as OffloadAdamW has);
14. torch.amp.GradScaler's found_inf step leaves no trace. Support counts as advertised
    when the candidate is a ``torch.optim.Optimizer`` (GradScaler drives any of them
    through ``unscale_`` and by not calling ``step()``, or through the optimizer's own
    ``_step_supports_amp_scaling`` path); otherwise n/a;
15. the cost of one step on 262,144 elements relative to ``torch.optim.AdamW(fused=True)``
    (info; the ratio is in the deviation column).

Candidates: a factory ``factory(params, **hyperparameters) -> optimizer`` (a class
works), or a string ``"package.module:Class"`` / ``"path/to/file.py:Class"``. Other
signatures are driven through ``mapping`` (canonical name -> the candidate's name, e.g.
``{"betas": ["beta1", "beta2"], "eps": "epsilon", "weight_decay": null}``) and fixed
``kwargs`` (e.g. ``{"correct_bias": true}``); see
:class:`~offload_adamw.conformance.harness.HyperMapping`. Parameters are given with their
names where the candidate accepts ``[(name, tensor), ...]``, else as plain tensors.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch

from offload_adamw.conformance.clauses import CLAUSES, NONFINITE_POLICIES, Context
from offload_adamw.conformance.harness import Harness, HyperMapping, NotApplicable
from offload_adamw.conformance.report import ClauseResult, Report

__all__ = ["check", "load_candidate", "parse_dtype", "CandidateLoadError", "Report", "ClauseResult", "HyperMapping", "CLAUSES"]

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "fp64": torch.float64, "float64": torch.float64,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


class CandidateLoadError(ValueError):
    """The candidate named by a spec string could not be loaded (names the spec and why)."""


def parse_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported parameter dtype {dtype}; choose one of {sorted(set(DTYPES))}")
        return dtype
    key = str(dtype).lower().replace("torch.", "")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[key]


def load_candidate(spec: str) -> Callable[..., Any]:
    """``"module:Attr"`` or ``"path/to/file.py:Attr"`` (``Attr`` may be dotted) -> the object."""
    if not isinstance(spec, str) or ":" not in spec:
        raise CandidateLoadError(f"candidate {spec!r}: expected 'module:Class' or 'path/to/file.py:Class'")
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise CandidateLoadError(f"candidate {spec!r}: expected 'module:Class' or 'path/to/file.py:Class'")
    try:
        if where.endswith(".py") or "/" in where or "\\" in where:
            path = Path(where).expanduser().resolve()
            if not path.is_file():
                raise CandidateLoadError(f"candidate {spec!r}: no such file {str(path)!r}")
            module_name = f"_offload_adamw_candidate_{abs(hash(str(path)))}"
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            if module_spec is None or module_spec.loader is None:
                raise CandidateLoadError(f"candidate {spec!r}: cannot import {str(path)!r}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module  # dataclasses and pickling look modules up here
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(module_name, None)
                raise
        else:
            module = importlib.import_module(where)
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except CandidateLoadError:
        raise
    except AttributeError as exc:
        raise CandidateLoadError(f"candidate {spec!r}: {where!r} has no attribute {attr!r} ({exc})") from exc
    except Exception as exc:
        raise CandidateLoadError(f"candidate {spec!r}: importing {where!r} failed: {type(exc).__name__}: {exc}") from exc
    if not callable(obj):
        raise CandidateLoadError(f"candidate {spec!r}: {attr!r} is a {type(obj).__name__}, not a class or factory")
    return obj


def _describe_error(exc: BaseException) -> str:
    """The exception and the innermost frame it came from (the candidate's line, usually)."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f"\n  at {last.filename}:{last.lineno} in {last.name}"
    return text


def _name_of(factory: Any) -> str:
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", None) or type(factory).__qualname__
    return f"{module}:{qualname}" if module else str(qualname)


def check(
    factory: Union[str, Callable[..., Any]],
    *,
    dtype: Union[str, torch.dtype] = torch.float32,
    kwargs: Optional[Mapping[str, Any]] = None,
    mapping: Optional[Union[Mapping[str, Any], HyperMapping]] = None,
    clauses: Optional[Iterable[int]] = None,
    nonfinite_policy: Optional[str] = None,
    device: Union[str, torch.device] = "cpu",
    progress: bool = False,
) -> Report:
    """Check a candidate optimizer against every clause (or ``clauses``) and return the Report.

    Raises :class:`CandidateLoadError` when a spec string cannot be loaded, ValueError for
    invalid arguments; never because of what the candidate does once loaded.
    """
    name = factory if isinstance(factory, str) else _name_of(factory)
    if isinstance(factory, str):
        factory = load_candidate(factory)
    elif not callable(factory):
        raise CandidateLoadError(f"candidate {factory!r} is not callable")
    torch_dtype = parse_dtype(dtype)
    if isinstance(mapping, HyperMapping):
        if kwargs:
            mapping = HyperMapping(names=mapping.names, extra={**mapping.extra, **kwargs})
        hyper_mapping = mapping
    else:
        hyper_mapping = HyperMapping(names=dict(mapping or {}), extra=dict(kwargs or {}))
    if nonfinite_policy is not None and nonfinite_policy not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite_policy must be one of {NONFINITE_POLICIES} or None, got {nonfinite_policy!r}")
    known = {c.number for c in CLAUSES}
    wanted = known if clauses is None else set(clauses)
    if wanted - known:
        raise ValueError(f"unknown clause number(s) {sorted(wanted - known)}; clauses are 1-{max(known)}")

    ctx = Context(harness=Harness(factory, hyper_mapping, device=device), dtype=torch_dtype, nonfinite_policy=nonfinite_policy)
    report = Report(candidate=name, dtype=str(torch_dtype).replace("torch.", ""), device=str(torch.device(device)))
    selected = [c for c in CLAUSES if c.number in wanted]
    iterator: Iterable[Any] = selected
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(selected, desc=f"checking {name}", unit="clause", leave=False)
    start = time.perf_counter()
    for clause in iterator:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # candidates and schedulers warn about what the clauses do on purpose
            try:
                finding = clause.run(ctx)
                verdict, deviation, detail = finding.verdict, finding.deviation, finding.detail
            except NotApplicable as exc:
                verdict, deviation, detail = "n/a", None, str(exc)
            except Exception as exc:
                verdict, deviation, detail = "fail", None, "the candidate raised: " + _describe_error(exc)
        report.results.append(ClauseResult(number=clause.number, name=clause.name, verdict=verdict,
                                           deviation=deviation, consequence=clause.consequence, detail=detail))
    report.seconds = time.perf_counter() - start
    return report
