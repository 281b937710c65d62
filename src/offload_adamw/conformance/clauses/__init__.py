"""The fifteen clauses of the conformance checker, one function each, in one module per family.

Contract: every clause function takes a :class:`Context` and returns a
:class:`ClauseFinding` (verdict, deviation, detail); it raises
:class:`~offload_adamw.conformance.harness.NotApplicable` when the question cannot be
asked of the candidate, and lets any other exception of the candidate escape (the
caller turns it into a failed clause that shows the error).

The modules: :mod:`~offload_adamw.conformance.clauses.common` (the context, the finding, the clause record,
the shared comparisons), :mod:`~offload_adamw.conformance.clauses.cache` (the reference trajectories,
computed once per process), one module per family of clauses (``update``: 1, ``decay``: 2 and 3, ``steps``:
4 to 7, ``precision``: 8 and 9, ``resume``: 10 and 11, ``faults``: 12 to 14, ``cost``: 15) and
:mod:`~offload_adamw.conformance.clauses.registry` (:data:`CLAUSES` in order, and the references the
selected clauses need). This package re-exports their public names, so that
``offload_adamw.conformance.clauses.NAME`` is what it was when the clauses were one module.

How the clauses isolate one property each. Clause 1 compares the candidate with
:mod:`offload_adamw.reference` step by step (float64 reference; the candidate in
float64 where it accepts float64 parameters, and in the checked dtype), with the
tolerance of the arithmetic the candidate computes in: the narrowest of the observed
value and the parameter-sized state, or, where that fails, a narrower arithmetic that its
own run in that dtype shows (:class:`_UpdateRuns`; float32 moments on float64 parameters,
or a cast to float32 inside the step, round as float32 does: clause 8's finding, not a
wrong formula; bfloat16 and float16, whose tolerances are loose, need theta to hold their
values or the run to be ten times closer to the candidate's own run than to the
reference). Its inputs make the usual departures visible: eps comparable with
sqrt(v_hat), shrinking gradients (amsgrad), and gradients orthogonal to one weight
(projections). A candidate without eps is compared with the reference for every eps in
:data:`OWN_EPS_BAND`. Every other property is checked *metamorphically*: the candidate is
run twice under a change whose effect the contract fixes exactly, and the two runs are
compared with each other. A wrong update formula then fails clause 1 only, instead of
failing every clause that happens to take a step. The pairs:

2. weight_decay 0 vs. weight_decay > 0 on the same gradients: with decoupled decay the
   update direction is the same, so theta_B(k) = s*theta_B(k-1) - (theta_A(k-1) - theta_A(k))
   with s = 1 - lr*wd (or s*(theta_B(k-1) - ...) when the decay comes after the update;
   that ordering is clause 3's business). lr*wd is 0.5, so that a decay factor off by a
   few per cent shows even on a bfloat16 parameter. Where the step itself depends on
   theta (a trust ratio: doubling theta changes the weight_decay-0 step), later steps
   differ whatever the decay is, and one step from a fresh state is judged instead: the
   decayed step must be s*theta0 minus the weight_decay-0 step from theta0 or from
   s*theta0, or s times that step's result (a decay multiplied by the trust ratio fits none).
3. The same pair for one step, with gradients of the sign of theta and a tiny eps: then
   L2 coupling cannot change the first update (it is sign(g) either way), and only the
   place of the decay decides between s*theta0 - u and s*(theta0 - u) (one-step forms as
   in clause 2 where the step depends on theta). Where neither fits with s = 1 - lr*wd, a
   shrink factor fitted per tensor decides the order (a decay scaled by a statistic of v
   is clause 2's finding, its order still this clause's).
4. Tensors with grad None at some step calls vs. the same tensors stepped alone with only
   their real gradients. Where tensors without a gradient were left alone and the
   difference goes away with weight_decay 0, the decay couples the tensors: clause 2's.
5. Explicit zero gradients vs. the midpoint of runs with gradients of +1e-30 and -1e-30
   (the contract is continuous there; a sign-based rule steps +lr and -lr on a cold state,
   whose midpoint is the zero-gradient step; float16 uses 2**-24 and eps 1e-2, so that the
   tiny gradient stays far below eps). Without an eps argument only a tensor with warm
   moments is asked.
6. lr = 0 vs. lr = 1e-20 for one step, written into the groups of optimizers built with
   the real lr (a constructor may refuse lr = 0 or record its base lr), then the same lr
   for both; through the constructor only where the groups' lr is not read.
7. Two parameter groups vs. two optimizers with one group each; and lr changes: runs that
   share every step up to k and differ only in step k's lr, so the step must scale exactly
   (or at least change, where the rule scales its step otherwise, which is reported).
   Where only the decayed group differs and not with weight_decay 0 in both, the decay
   couples the groups: clause 2's.
8. Each parameter dtype vs. the same candidate in the widest dtype it takes, over 1051
   steps on 4096 elements (a bf16 parameter must be the rounded copy of a float32
   computation), plus the state dtypes (read inside nested containers), the arithmetic of the
   widest run (clause 1's judgement where it ends beyond its tolerance from the reference)
   and how the master is narrowed: a visible master against its parameter, a hidden one
   through the parameter against the candidate's own float32 run (truncation and
   stochastic rounding differ from round-to-nearest-even in a tenth of the elements or
   more; another order of operations only near ties); the distance of each run to the
   reference is reported as well.
10. Save at step 3 (through torch.save/torch.load), load into a fresh instance over
    fresh parameters, continue: bitwise equal to the uninterrupted run, state dtypes kept.
    torch's global RNG is restored to its state at the save before the resumed run (as a
    checkpoint that saves it), and a candidate that draws from it is told so.
11. Load the same checkpoint (a fresh copy for each load) into an optimizer built over the
    parameters in another order, and into one built in the saved order: same continuation
    per name, or an error. The saved moments are of opposite signs and the later
    gradients a thousand times smaller, so that a swap shows at any momentum.
13. A step with an inf/NaN gradient vs. a run that never saw it (skip), whether it
    raises, whether theta turns non-finite (propagate).
14. torch.amp.GradScaler with an overflow at step 2 vs. a run without step 2.
"""

