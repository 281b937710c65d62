"""The conformance checker on real optimizers: torch's AdamW (three implementations),
OffloadAdamW, a correct textbook AdamW, and a table of optimizers each broken in one way.

Every candidate is checked once (module-scoped fixtures); the tests read the reports.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import broken_optimizers as broken
from offload_adamw import OffloadAdamW
from offload_adamw.conformance import CLAUSES, CandidateLoadError, UsageError, check, load_candidate
from offload_adamw.conformance.harness import HyperMapping, NotApplicable, Tolerance, compare

ALL = [c.number for c in CLAUSES]
# The table of broken optimizers skips clause 15 (a timing, info only, never judged).
JUDGED = [n for n in ALL if n != 15]
PLACEMENT = "info" if torch.cuda.is_available() else "n/a"

TORCH_IMPLS = {
    "for_loop": {"foreach": False, "fused": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def torch_adamw(impl: str):
    options = TORCH_IMPLS[impl]

    def factory(params, **hyper):
        return torch.optim.AdamW(params, **hyper, **options)

    factory.__qualname__ = f"torch.optim.AdamW[{impl}]"
    return factory


@pytest.fixture(scope="module")
def torch_reports():
    return {impl: check(torch_adamw(impl)) for impl in TORCH_IMPLS}


@pytest.fixture(scope="module")
def offload_report():
    return check(OffloadAdamW)


class _ReportsByClass(dict):
    """Each class checked once, when a test first asks for it (so that no single test carries the whole table)."""

    def __missing__(self, cls):
        self[cls] = report = check(cls, clauses=JUDGED, mapping=getattr(cls, "CHECK_MAPPING", None))
        return report


@pytest.fixture(scope="module")
def broken_reports():
    return _ReportsByClass()


def verdicts(report) -> dict[int, str]:
    return {r.number: r.verdict for r in report.results}


# ----------------------------------------------------------------------------- real optimizers

@pytest.mark.parametrize("impl", list(TORCH_IMPLS))
def test_torch_adamw_fails_precision_and_name_mapping_only(torch_reports, impl):
    report = torch_reports[impl]
    got = verdicts(report)
    expected = {n: "pass" for n in ALL}
    expected.update({8: "fail", 9: PLACEMENT, 11: "fail", 13: "info", 15: "info"})
    assert got == expected, report.to_table()
    # Clause 8: torch keeps bf16 moments for bf16 parameters (and fp16 ones for fp16), and says so;
    # its float32 and float64 runs keep state as wide as the parameter and are not blamed.
    precision = report.result(8)
    assert "bfloat16 parameters: state narrower than float32: exp_avg bfloat16, exp_avg_sq bfloat16" in precision.detail
    assert "float16 parameters: state narrower than float32: exp_avg float16" in precision.detail
    assert "float32 parameters" not in precision.detail and "float64 parameters" not in precision.detail
    assert "master copy: no" in precision.detail
    assert precision.deviation > 0.1  # weight decay and small updates vanish: far beyond one bf16 ulp
    # Clause 11: order-based loading hands one tensor's moments to the other.
    assert "silently" in report.result(11).detail and report.result(11).deviation > 1e-3
    assert "behaviour: propagate" in report.result(13).detail
    assert report.result(15).deviation > 0  # the ratio to torch's fused AdamW


def test_offload_adamw_passes_every_clause(offload_report):
    got = verdicts(offload_report)
    expected = {n: "pass" for n in ALL}
    expected.update({9: PLACEMENT, 15: "info"})
    assert got == expected, offload_report.to_table()
    assert offload_report.failed == []
    # Clause 13 is judged against the policy OffloadAdamW advertises (nonfinite="propagate").
    assert "advertised" in offload_report.result(13).detail
    assert "master copy: yes" in offload_report.result(8).detail


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_offload_nonfinite_policies_are_kept(policy):
    report = check(OffloadAdamW, kwargs={"nonfinite": policy}, clauses=[13])
    assert report.result(13).verdict == "pass", report.result(13).detail
    assert f"behaviour: {policy};" in report.result(13).detail


def test_a_declared_policy_the_candidate_does_not_keep_fails():
    report = check(torch.optim.AdamW, nonfinite_policy="skip", clauses=[13])
    assert report.result(13).verdict == "fail"
    assert "behaviour: propagate" in report.result(13).detail


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp64"])
def test_other_parameter_dtypes(dtype):
    # What the README states as measured: OffloadAdamW fails nothing, torch's AdamW clauses 8 and 11.
    offload = check(OffloadAdamW, dtype=dtype, clauses=JUDGED)
    assert offload.failed == [] and offload.conforming, offload.to_table()
    assert offload.dtype == {"bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}[dtype]
    torch_report = check(torch.optim.AdamW, dtype=dtype, clauses=JUDGED)
    assert [r.number for r in torch_report.failed] == [8, 11], torch_report.to_table()


def plain_tensors_only(params, **hyper):
    params = list(params)
    if any(isinstance(p, tuple) or (isinstance(p, dict) and isinstance(p["params"][0], tuple)) for p in params):
        raise TypeError("this optimizer takes tensors, not (name, tensor) pairs")
    return torch.optim.AdamW(params, **hyper)


def test_candidates_without_parameter_names_get_plain_tensors():
    report = check(plain_tensors_only, clauses=[1, 7, 11])
    assert verdicts(report) == {1: "pass", 7: "pass", 11: "fail"}, report.to_table()
    assert "takes no parameter names" in report.result(11).detail


# ----------------------------------------------------------------------------- the broken table

@pytest.mark.parametrize("cls", list(broken.CORRECT), ids=lambda c: c.__name__)
def test_correct_optimizers_pass_every_judged_clause(broken_reports, cls):
    # TextbookAdamW, and the same rule in torch's fused order of operations (another rounding, same law).
    report = broken_reports[cls]
    assert report.failed == [] and report.conforming, report.to_table()


@pytest.mark.parametrize("cls", list(broken.BROKEN), ids=lambda c: c.__name__)
def test_each_broken_optimizer_is_flagged_by_its_clause_only(broken_reports, cls):
    report = broken_reports[cls]
    clauses = broken.BROKEN[cls]
    assert tuple(r.number for r in report.failed) == clauses, report.to_table()
    for clause in clauses:
        flagged = report.result(clause)
        assert flagged.verdict == "fail"  # flagged by a measurement, not by a crash
        # float32 state on float64 parameters costs ~7e-5 over 1051 steps, against ~1e-14 for float64 state
        assert flagged.deviation is None or flagged.deviation > 1e-5


def test_precision_findings_name_the_property_and_the_dtype(broken_reports):
    detail = broken_reports[broken.Float32State].result(8).detail
    assert "float64 parameters: state narrower than float64: exp_avg float32, exp_avg_sq float32" in detail
    assert "float32 parameters" not in detail.split("\none ")[0]  # float32 state is what float32 parameters need
    # Clause 1 ran float64 at the candidate's float32 precision and found the formula right.
    assert "float64 plain" in broken_reports[broken.Float32State].result(1).detail
    assert "float32 arithmetic as the candidate's state" in broken_reports[broken.Float32State].result(1).detail
    truncated = broken_reports[broken.TruncatedMaster].result(8).detail
    assert "not the round-to-nearest-even copy of its master" in truncated and "truncated toward zero" in truncated
    assert "bfloat16 parameters: state narrower" in broken_reports[broken.MomentsInParamDtype].result(8).detail
    assert "ends" in broken_reports[broken.NoMasterCopy].result(8).detail  # small updates and decay vanish
    read_once = broken_reports[broken.LrReadOnce].result(7).detail
    assert "has no effect on the step it is made for" in read_once


def test_each_finding_is_put_where_it_belongs(broken_reports):
    # Arithmetic narrower than the state: the formula is right in float32 (clause 1), the narrowing is clause 8's.
    narrowed = broken_reports[broken.Float32Arithmetic]
    assert "float32 arithmetic, narrower than the candidate's float64 state" in narrowed.result(1).detail
    assert "float64 parameters: computed in float32 arithmetic although its state is float64" in narrowed.result(8).detail
    # A master hidden from the checker, narrowed by truncation or by stochastic rounding: seen on the parameter.
    hidden = broken_reports[broken.HiddenTruncatedMaster].result(8).detail
    assert "not the round-to-nearest-even copy of the candidate's float32 run" in hidden and "truncated toward zero" in hidden
    stochastic = broken_reports[broken.StochasticRoundingMaster]
    assert "another rounding" in stochastic.result(8).detail
    assert "draws from torch's global RNG" in stochastic.result(10).detail  # and the round trip passes with it restored
    # Decay inside a trust-ratio-scaled step is judged (one step from a fresh state), not n/a.
    inside = broken_reports[broken.TrustRatioDecayInside]
    assert "goes through the theta-dependent step" in inside.result(2).detail
    assert inside.result(3).verdict == "n/a" and "clause 2" in inside.result(3).detail
    assert verdicts(broken_reports[broken.TrustRatioDecoupled])[2] == "pass"
    # A decay scaled by a statistic of v over every tensor: clause 2's, not the order's, the groups' or the step count's.
    scaled = broken_reports[broken.DecayScaledByRmsOfV]
    assert "not by 1 - lr*wd" in scaled.result(3).detail
    assert "the decay depends on other tensors, clause 2's finding" in scaled.result(4).detail
    assert "the decay depends on the other group's tensors, clause 2's finding" in scaled.result(7).detail
    # A sign-based update on a cold state: sign(0) against sign(tiny) is no zero-gradient finding.
    assert "midpoint" in broken_reports[broken.SignMomentumTakesEps].result(5).detail
    assert "for every eps from 1e-30 to 1e-06" in broken_reports[broken.SignMomentumNoEps].result(1).detail


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp64"])
def test_a_decay_with_a_capped_lr_fails_clause_2_at_every_dtype(dtype):
    # The cap changes the decay factor by a few per cent of lr*wd: with s = 1 - lr*wd = 0.5 that is more than a
    # bfloat16 ulp of theta at every step, so a parameter seen only in bf16 shows it too.
    report = check(broken.DecayLrCapped, dtype=dtype, clauses=[2, 3])
    assert verdicts(report) == {2: "fail", 3: "pass"}, report.to_table()
    assert report.result(2).deviation > 0.1


def test_an_optimizer_without_eps_that_follows_the_reference_is_not_shown_to_be_adamw():
    # torch's AdamW with its own eps (1e-8, inside the band): the update matches, where eps goes cannot be seen.
    report = check(torch.optim.AdamW, mapping={"eps": None}, clauses=[1])
    assert report.result(1).verdict == "n/a", report.to_table()
    assert "where eps goes" in report.result(1).detail and report.result(1).deviation < 1e-5
    assert not report.conforming and "could not be compared" in report.unproven


def test_a_swallowed_keyword_is_named_and_the_map_that_fits_passes():
    report = check(broken.SwallowsKeywords, clauses=[1])
    detail = report.result(1).detail
    assert report.result(1).verdict == "fail"
    assert "accepted amsgrad=True and behaved exactly as with amsgrad=False" in detail and '{"amsgrad": null}' in detail
    mapped = check(broken.SwallowsKeywords, clauses=[1], mapping={"amsgrad": None})
    assert mapped.result(1).verdict == "pass" and "amsgrad: not asked" in mapped.result(1).detail


# ----------------------------------------------------------------------------- a candidate that crashes

class CrashingStep(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def step(self, closure=None):
        raise RuntimeError("kaboom in step")


def failing_constructor(params, **hyper):
    raise TypeError("this factory builds nothing")


def test_a_candidate_that_raises_errs_clauses_and_never_crashes_the_checker():
    report = check(CrashingStep)
    got = verdicts(report)
    stepping = [n for n in ALL if n not in (9, 12)]
    assert all(got[n] == "error" for n in stepping), report.to_table()
    assert {r.number for r in report.failed} >= set(stepping) and not report.conforming
    assert all("kaboom in step" in report.result(n).detail for n in stepping)
    assert "test_conformance.py" in report.result(1).detail  # the candidate's own line is shown
    # Validation does not step, and this optimizer validates nothing: still a measured failure.
    assert got[12] == "fail" and "accepted at construction" in report.result(12).detail
    report = check(failing_constructor, clauses=[1, 11, 12])
    assert [r.verdict for r in report.results] == ["error", "error", "pass"]
    assert "this factory builds nothing" in report.result(1).detail


# ----------------------------------------------------------------------------- API details

def test_report_json_and_table(offload_report, torch_reports):
    report = torch_reports["fused"]
    data = json.loads(json.dumps(report.to_json()))
    assert data["failed"] == [8, 11]
    assert [r["number"] for r in data["results"]] == ALL
    assert {r["verdict"] for r in data["results"]} <= {"pass", "fail", "n/a", "info"}
    table = report.to_table()
    for result in report.results:
        assert result.name in table
    assert "FAIL" in table and "FAIL" not in offload_report.to_table()


def test_load_candidate_by_module_and_by_file(tmp_path):
    assert load_candidate("torch.optim:AdamW") is torch.optim.AdamW
    assert load_candidate("offload_adamw:OffloadAdamW") is OffloadAdamW
    path = Path(broken.__file__)
    assert load_candidate(f"{path}:SplitBetaAdamW").__name__ == "SplitBetaAdamW"
    (tmp_path / "bad.py").write_text("raise ImportError('no luck')\n")
    cases = {
        "torch.optim": "expected 'module:Class'",
        "no_such_module_xyz:Opt": "No module named",
        "torch.optim:NoSuchOptimizer": "no attribute",
        f"{tmp_path / 'missing.py'}:X": "no such file",
        f"{tmp_path / 'bad.py'}:X": "no luck",
        "math:pi": "not a class or factory",
    }
    for spec, message in cases.items():
        with pytest.raises(CandidateLoadError, match=message) as info:
            load_candidate(spec)
        assert spec in str(info.value)


def test_mapping_is_validated_and_translates():
    mapping = HyperMapping(names=broken.SPLIT_BETA_MAPPING, extra={"correct_bias": True})
    values = {"lr": 0.1, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.01, "amsgrad": False, "maximize": False}
    assert mapping.translate(values) == {"lr": 0.1, "beta1": 0.8, "beta2": 0.9, "epsilon": 1e-6, "wd": 0.01}
    with pytest.raises(NotApplicable, match="amsgrad"):
        mapping.translate({**values, "amsgrad": True})
    for bad in ({"momentum": "m"}, {"betas": ["only_one"]}, {"lr": None}, {"eps": 3}):
        with pytest.raises(ValueError, match="mapping"):
            HyperMapping(names=bad)
    with pytest.raises(ValueError, match="unknown clause"):
        check(OffloadAdamW, clauses=[16])


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=6),
    rtol=st.sampled_from([1e-10, 1.3e-6, 2.0**-7]),
    atol=st.sampled_from([1e-12, 1e-5]),
    factor=st.floats(0.0, 4.0),
)
def test_compare_accepts_exactly_the_stated_tolerance(values, rtol, atol, factor):
    expected = torch.tensor(values, dtype=torch.float64)
    bound = atol + rtol * expected.abs()
    actual = expected + factor * bound
    ok, deviation = compare(actual, expected, Tolerance(rtol, atol))
    assert ok == bool(((actual - expected).abs() <= bound).all())
    assert compare(expected, expected, Tolerance(0.0, 0.0)) == (True, 0.0)
    assert math.isclose(
        deviation, float(((actual - expected).abs() / expected.abs().clamp(min=1e-3)).max()), rel_tol=1e-9, abs_tol=1e-300
    )
    nan_actual = expected.clone()
    nan_actual[0] = math.nan
    assert compare(nan_actual, expected, Tolerance(1.0, 1.0)) == (False, math.inf)


# ----------------------------------------------------------------------------- candidates that hang, exit or die

class HangsInStep(torch.optim.AdamW):
    def step(self, closure=None):
        while True:
            time.sleep(0.01)


class ExitsInStep(torch.optim.AdamW):
    def step(self, closure=None):
        sys.exit(0)


class DiesInStep(torch.optim.AdamW):
    def step(self, closure=None):
        os._exit(3)


def test_a_hang_an_exit_or_a_dead_process_is_that_clauses_error_never_a_pass():
    started = time.perf_counter()
    report = check(HangsInStep, clauses=[1, 12], timeout=2)
    assert time.perf_counter() - started < 30
    assert verdicts(report) == {1: "error", 12: "pass"}, report.to_table()
    assert "did not finish within 2 s" in report.result(1).detail and not report.conforming
    report = check(ExitsInStep, clauses=[1, 4])
    assert verdicts(report) == {1: "error", 4: "error"}
    assert "sys.exit(0)" in report.result(1).detail and "test_conformance.py" in report.result(1).detail
    report = check(DiesInStep, clauses=[1, 12])
    assert verdicts(report) == {1: "error", 12: "pass"}
    assert "ended the process (exit status 3)" in report.result(1).detail


class HangsInConstructor(torch.optim.AdamW):
    def __init__(self, params, **hyper):
        while True:
            time.sleep(0.01)


def test_a_constructor_that_hangs_costs_one_time_limit_not_one_per_clause():
    started = time.perf_counter()
    report = check(HangsInConstructor, clauses=JUDGED, timeout=2)
    assert time.perf_counter() - started < 20
    assert {r.verdict for r in report.results} == {"error"}
    assert "building one optimizer: it did not finish within 2 s" in report.result(1).detail


def test_without_isolation_the_clauses_run_here_without_a_time_limit():
    report = check(ExitsInStep, clauses=[1], isolate=False)
    assert report.result(1).verdict == "error" and report.timeout is None


# ----------------------------------------------------------------------------- what the harness must not get wrong

class SignMomentum(torch.optim.Optimizer):
    """Lion: theta <- theta*(1 - lr*wd) - lr*sign(b1*m + (1-b1)*g); m <- b2*m + (1-b2)*g. No eps."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        if not 0.0 <= lr or not 0.0 <= weight_decay or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError("invalid hyperparameter")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                m, g = state["exp_avg"], p.grad.float()
                theta = p.float().mul_(1 - group["lr"] * group["weight_decay"])
                theta.add_(torch.sign(m * b1 + g * (1 - b1)), alpha=-group["lr"])
                m.lerp_(g, 1 - b2)
                p.copy_(theta)


