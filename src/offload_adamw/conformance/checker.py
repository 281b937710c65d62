"""Check any optimizer against the AdamW contract (docs/contract.md), clause by clause.

``check(factory) -> Report`` runs each clause and reports pass, fail, error, n/a or info,
with the measured deviation and what a failure does to training. Each clause judges one
property only (how: :mod:`offload_adamw.conformance.clauses`; the attribution rules:
docs/checker.md), so a wrong formula fails clause 1 and a state or an arithmetic kept
below the contract's precision fails clause 8, and neither fails anything else.

The candidate never takes the checker down and never passes by accident
(:mod:`offload_adamw.conformance.processes`). Where fork exists and CUDA is not
initialized in this process, a spec string is imported in a forked process of its own
within the time limit (``timeout``, :data:`DEFAULT_TIMEOUT` by default, at most :data:`MAX_TIMEOUT`,
a week; an empty ``clauses`` is refused, as a check of nothing would conform): an exception,
``sys.exit``, the end of that process or a hang on import is a :class:`CandidateLoadError`
that names the candidate. Each clause then runs in a process forked from that one, two
side by side where two cores are there (clause 8, the longest, first; clause 15, a
timing, alone), each with the time limit; an exception, a hang past the limit,
``sys.exit`` or the death of the child is that clause's *error*. torch's lazily imported
optimizer modules are loaded here first (about 1 s: torch._dynamo, which every step of a
``torch.optim`` optimizer imports), and meanwhile a forked child computes the reference
trajectories, so that no clause repeats either. Before any clause, one child checks that
the device is there and that the constructor takes the canonical keywords; otherwise
:class:`UsageError` (naming the ``mapping`` that fits the constructor's signature, where
its parameter names tell).

Clauses:

1. the update on step 1 and later steps against :mod:`offload_adamw.reference` (bias
   correction, eps outside the square root, eps moved with the bias correction in
   rearranged forms; amsgrad and maximize where the candidate takes them; gradients
   orthogonal to one weight, where projections act), in float64 and in the checked
   dtype, at the precision the candidate computes in (its state's, or a narrower
   arithmetic its own run in that dtype shows: clause 8's finding). Without eps (mapped
   to null) against the reference for every eps from 1e-30 to 1e-6: a failure where none
   fits, n/a where one does (where eps goes is not seen); n/a without betas. A report
   whose clause 1 is n/a is not conforming;
2. decoupled weight decay (a shrink by exactly 1 - lr*wd) versus L2 coupled into the
   gradient, a decay scaled by anything else, or one inside a theta-dependent step;
3. decay applied to the pre-update value;
4. per-tensor step counts with grad None at some step calls;
5. an explicit zero gradient is an update;
6. lr = 0 (set in the group after construction): moments absorb the gradient, theta unchanged;
7. parameter groups keep their own hyperparameters; an lr change takes effect at its step;
8. state precision over 1051 steps on a 64x64 tensor, for float64, float32, bfloat16
   and float16 parameters: state or arithmetic narrower than the parameter (or than
   float32), the master copy and its round-to-nearest-even narrowing (also where the
   master is hidden: the parameter against the candidate's own float32 run), against the
   candidate's own widest run;
9. where the state lives between steps (info; n/a without an accelerator);
10. state_dict round trip into a fresh instance: bitwise continuation, state dtypes kept
    (in the checked dtype and in bfloat16), torch's global RNG restored at the resume
    point as a checkpoint that saves it does (and said so where the candidate draws from it);
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
``{"betas": ["beta1", "beta2"], "eps": "epsilon", "weight_decay": null}``; ``eps: null``
lets the candidate use its own) and fixed ``kwargs`` (e.g. ``{"correct_bias": true}``);
see :class:`~offload_adamw.conformance.harness.HyperMapping`. ``setup`` names methods
called on every optimizer before it steps (``["train"]`` for schedule-free ones).
Parameters are given with their names where the candidate accepts ``[(name, tensor),
...]``, else as plain tensors.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import json
import multiprocessing
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from offload_adamw.conformance.clauses import (
    CLAUSES,
    NONFINITE_POLICIES,
    REFERENCE_CLAUSES,
    Clause,
    Context,
    install_references,
    prepare_references,
    references_ready,
)
from offload_adamw.conformance.harness import Harness, HyperMapping, NotApplicable, SetupError, hyper, random_values
from offload_adamw.conformance.processes import (
    CandidateProcess,
    Pending,
    Task,
    available_workers,
    exit_text,
    run_forked,
    run_many,
)
from offload_adamw.conformance.report import ClauseResult, Report

__all__ = ["check", "load_candidate", "parse_dtype", "CandidateLoadError", "UsageError", "Report", "ClauseResult", "HyperMapping",
           "CLAUSES", "DEFAULT_TIMEOUT"]

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "fp64": torch.float64, "float64": torch.float64,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


class CandidateLoadError(ValueError):
    """The candidate named by a spec string could not be loaded (names the spec and why)."""


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
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
    except SystemExit as exc:  # a module that ends the program on import cannot be judged: never a pass
        raise CandidateLoadError(f"candidate {spec!r}: importing {where!r} called sys.exit({exc.code!r})"
                                 + _where(exc, inline=True)) from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # GeneratorExit and the like, raised by the module itself
        raise CandidateLoadError(f"candidate {spec!r}: importing {where!r} raised {type(exc).__name__}"
                                 + _where(exc, inline=True)) from None
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


class UsageError(ValueError):
    """The check cannot start: a device that is not there, or a candidate whose signature needs ``mapping``."""


DEFAULT_TIMEOUT = 120.0
MAX_TIMEOUT = 7 * 24 * 3600.0
"""The longest time limit taken (a week): what the OS waits are given must stay expressible (select refuses
about 292 years), and a longer limit is no limit; cli/check.py states it again for its usage errors."""
"""Seconds one clause may take before it is stopped and reported as an error."""


def _outcome(run: Callable[[], Any]) -> tuple[str, float | None, str]:
    """(verdict, deviation, detail) of one clause, whatever the candidate does (except ending the process)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # candidates and schedulers warn about what the clauses do on purpose
        try:
            finding = run()
            return finding.verdict, finding.deviation, finding.detail
        except NotApplicable as exc:
            return "n/a", None, str(exc)
        except SystemExit as exc:
            return "error", None, f"the candidate called sys.exit({exc.code!r})" + _where(exc)
        except Exception as exc:
            return "error", None, "the candidate raised: " + _describe_error(exc)
        except BaseException as exc:  # KeyboardInterrupt raised by the candidate, GeneratorExit, ...
            return "error", None, f"the candidate raised {type(exc).__name__}" + _where(exc)


