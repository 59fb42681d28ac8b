"""Comparing a worker's tensors with the verifier's recompute, within a stated tolerance.

Floating-point tensors match when their relative L2 error ``||got - want|| / max(||want||, tiny)``
is at most the tolerance; integer and boolean tensors match exactly; shapes and dtypes exactly.

Tolerances. On CPU, in float32, the worker and the verifier run the same kernels on the same
inputs and parameters: the recompute is bitwise equal when both use the same number of threads
and differs by summation order only (relative error ~1e-6) otherwise, so ``CPU_REL_TOL = 1e-4``
leaves two orders of magnitude of margin for honest work and still catches a 1% scaling (relative
error 1e-2) a hundredfold. On CUDA the worker computes under bf16 autocast (8-bit mantissa): a
recompute on another device or in float32 differs by ~1e-2 relative, so ``CUDA_BF16_REL_TOL = 3e-2``
(a 1% scaling is then NOT distinguishable from rounding: a CUDA verifier must recompute on the
same kind of device with the same autocast for a tighter bound, ``CUDA_FP32_REL_TOL`` in float32).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

CPU_REL_TOL = 1e-4  # worker and verifier both on CPU, float32
CUDA_FP32_REL_TOL = 1e-3  # same device kind, float32 (TF32 off): summation order of parallel kernels
CUDA_BF16_REL_TOL = 3e-2  # a worker under bf16 autocast checked in float32
TINY = 1e-12  # floor of the reference norm (an all-zero tensor)


def tolerance_for(device_type: str, autocast: bool) -> float:
    """The relative tolerance for work done on `device_type` (with or without bf16 autocast)."""
    if device_type == "cpu":
        return CPU_REL_TOL
    return CUDA_BF16_REL_TOL if autocast else CUDA_FP32_REL_TOL


@dataclass(frozen=True)
class Mismatch:
    name: str  # the tensor (or "loss")
    detail: str  # what differed

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


FAST_NORM_FLOOR = 1e-6  # float32 norms below it are taken again in float64 (see `relative_error`)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of `t` is finite. A sum is non-finite whenever one of its terms is (NaN
    propagates, inf + finite = inf, inf - inf = NaN), so a finite sum proves it in one cheap pass
    (4x cheaper than `isfinite(t).all()`, which writes a boolean tensor); a sum that overflowed
    (finite but huge elements) is settled element by element."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / max(||want||, TINY), the difference taken in the tensors' own dtype (exact for
    elements within a factor 2 of each other, Sterbenz's lemma, and off by half an ulp of the
    difference otherwise: far below any tolerance here). The norms are summed in float32 (5x
    cheaper; relative error ~1e-6 at a million elements, against tolerances of 1e-4 and up) when
    that is safe, else in float64: when a norm is not finite (squares overflowed) or the reference's
    is under FAST_NORM_FLOOR (squares that underflow could then weigh against the tolerance)."""
    d = got - want
    if want.dtype == torch.float32:
        diff, ref = float(torch.linalg.vector_norm(d)), float(torch.linalg.vector_norm(want))
        if math.isfinite(diff) and math.isfinite(ref) and ref >= FAST_NORM_FLOOR:
            return diff / ref
    diff64 = torch.linalg.vector_norm(d, dtype=torch.float64)
    return float(diff64 / max(float(torch.linalg.vector_norm(want, dtype=torch.float64)), TINY))


def compare_tensor(name: str, got: torch.Tensor, want: torch.Tensor, rel_tol: float) -> Mismatch | None:
    if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
        return Mismatch(name, f"{got.dtype}{list(got.shape)} instead of {want.dtype}{list(want.shape)}")
    if not got.is_floating_point():
        if not torch.equal(got, want):
            return Mismatch(name, f"{int((got != want).sum())} integer elements differ")
        return None
    if not all_finite(got):
        return Mismatch(name, "non-finite values")
    err = relative_error(got, want)
    if not err <= rel_tol:
        return Mismatch(name, f"relative error {err:.3g} > tolerance {rel_tol:g}")
    return None


def compare_tensors(
    got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], rel_tol: float, what: str = ""
) -> list[Mismatch]:
    """Every difference between two named sets of tensors (missing or extra names included)."""
    out = []
    prefix = f"{what} " if what else ""
    for name in sorted(set(got) | set(want)):
        if name not in got:
            out.append(Mismatch(prefix + name, "missing"))
        elif name not in want:
            out.append(Mismatch(prefix + name, "not expected"))
        else:
            m = compare_tensor(prefix + name, got[name].detach().cpu(), want[name].detach().cpu(), rel_tol)
            if m is not None:
                out.append(m)
    return out


def compare_loss(got: float, want: float, rel_tol: float) -> Mismatch | None:
    err = abs(got - want) / max(abs(want), TINY)
    if not err <= rel_tol:
        return Mismatch("loss", f"{got:.6g} instead of {want:.6g} (relative error {err:.3g} > {rel_tol:g})")
    return None


__all__ = [
    "CPU_REL_TOL",
    "CUDA_BF16_REL_TOL",
    "CUDA_FP32_REL_TOL",
    "Mismatch",
    "all_finite",
    "compare_loss",
    "compare_tensor",
    "compare_tensors",
    "relative_error",
    "tolerance_for",
]