def test_an_optimizer_without_eps_gets_every_clause_that_does_not_need_it_and_is_not_called_conforming(tmp_path):
    report = check(SignMomentum, mapping={"eps": None, "amsgrad": None, "maximize": None}, clauses=JUDGED)
    got = verdicts(report)
    # No eps is no excuse: no eps from 1e-30 to 1e-6 makes sign(b1*m + (1-b1)*g) AdamW's update.
    assert got[1] == "fail" and "the candidate takes no eps argument" in report.result(1).detail
    assert report.result(1).deviation > 0.1
    for clause in (2, 3, 4, 5, 6, 7, 10, 11, 12):
        assert got[clause] in ("pass", "fail"), report.to_table()  # asked, not skipped for a missing keyword
    assert "only the 'warm' tensor" in report.result(5).detail
    # Its momentum grows by 1e-3*g a step (beta2 0.999), yet torch's positional loading shows: the gradients
    # after the save are a thousand times smaller than before, so the swapped moments drive the continuation.
    assert got[11] == "fail" and report.result(11).deviation > 0.1
    assert not report.conforming and report.to_json()["conforming"] is False


class NeedsTrainMode(torch.optim.AdamW):
    """Refuses to step until .train() is called (as schedule-free optimizers do)."""

    def train(self):
        self.training = True

    def step(self, closure=None):
        if not getattr(self, "training", False):
            raise RuntimeError("call optimizer.train() before stepping")
        return super().step(closure)