from offload_adamw.conformance.clauses.cache import install_references
from offload_adamw.conformance.clauses.common import ARITHMETICS, EXACT, Clause, ClauseFinding, Context
from offload_adamw.conformance.clauses.cost import COST_SHAPES, clause_cost
from offload_adamw.conformance.clauses.decay import ONE_STEP_FORMS, clause_decay_order, clause_decoupled
from offload_adamw.conformance.clauses.faults import clause_grad_scaler, clause_nonfinite, clause_validation
from offload_adamw.conformance.clauses.precision import (
    LONG_DTYPES,
    LONG_SHAPE,
    LONG_TAIL_STEPS,
    LONG_ZERO_STEPS,
    NEAR_TIE_FRACTION,
    PART_SIZE,
    PARTS,
    TILES,
    clause_placement,
    clause_precision,
)
from offload_adamw.conformance.clauses.registry import CLAUSES, REFERENCE_CLAUSES, prepare_references, references_ready
from offload_adamw.conformance.clauses.resume import clause_name_mapping, clause_round_trip
from offload_adamw.conformance.clauses.steps import (
    STEP_COUNT_PRESENT,
    clause_groups,
    clause_lr_zero,
    clause_step_count,
    clause_zero_grad,
)
from offload_adamw.conformance.clauses.update import OWN_EPS_BAND, UPDATE_VARIANTS, Judgement, clause_update
from offload_adamw.contract.rules import NONFINITE_POLICIES

__all__ = ["Context", "ClauseFinding", "Clause", "CLAUSES", "NONFINITE_POLICIES", "REFERENCE_CLAUSES", "prepare_references",
           "install_references", "references_ready", "EXACT", "ARITHMETICS", "Judgement", "OWN_EPS_BAND", "UPDATE_VARIANTS",
           "ONE_STEP_FORMS", "STEP_COUNT_PRESENT", "LONG_DTYPES", "LONG_SHAPE", "LONG_TAIL_STEPS", "LONG_ZERO_STEPS",
           "NEAR_TIE_FRACTION", "PART_SIZE", "PARTS", "TILES", "COST_SHAPES", "clause_update", "clause_decoupled",
           "clause_decay_order", "clause_step_count", "clause_zero_grad", "clause_lr_zero", "clause_groups",
           "clause_precision", "clause_placement", "clause_round_trip", "clause_name_mapping", "clause_validation",
           "clause_nonfinite", "clause_grad_scaler", "clause_cost"]
