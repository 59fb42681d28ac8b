"""The checks' cheaper comparisons (verify/compare.py): `all_finite` and `relative_error` agree with
the elementwise test and the float64 norms they replace, including where the cheap pass cannot
decide (overflowing sums and squares, underflowing squares)."""

from __future__ import annotations

import torch

from fusionnode.verify.compare import CPU_REL_TOL, all_finite, compare_tensor, relative_error


def _reference(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = torch.linalg.vector_norm(got - want, dtype=torch.float64)
    return float(diff / max(float(torch.linalg.vector_norm(want, dtype=torch.float64)), 1e-12))


def test_all_finite_matches_the_elementwise_test() -> None:
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 1000, 100_003):
        for bad in (None, float("nan"), float("inf"), float("-inf"), "inf-inf"):
            t = torch.randn(n, generator=g)
            if bad == "inf-inf" and n > 1:
                t[0], t[-1] = float("inf"), float("-inf")
            elif isinstance(bad, float):
                t[int(torch.randint(n, (1,), generator=g))] = bad
            assert all_finite(t) == bool(torch.isfinite(t).all()), (n, bad)
    # finite elements whose sum overflows: settled element by element, still finite
    huge = torch.full((4,), 3e38)
    assert not torch.isfinite(huge.sum()) and all_finite(huge)
    huge[2] = float("nan")
    assert not all_finite(huge)
    assert all_finite(torch.arange(5)) and all_finite(torch.empty(0))
    assert not all_finite(torch.tensor([1.0, float("nan")], dtype=torch.float64))


def test_relative_error_matches_float64() -> None:
    g = torch.Generator().manual_seed(1)
    for scale in (1e-30, 1e-8, 1.0, 1e15, 1e25):
        want = torch.randn(50_000, generator=g) * scale
        for rel in (0.0, 1e-7, 1e-5, 1e-4, 1e-2):
            got = want * (1 + rel) if rel else want.clone()
            fast, ref = relative_error(got, want), _reference(got, want)
            assert abs(fast - ref) <= 1e-3 * ref + 1e-12, (scale, rel, fast, ref)
            assert (fast <= CPU_REL_TOL) == (ref <= CPU_REL_TOL) or abs(ref - CPU_REL_TOL) < 1e-6
    zero = torch.zeros(10)
    assert relative_error(zero, zero) == 0.0
    assert relative_error(zero + 1e-3, zero) > 1  # against an all-zero reference: the TINY floor


def test_compare_tensor_still_refuses_lies_and_non_finite() -> None:
    want = torch.randn(10_000, generator=torch.Generator().manual_seed(2))
    assert compare_tensor("x", want.clone(), want, CPU_REL_TOL) is None
    m = compare_tensor("x", want * 1.01, want, CPU_REL_TOL)
    assert m is not None and "relative error" in m.detail
    bad = want.clone()
    bad[5] = float("nan")
    m = compare_tensor("x", bad, want, CPU_REL_TOL)
    assert m is not None and m.detail == "non-finite values"