def test_setup_prepares_every_optimizer_before_it_steps():
    assert check(NeedsTrainMode, clauses=[1]).result(1).verdict == "error"
    report = check(NeedsTrainMode, clauses=[1, 10, 11], setup=["train"])
    assert verdicts(report) == {1: "pass", 10: "pass", 11: "fail"}, report.to_table()
    with pytest.raises(UsageError, match="no method 'eval_mode'"):
        check(NeedsTrainMode, clauses=[1], setup=["eval_mode"])


class TensorLrOnly(torch.optim.AdamW):
    """Keeps lr as a tensor (as capturable and fused set-ups do) and refuses to step with a float."""

    def __init__(self, params, lr=1e-3, **hyper):
        super().__init__(params, lr=torch.tensor(float(lr)), foreach=False, **hyper)
        for group in self.param_groups:
            group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32)

    def step(self, closure=None):
        if not all(isinstance(g["lr"], torch.Tensor) for g in self.param_groups):
            raise TypeError("lr must stay a tensor")
        return super().step(closure)


class RefusesLrZero(torch.optim.AdamW):
    def __init__(self, params, lr=1e-3, **kwargs):
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        super().__init__(params, lr=lr, **kwargs)


def test_lr_writes_keep_a_tensor_lr_and_never_need_a_constructor_that_takes_lr_0():
    report = check(TensorLrOnly, clauses=[6, 7])
    assert verdicts(report) == {6: "pass", 7: "pass"}, report.to_table()
    report = check(RefusesLrZero, clauses=[6])
    assert report.result(6).verdict == "pass", report.to_table()


