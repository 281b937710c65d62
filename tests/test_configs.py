"""The configuration table's bitwise helper (tests/support/configs.py) tells apart what it must, and names the tensor.

Every bitwise suite rests on :func:`configs.assert_bitwise_equal`: a helper that called two tensors equal when a bit
differs would make each of them a test that cannot fail. Held here: one ulp, the sign of zero, a NaN's payload, a
dtype or a shape apart are all differences, named by the tensor's name (and its key inside a dict); the same NaN is
equal to itself, as the bits are.
"""

from __future__ import annotations

import pytest
import torch

from configs import CONFIGS, FEATURES, MODES, PLACEMENTS, WRAPPERS, assert_bitwise_equal, same_bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_one_ulp_apart_is_a_difference_named_by_the_tensor(dtype):
    a = torch.linspace(-1, 1, 7, dtype=dtype)
    b = a.clone()
    b.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()])[3] ^= 1  # the lowest bit: one ulp
    with pytest.raises(AssertionError, match=r"exp_avg of w: 1 of 7 elements differ .* flat index 3"):
        assert_bitwise_equal(b, a, "exp_avg of w")


def test_signed_zeros_nan_payloads_dtypes_and_shapes_are_differences():
    zero = torch.zeros(3)
    with pytest.raises(AssertionError, match="p: 1 of 3"):
        assert_bitwise_equal(torch.tensor([0.0, -0.0, 0.0]), zero, "p")
    quiet = torch.tensor([float("nan")])
    other = quiet.clone()
    other.view(torch.int32)[0] |= 1  # another NaN payload
    assert torch.isnan(other).all() and not same_bits(quiet, other)
    assert_bitwise_equal(quiet.clone(), quiet, "the same NaN")  # equal bits, although NaN != NaN
    with pytest.raises(AssertionError, match="dtype torch.float64 != torch.float32"):
        assert_bitwise_equal(zero.double(), zero, "q")
    with pytest.raises(AssertionError, match=r"shape \(3, 1\) != \(3,\)"):
        assert_bitwise_equal(zero[:, None], zero, "q")


def test_dicts_complex_and_non_contiguous_tensors():
    z = torch.complex(torch.randn(4, 3), torch.randn(4, 3))
    w = z.clone()
    w[2, 1] = torch.complex(w[2, 1].real, -w[2, 1].imag)
    with pytest.raises(AssertionError, match=r"state\['b'\]: 1 of 12 elements differ .* flat index 7"):
        assert_bitwise_equal({"a": z.t(), "b": w}, {"a": z.clone().t(), "b": z}, "state")
    with pytest.raises(AssertionError, match="keys"):
        assert_bitwise_equal({"a": z}, {"a": z, "b": z}, "state")
    assert_bitwise_equal({"a": [z, 1]}, {"a": [z.clone(), 1]}, "state")


def test_a_non_sequence_where_a_sequence_is_expected_is_named_not_a_type_error():
    with pytest.raises(AssertionError, match=r"grads: a NoneType, expected 1 items"):
        assert_bitwise_equal(None, [torch.zeros(1)], "grads")


def test_every_entry_supports_or_refuses_every_feature():
    for table in (MODES, PLACEMENTS, CONFIGS):
        for entry in table.values():
            assert entry.supports | set(entry.refusals) == FEATURES and not entry.supports & set(entry.refusals)
    assert all(w.quick <= set(CONFIGS) for w in WRAPPERS.values()), "a wrapper names a configuration not in the table"