def _where(exc: BaseException, *, inline: bool = False) -> str:
    """Where ``exc`` was raised (the innermost frame), on a line of its own or, ``inline``, on the same line."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    return ("," if inline else "\n ") + f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}"


@functools.lru_cache(maxsize=1)
def _import_lazily_loaded_modules() -> None:
    """Step torch's own AdamW once here: its first step imports modules (torch._dynamo, about 1 s) that
    every forked child would otherwise import again."""
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    variants: tuple[dict[str, Any], ...] = ({"foreach": False}, {"foreach": True}, {"fused": True})
    for options in variants:
        try:
            torch.optim.AdamW([p], **options).step()
        except Exception:  # an implementation this build lacks
            pass


def can_isolate(device: torch.device) -> bool:
    """Clauses run in forked children where fork exists and CUDA is not yet initialized here (a forked child cannot use it)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    return not (torch.cuda.is_initialized() if hasattr(torch.cuda, "is_initialized") else False)


def _signature_hint(factory: Any, mapping: HyperMapping) -> str:
    """The ``--map`` that fits the candidate's signature, as far as its parameter names tell ("" when they tell nothing)."""
    try:
        names = set(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return ""
    spellings = {
        "lr": ("lr", "learning_rate"),
        "eps": ("eps", "epsilon"),
        "weight_decay": ("weight_decay", "wd", "decay", "weight_decay_rate"),
        "amsgrad": ("amsgrad",),
        "maximize": ("maximize",),
    }
    suggestion: dict[str, Any] = dict(mapping.names)
    for canonical, options in spellings.items():
        if canonical in mapping.names:
            continue
        found = next((o for o in options if o in names), None)
        if found is None and canonical != "lr":
            suggestion[canonical] = None
        elif found is not None and found != canonical:
            suggestion[canonical] = found
    if "betas" not in mapping.names and "betas" not in names:
        pair = next((list(pp) for pp in (("beta1", "beta2"), ("b1", "b2"), ("beta_1", "beta_2")) if set(pp) <= names), None)
        if pair is not None:
            suggestion["betas"] = pair
    if suggestion == dict(mapping.names):
        return ""
    return "; try --map '" + json.dumps(suggestion) + "'"


def _preflight(harness: Harness, dtype: torch.dtype) -> dict[str, Any]:
    """Before any clause: is the device there, and does the candidate take the canonical keywords?"""
    try:
        torch.empty(1, device=harness.device)
    except Exception as exc:
        return {"device": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"}
    values = hyper(lr=1e-3, weight_decay=0.01 if harness.mapping.accepts("weight_decay") else 0.0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            harness.build(harness.params({"w": random_values(1, (4,), 0.5, 2.0)}, dtype), values)
    except SetupError as exc:
        return {"setup": str(exc)}
    except TypeError as exc:
        if "keyword argument" in str(exc):
            return {"signature": str(exc).strip().splitlines()[0], "named": harness.named}
    except BaseException:  # the clauses show the candidate's error where it matters
        pass
    return {"named": harness.named}


def _name_of(factory: Any) -> str:
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", None) or type(factory).__qualname__
    return f"{module}:{qualname}" if module else str(qualname)


@dataclass(frozen=True, kw_only=True)
class _Plan:
    """What one check runs: everything the process that holds the candidate needs, decided before it is forked."""

    candidate: str | Callable[..., Any]
    """The spec string (imported where the clauses run) or the factory itself."""
    mapping: HyperMapping
    device: torch.device
    setup: tuple[str, ...]
    dtype: torch.dtype
    nonfinite_policy: str | None
    clauses: tuple[Clause, ...]
    timeout: float
    workers: int


def _usage_problem(found: Mapping[str, Any], device: torch.device, hint: str) -> str | None:
    """The one-line usage error the preflight's findings make, or None."""
    if "device" in found:
        return f"device {str(device)!r} is not usable here: {found['device']}"
    if "setup" in found:
        return str(found["setup"])
    if "signature" in found:
        return f"the candidate does not take the canonical AdamW keywords ({found['signature']})" + hint
    return None


def _clause_order(clauses: Sequence[Clause]) -> list[Clause]:
    """Long clauses first, so that the others run beside them; a timing (alone) last."""
    return sorted(clauses, key=lambda c: (c.alone, not c.long, c.number))


def _candidate_process_main(plan: _Plan, send: Callable[[Any], None]) -> None:
    """Runs in the process that holds the candidate: import it, preflight it, run the clauses, send each result."""
    try:
        factory = load_candidate(plan.candidate) if isinstance(plan.candidate, str) else plan.candidate
    except CandidateLoadError as exc:
        send(("load-error", str(exc)))
        return
    except BaseException as exc:  # KeyboardInterrupt raised by the module itself (this process has no terminal)
        send(("load-error", f"candidate {plan.candidate!r}: importing it raised {type(exc).__name__}"
                            + _where(exc, inline=True)))
        return
    if plan.device.type == "cuda" and torch.cuda.is_initialized():
        send(("load-error", f"candidate {plan.candidate!r}: importing it initialized CUDA, so its clauses cannot run in "
                            "forked processes; call check(..., isolate=False) from Python instead"))
        return
    send(("loaded",))
    harness = Harness(factory, plan.mapping, device=plan.device, setup=plan.setup)
    ran, found = run_forked(lambda: _preflight(harness, plan.dtype), plan.timeout)
    hint = _signature_hint(factory, plan.mapping) if ran and "signature" in found else ""
    send(("preflight", ran, found, hint))
    if not ran or _usage_problem(found, plan.device, hint) is not None:
        return
    if found.get("named") is not None:
        harness.named = found["named"]
    ctx = Context(harness=harness, dtype=plan.dtype, nonfinite_policy=plan.nonfinite_policy)
    tasks = [Task(c.number, functools.partial(_outcome, functools.partial(c.run, ctx)), alone=c.alone)
             for c in _clause_order(plan.clauses)]
    for number, ran, outcome in run_many(tasks, plan.timeout, workers=plan.workers):
        verdict, deviation, detail = outcome if ran else ("error", None, outcome)
        send(("result", number, verdict, deviation, detail))
    send(("done",))


_GRACE_SECONDS = 30.0
"""How much longer than a clause's time limit the process that holds the candidate may take to answer."""


def _run_forked_check(plan: _Plan, name: str, report: Report, progress: Any) -> None:
    """The clauses' results, from the process that holds the candidate, into ``report`` (in clause order)."""
    needs_references = any(c.number in REFERENCE_CLAUSES for c in plan.clauses)
    numbers = [c.number for c in plan.clauses]
    missing = needs_references and not references_ready(numbers, mapping_accepts=plan.mapping.accepts)
    references = Pending(lambda: prepare_references(numbers, mapping_accepts=plan.mapping.accepts)) if missing else None
    try:
        _import_lazily_loaded_modules()  # meanwhile the references are computed beside this
    except BaseException:
        if references is not None:  # an interrupt: the child is ended here, not waited for at exit
            references.cancel()
        raise
    if references is not None:
        ran, data = references.result(plan.timeout + _GRACE_SECONDS)
        install_references(data if ran else prepare_references(numbers, mapping_accepts=plan.mapping.accepts))
    process = CandidateProcess(functools.partial(_candidate_process_main, plan))
    found: dict[int, tuple[str, float | None, str]] = {}
    try:
        kind, message = process.receive(plan.timeout)
        if kind == "late":
            raise CandidateLoadError(f"candidate {name!r}: importing it did not finish within {plan.timeout:g} s "
                                     "(the module hangs or is too slow; see --timeout)")
        if kind == "ended":
            raise CandidateLoadError(f"candidate {name!r}: importing it ended the process ({exit_text(message)}) "
                                     "before the candidate could be checked")
        if message[0] == "load-error":
            raise CandidateLoadError(message[1])
        kind, message = process.receive(plan.timeout + _GRACE_SECONDS)
        lost = _lost_text(kind, message, "while building one optimizer")
        if lost is None:
            _, ran, preflight, hint = message
            problem = _usage_problem(preflight, plan.device, hint) if ran else None
            if problem is not None:
                raise UsageError(problem)
            if not ran:  # building one optimizer hangs or ends the process: every clause would, one time limit each
                lost = "building one optimizer: " + preflight.replace("the clause", "it", 1)
        while lost is None and len(found) < len(plan.clauses):
            kind, message = process.receive(plan.timeout + _GRACE_SECONDS)
            lost = _lost_text(kind, message, "while the clauses ran")
            if lost is None and message[0] == "result":
                found[message[1]] = message[2:]
                progress.update(1)
        for clause in plan.clauses:
            verdict, deviation, detail = found.get(clause.number, ("error", None, lost or ""))
            report.results.append(ClauseResult(number=clause.number, name=clause.name, verdict=verdict,
                                               deviation=deviation, consequence=clause.consequence, detail=detail))
    finally:
        process.close()


def _lost_text(kind: str, message: Any, when: str) -> str | None:
    """Why the process that holds the candidate gave no answer (None when it answered)."""
    if kind == "ended":
        return (f"the process that imported the candidate ended ({exit_text(message)}) {when}: something the candidate's "
                "module started on import ends it")
    if kind == "late":
        return f"the process that imported the candidate stopped answering {when}"
    return None


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def check(
    factory: str | Callable[..., Any],
    *,
    dtype: str | torch.dtype = torch.float32,
    kwargs: Mapping[str, Any] | None = None,
    mapping: Mapping[str, Any] | HyperMapping | None = None,
    clauses: Iterable[int] | None = None,
    nonfinite_policy: str | None = None,
    device: str | torch.device = "cpu",
    progress: bool = False,
    setup: Sequence[str] = (),
    timeout: float = DEFAULT_TIMEOUT,
    isolate: bool | None = None,
    workers: int | None = None,
) -> Report:
    """Check a candidate optimizer against every clause (or ``clauses``) and return the Report.

    ``setup`` names methods called on every optimizer the checker builds, before it steps
    (``["train"]`` for schedule-free optimizers). With isolation (``isolate``; default:
    wherever fork exists and CUDA is not initialized in this process) a spec string is
    imported in a forked process, never here, within ``timeout`` seconds; each clause runs in
    a process forked from that one and is stopped after ``timeout`` seconds, at most
    ``workers`` clauses at a time (default: two where two cores are there): a hang, a crash or
    ``sys.exit`` in the candidate is that clause's error, never a pass. Without isolation the
    candidate is imported and the clauses run here, one after another, with no time limit.

    Raises :class:`CandidateLoadError` when a spec string cannot be loaded (it raises, exits,
    ends its process or hangs on import), :class:`UsageError` when the device is not there or
    the candidate's signature does not take the canonical keywords (the message suggests the
    ``mapping``), ValueError for other invalid arguments; never because of what the candidate
    does once loaded.
    """
    name = factory if isinstance(factory, str) else _name_of(factory)
    if not isinstance(factory, str) and not callable(factory):
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
    if not wanted:  # a check of nothing would be reported conforming
        raise ValueError("no clause to run: clauses is empty; name at least one, or pass None for all")
    if wanted - known:
        raise ValueError(f"unknown clause number(s) {sorted(wanted - known)}; clauses are 1-{max(known)}")

    if not (isinstance(timeout, (int, float)) and 0 < timeout <= MAX_TIMEOUT):  # NaN and inf fail too
        raise ValueError(f"timeout must be a number of seconds above 0 and at most {MAX_TIMEOUT:g} (a week), "
                         f"got {timeout!r}")
    if workers is not None and not (isinstance(workers, int) and workers >= 1):
        raise ValueError(f"workers must be a positive whole number, got {workers!r}")
    setup = [setup] if isinstance(setup, str) else list(setup)
    for method in setup:
        if not (isinstance(method, str) and method.isidentifier()):
            raise ValueError(f"setup: {method!r} is not a method name")
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"device {device!r}: {exc}") from None

    use_fork = can_isolate(torch_device) if isolate is None else bool(isolate)
    if use_fork and not can_isolate(torch_device):
        raise ValueError("isolate=True needs fork and a process that has not initialized CUDA")
    selected = tuple(c for c in CLAUSES if c.number in wanted)
    plan = _Plan(candidate=factory, mapping=hyper_mapping, device=torch_device, setup=tuple(setup), dtype=torch_dtype,
                 nonfinite_policy=nonfinite_policy, clauses=selected, timeout=float(timeout),
                 workers=available_workers() if workers is None else workers)
    report = Report(candidate=name, dtype=str(torch_dtype).replace("torch.", ""), device=str(torch_device),
                    timeout=plan.timeout if use_fork else None)
    bar: Any = _NoProgress()
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(selected), desc=f"checking {name}", unit="clause", leave=False)
    start = time.perf_counter()
    try:
        if use_fork:
            _run_forked_check(plan, name, report, bar)
        else:
            _run_here(plan, report, bar)
    finally:
        bar.close()
    report.seconds = time.perf_counter() - start
    return report


def _run_here(plan: _Plan, report: Report, progress: Any) -> None:
    """The clauses in this process, one after another, without a time limit."""
    factory = load_candidate(plan.candidate) if isinstance(plan.candidate, str) else plan.candidate
    harness = Harness(factory, plan.mapping, device=plan.device, setup=plan.setup)
    found = _preflight(harness, plan.dtype)
    problem = _usage_problem(found, plan.device, _signature_hint(factory, plan.mapping) if "signature" in found else "")
    if problem is not None:
        raise UsageError(problem)
    if found.get("named") is not None:
        harness.named = found["named"]
    ctx = Context(harness=harness, dtype=plan.dtype, nonfinite_policy=plan.nonfinite_policy)
    install_references(prepare_references([c.number for c in plan.clauses], mapping_accepts=plan.mapping.accepts))
    for clause in plan.clauses:
        verdict, deviation, detail = _outcome(functools.partial(clause.run, ctx))
        report.results.append(ClauseResult(number=clause.number, name=clause.name, verdict=verdict,
                                           deviation=deviation, consequence=clause.consequence, detail=detail))
        progress.update(1)
