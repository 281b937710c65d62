"""The pure-Python reference against docs/contract.md: worked numbers, resume, and the oracle law."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_adamw.reference import Hyper, State, adamw_step, init_state, oracle, run

# docs/contract.md#worked-numbers: lr = 0.1, b1 = 0.9, b2 = 0.99, wd = 0.1, eps = 1e-12.
HP = Hyper(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-12, weight_decay=0.1)


def test_row1_first_step_of_one_element():
    s = adamw_step(init_state([1.0]), [1.0], HP)
    assert s.m[0] == pytest.approx(0.1, abs=1e-15)
    assert s.v[0] == pytest.approx(0.01, abs=1e-15)
    assert s.m[0] / (1 - 0.9) == pytest.approx(1.0, abs=1e-12)  # m_hat
    assert s.v[0] / (1 - 0.99) == pytest.approx(1.0, abs=1e-12)  # v_hat
    assert s.theta[0] == pytest.approx(0.89, abs=1e-11)
    assert s.t == 1


def test_row2_two_elements():
    s = adamw_step(init_state([1.0, 2.0]), [1.0, 1.0], HP)
    assert s.theta == pytest.approx((0.89, 1.88), abs=1e-11)


def test_row3_l2_coupled_is_a_different_rule():
    """Feeding g + wd*theta into the moments (and not decaying) gives (0.9, 1.9) and other moments."""
    theta0 = (1.0, 2.0)
    coupled_grad = [1.0 + 0.1 * theta0[0], 1.0 + 0.1 * theta0[1]]
    l2 = adamw_step(init_state(theta0), coupled_grad, Hyper(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-12, weight_decay=0.0))
    assert l2.theta == pytest.approx((0.9, 1.9), abs=1e-11)
    decoupled = adamw_step(init_state(theta0), [1.0, 1.0], HP)
    assert decoupled.theta != pytest.approx(l2.theta, abs=1e-6)
    assert decoupled.m != pytest.approx(l2.m, abs=1e-6)
    assert decoupled.v != pytest.approx(l2.v, abs=1e-6)


def test_row4_decay_after_the_update_differs():
    # Decay after: (1 - lr*wd) * (theta - lr*u) with u = 1 -> 0.99 * 0.9 = 0.891.
    no_decay = adamw_step(init_state([1.0]), [1.0], Hyper(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-12, weight_decay=0.0))
    decay_after = no_decay.theta[0] * (1 - 0.1 * 0.1)
    assert decay_after == pytest.approx(0.891, abs=1e-11)
    assert adamw_step(init_state([1.0]), [1.0], HP).theta[0] != pytest.approx(decay_after, abs=1e-6)


def test_row5_explicit_zero_gradient_moves_everything():
    s1 = adamw_step(init_state([1.0]), [1.0], HP)
    s2 = adamw_step(s1, [0.0], HP)
    assert s2.m[0] == pytest.approx(0.09, abs=1e-15)
    assert s2.v[0] == pytest.approx(0.0099, abs=1e-15)
    assert s2.m[0] / (1 - 0.9**2) == pytest.approx(0.473684, abs=1e-6)
    assert s2.v[0] / (1 - 0.99**2) == pytest.approx(0.497487, abs=1e-6)
    assert s2.theta[0] == pytest.approx(0.8139419853, abs=1e-10)
    assert s2.t == 2


def test_row6_grad_none_changes_nothing():
    s1 = adamw_step(init_state([1.0]), [1.0], HP)
    assert adamw_step(s1, None, HP) == s1
    assert adamw_step(s1, None, HP).t == 1


def test_lr_zero_absorbs_gradient_but_keeps_theta():
    s = adamw_step(init_state([1.5]), [2.0], Hyper(lr=0.0, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1))
    assert s.theta == (1.5,)
    assert s.m[0] == pytest.approx(0.2) and s.v[0] == pytest.approx(0.04) and s.t == 1


def test_repeated_zero_gradients_shrink_by_the_product_of_decays():
    lrs = [0.1, 0.05, 0.2, 0.01]
    s = init_state([3.0])
    for lr in lrs:
        s = adamw_step(s, [0.0], Hyper(lr=lr, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.3))
    assert s.theta[0] == pytest.approx(3.0 * math.prod(1 - lr * 0.3 for lr in lrs), rel=1e-15)


def test_maximize_and_amsgrad():
    up = adamw_step(init_state([1.0]), [1.0], Hyper(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-12, weight_decay=0.0, maximize=True))
    assert up.theta[0] == pytest.approx(1.1, abs=1e-11)
    hp = Hyper(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-12, weight_decay=0.0, amsgrad=True)
    s = run(init_state([1.0], amsgrad=True), [[10.0], [0.0], [0.0]], hp)
    assert s.max_v[0] == pytest.approx(1.0, rel=1e-12)  # the max stays at the first v
    assert s.v[0] < s.max_v[0]


def test_resume_whole_tuple_continues_identically_theta_alone_does_not():
    grads = [[0.3, -1.0], None, [0.0, 0.5], [2.0, 2.0], [-0.7, 0.1], [1.0, -1.0]]
    full = run(init_state([1.0, -2.0]), grads, HP)
    half = run(init_state([1.0, -2.0]), grads[:3], HP)
    saved = State(half.theta, half.m, half.v, half.t)  # a round trip through plain values
    assert run(saved, grads[3:], HP) == full
    theta_only = init_state(half.theta)
    assert run(theta_only, grads[3:], HP).theta != full.theta


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Hyper(lr=float("nan")), "lr must be finite"),
        (lambda: Hyper(lr=-0.1), "Invalid learning rate"),
        (lambda: Hyper(lr=True), "lr must be a real number"),
        (lambda: Hyper(lr=0.1, eps=0.0), "Invalid epsilon"),
        (lambda: Hyper(lr=0.1, beta1=1.0), "Invalid beta parameter at index 0"),
        (lambda: Hyper(lr=0.1, beta2=-0.1), "Invalid beta parameter at index 1"),
        (lambda: Hyper(lr=0.1, weight_decay=-1.0), "Invalid weight_decay"),
        (lambda: State((1.0,), (0.0,), (-1.0,), 0), "v\\[0\\] must be >= 0"),
        (lambda: State((1.0,), (0.0,), (0.0,), -1), "t must be a non-negative int"),
        (lambda: State((1.0,), (0.0,), (0.0,), 1.0), "t must be a non-negative int"),
        (lambda: State((float("inf"),), (0.0,), (0.0,), 0), "theta\\[0\\] must be finite"),
        (lambda: adamw_step(init_state([1.0]), [float("nan")], HP), "grad\\[0\\] must be finite"),
        (lambda: adamw_step(init_state([1.0]), [True], HP), "grad\\[0\\] must be a real number"),
        (lambda: adamw_step(init_state([1e300]), [1.0], Hyper(lr=0.0, weight_decay=0.0, beta2=0.5)), None),
        (lambda: adamw_step(init_state([1.0]), [1e200], HP), "non-finite intermediate: v\\[0\\]"),
    ],
)
def test_bad_inputs_are_refused_by_name(make, message):
    if message is None:  # a huge but finite computation is fine
        make()
        return
    with pytest.raises(ValueError, match=message):
        make()


# ------------------------------------------------------------------ the oracle law

finite = st.floats(min_value=-10.0, max_value=10.0, allow_nan=False, allow_infinity=False)
width = 3
grad_entry = st.one_of(
    st.none(),
    st.just([0.0] * width),
    st.lists(finite, min_size=width, max_size=width),
)


@settings(max_examples=150, deadline=None)
@given(
    theta0=st.lists(finite, min_size=width, max_size=width),
    grads=st.lists(grad_entry, min_size=1, max_size=25),
    lrs=st.lists(st.floats(min_value=0.0, max_value=0.1), min_size=25, max_size=25),
    beta1=st.floats(min_value=0.0, max_value=0.99),
    beta2=st.floats(min_value=0.5, max_value=0.9999),
    wd=st.floats(min_value=0.0, max_value=0.5),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
)
def test_recursion_and_explicit_sums_agree(theta0, grads, lrs, beta1, beta2, wd, amsgrad, maximize):
    hps = [
        Hyper(lr=lrs[i], beta1=beta1, beta2=beta2, eps=1e-3, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
        for i in range(len(grads))
    ]
    recursive = run(init_state(theta0, amsgrad=amsgrad), grads, hps)
    explicit = oracle(theta0, grads, hps)
    assert recursive.t == explicit.t == sum(g is not None for g in grads)
    for a, b in zip(recursive.theta + recursive.m + recursive.v, explicit.theta + explicit.m + explicit.v):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-12)
