"""Error feedback: what compression drops is carried into the next message."""

from __future__ import annotations

import pytest
import torch

import fusionnode.compress  # noqa: F401  (registers "topk")
from fusionnode.compress.feedback import ErrorFeedback
from fusionnode.compress.topk import TOPK


def _topk_link(ratio: float):
    def send(t: torch.Tensor) -> torch.Tensor:
        return TOPK.decode(TOPK.encode(t, ratio=ratio, value_dtype="float32"), 1 << 30)

    return send


def test_sum_of_decoded_tracks_sum_of_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    ef = ErrorFeedback()
    link = _topk_link(0.05)
    total_in = torch.zeros(2000)
    total_out = torch.zeros(2000)
    total_plain = torch.zeros(2000)
    for _ in range(200):
        g = torch.randn(2000, generator=gen) + 0.1  # a gradient with a consistent drift
        total_in += g
        total_out += ef.compress("w", g, link)
        total_plain += link(g)
    residual = ef.residual("w")
    assert residual is not None
    # exact bookkeeping: sum(decoded) = sum(inputs) - residual (float32 values, no rounding loss)
    torch.testing.assert_close(total_out, total_in - residual, rtol=0, atol=1e-3)
    err_ef = (total_out - total_in).norm() / total_in.norm()
    err_plain = (total_plain - total_in).norm() / total_in.norm()
    assert err_ef < 0.5 * err_plain
    assert err_ef < 0.6


def test_names_are_independent_and_reset() -> None:
    ef = ErrorFeedback()
    link = _topk_link(0.1)
    a, b = torch.randn(100), torch.randn(100)
    ef.compress("a", a, link)
    assert ef.residual("b") is None
    ef.compress("b", b, link)
    assert not torch.equal(ef.residual("a"), ef.residual("b"))
    ef.reset("a")
    assert ef.residual("a") is None and ef.residual("b") is not None
    ef.reset()
    assert ef.residual("b") is None


def test_shape_change_drops_residual() -> None:
    ef = ErrorFeedback()
    link = _topk_link(0.1)
    ef.compress("x", torch.randn(10, 10), link)
    out = ef.compress("x", torch.ones(5), lambda t: t)  # identity link: nothing dropped
    assert torch.equal(out, torch.ones(5))  # the old residual was not added
    assert torch.count_nonzero(ef.residual("x")) == 0


def test_lossless_link_keeps_zero_residual() -> None:
    ef = ErrorFeedback()
    x = torch.randn(64)
    assert torch.equal(ef.compress("x", x, lambda t: t.clone()), x)
    assert torch.count_nonzero(ef.residual("x")) == 0


def test_decay() -> None:
    ef = ErrorFeedback(decay=0.5)
    ef.record("x", torch.ones(4), torch.zeros(4))
    assert torch.equal(ef.compensate("x", torch.zeros(4)), torch.full((4,), 0.5))
    with pytest.raises(ValueError):
        ErrorFeedback(decay=1.5)