class NameMatchingAdamW(torch.optim.AdamW):
    """torch's AdamW with a loader that matches the saved state by parameter name."""

    def load_state_dict(self, state_dict):
        saved = [n for g in state_dict["param_groups"] for n in g["param_names"]]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        by_name = dict(zip(saved, ids))
        current = [n for g in self.param_groups for n in g["param_names"]]
        state = {i: state_dict["state"][by_name[n]] for i, n in enumerate(current) if by_name[n] in state_dict["state"]}
        groups = [{**state_dict["param_groups"][0], "params": list(range(len(current))), "param_names": current}]
        super().load_state_dict({"state": state, "param_groups": groups})


def test_each_load_gets_its_own_state_dict():
    # torch's load_state_dict keeps tensors of matching dtype and device: loading one state_dict
    # object twice would make the two optimizers share m and v, and a correct loader would fail.
    report = check(NameMatchingAdamW, clauses=[10, 11])
    assert verdicts(report) == {10: "pass", 11: "pass"}, report.to_table()


class NestedBf16State(torch.optim.Optimizer):
    """A correct AdamW whose moments live in bfloat16 inside a nested container (as some libraries keep them)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    zeros = torch.zeros_like(p, dtype=torch.bfloat16)
                    state.update({"step": 0, "moments": {"m": zeros.clone(), "v": zeros.clone()}})
                state["step"] += 1
                t, g = state["step"], p.grad.float()
                m = state["moments"]["m"].float().lerp_(g, 1 - b1)
                v = state["moments"]["v"].float().mul_(b2).addcmul_(g, g, value=1 - b2)
                state["moments"]["m"].copy_(m)
                state["moments"]["v"].copy_(v)
                theta = p.float().mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v / (1 - b2**t)).sqrt_().add_(group["eps"])
                theta.addcdiv_(m, denom, value=-group["lr"] / (1 - b1**t))
                p.copy_(theta)


def test_state_dtypes_are_read_inside_nested_containers():
    report = check(NestedBf16State, clauses=[1, 8], mapping={"amsgrad": None, "maximize": None})
    assert report.result(1).verdict == "pass", report.to_table()  # right formula, judged at bf16 precision
    assert report.result(8).verdict == "fail"
    assert "float32 parameters: state narrower than float32: moments.m bfloat16, moments.v bfloat16" in report.result(8).detail


def test_a_rounded_parameter_does_not_pass_for_a_step_that_depends_on_theta():
    # bf16 parameters without a master round each step to their own ulp, which grows with theta; only a
    # step that really depends on theta (a trust ratio) makes clauses 2 and 3 n/a.
    from offload_adamw.demo.naive import NaiveOffloadAdamW

    report = check(NaiveOffloadAdamW, dtype="bf16", clauses=[2, 3])
    assert verdicts(report) == {2: "pass", 3: "fail"}, report.to_table()
    assert "decay is applied after the update" in report.result(3).detail


class EightBitStateAdamW(torch.optim.Optimizer):
    """AdamW whose moments are kept as uint8 codes with one float32 scale for tensors of 4096 elements or more
    (as 8-bit optimizers do), and in float32 for smaller ones."""

    THRESHOLD = 4096

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @staticmethod
    def _store(x):
        scale = x.abs().max().clamp(min=1e-30)
        return {"codes": ((x / scale) * 127 + 128).round().clamp(0, 255).to(torch.uint8), "scale": scale}

    @staticmethod
    def _load(entry):
        return (entry["codes"].float() - 128) / 127 * entry["scale"]

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state, g = self.state[p], p.grad.float()
                quantized = p.numel() >= self.THRESHOLD
                if not state:
                    zeros = torch.zeros_like(p, dtype=torch.float32)
                    state.update({"step": 0, "exp_avg": self._store(zeros) if quantized else zeros,
                                  "exp_avg_sq": self._store(zeros) if quantized else zeros.clone()})
                state["step"] += 1
                t = state["step"]
                m = self._load(state["exp_avg"]) if quantized else state["exp_avg"]
                v = self._load(state["exp_avg_sq"]) if quantized else state["exp_avg_sq"]
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                if quantized:
                    state["exp_avg"], state["exp_avg_sq"] = self._store(m), self._store(v)
                theta = p.float().mul_(1 - group["lr"] * group["weight_decay"])
                theta.addcdiv_(m, (v / (1 - b2**t)).sqrt_().add_(group["eps"]), value=-group["lr"] / (1 - b1**t))
                p.copy_(theta)


def test_quantized_state_is_seen_on_a_tensor_large_enough_to_be_quantized():
    report = check(EightBitStateAdamW, clauses=[1, 8], mapping={"amsgrad": None, "maximize": None})
    assert report.result(1).verdict == "pass", report.to_table()  # small tensors stay float32: the formula is right
    assert report.result(8).verdict == "fail"
    detail = report.result(8).detail
    assert "float32 parameters: state narrower than float32: exp_avg.codes uint8, exp_avg_sq.codes uint8" in detail


def test_the_references_are_ready_only_for_what_was_computed(monkeypatch):
    from offload_adamw.conformance import clauses as clauses_module
    from offload_adamw.conformance.clauses import cache

    monkeypatch.setattr(cache, "_REFERENCES", {})
    takes_decay, takes_none = HyperMapping().accepts, HyperMapping(names={"weight_decay": None}).accepts
    assert not clauses_module.references_ready([1, 8], mapping_accepts=takes_decay)
    clauses_module.prepare_references([1, 8], mapping_accepts=takes_decay)
    assert clauses_module.references_ready([1, 8], mapping_accepts=takes_decay)
    assert clauses_module.references_ready([2, 3], mapping_accepts=takes_none)  # no clause compares with a reference
    assert not clauses_module.references_ready([8], mapping_accepts=takes_none)  # its long horizon runs without decay


def test_a_second_check_in_one_process_reuses_the_references_and_reports_the_same(monkeypatch):
    from offload_adamw.conformance import checker as checker_module
    from offload_adamw.conformance.clauses import cache

    monkeypatch.setattr(cache, "_REFERENCES", {})
    computed = []
    pending = checker_module.Pending

    def counted(*args, **kwargs):
        computed.append(args)
        return pending(*args, **kwargs)

    monkeypatch.setattr(checker_module, "Pending", counted)
    first = check(broken.MomentsInParamDtype, clauses=[1, 8])
    second = check(broken.MomentsInParamDtype, clauses=[1, 8])
    assert len(computed) == 1  # the first check computed them beside torch's lazy imports; the second found them
    assert first.failed and [r.number for r in first.failed] == [8]
    assert [(r.verdict, r.deviation, r.detail) for r in second.results] == [
        (r.verdict, r.deviation, r.detail) for r in first.results]
