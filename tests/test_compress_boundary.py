"""CompressionBoundary: a pipeline cut in one process, through the runtime's link compressor,
the real codec and packing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusionnode.compress.boundary import CompressionBoundary, LinkCounters, transmit
from fusionnode.compress.link import LinkOptions, adatopk_config
from fusionnode.compress.topk import keep_count
from fusionnode.wire.tensors import encode_tensor, pack_encoded


def test_transmit_dense_counts_packed_bytes() -> None:
    x = torch.randn(8, 16)
    y, c = transmit(x, None)
    assert torch.equal(y, x)
    assert c.dense_bytes == 8 * 16 * 4
    assert c.wire_bytes == len(pack_encoded(encode_tensor(x, "raw")))
    y16, c16 = transmit(x, 1.0, dense_codec="fp16")
    assert torch.equal(y16, x.half().float()) and c16.wire_bytes < c.wire_bytes


def test_transmit_topk_row() -> None:
    x = torch.randn(4, 32, 128)
    y, c = transmit(x, 0.05, mode="row")
    k_row = keep_count(128, 0.05)
    assert bool(((y != 0).sum(-1) == k_row).all())
    assert c.reduction > 10  # 7 kept of 128, one-byte index + two-byte value each


def test_forward_and_backward_through_boundary() -> None:
    # fixed ratios, per-row top-k both ways, on tensors of any size
    opts = LinkOptions(mode="row", center=False, grad_codec="topk", min_sparse_numel=0)
    boundary = CompressionBoundary.of("topk:0.25", opts, backward_spec="topk:0.5")
    x = torch.randn(2, 8, 16, requires_grad=True)
    y = boundary(x)
    assert bool(((y != 0).sum(-1) == 4).all())  # 25% of 16 per row
    w = torch.randn(2, 8, 16)
    (y * w).sum().backward()
    # straight-through: x.grad is the compressed upstream gradient, not masked by the forward
    assert int(torch.count_nonzero(x.grad)) == 2 * 8 * 8
    kept = x.grad != 0
    torch.testing.assert_close(x.grad[kept], w[kept].half().float())
    assert boundary.forward_counters.dense_bytes == 2 * 8 * 16 * 4
    assert boundary.backward_counters.dense_bytes == 2 * 8 * 16 * 4
    assert boundary.counters == boundary.forward_counters + boundary.backward_counters


def test_warmup_is_dense_then_compresses() -> None:
    opts = LinkOptions(mode="row", center=False, warmup_steps=2, warmup_codec="raw", min_sparse_numel=0)
    boundary = CompressionBoundary.of("topk:0.1", opts, backward_spec="none")
    x = torch.randn(4, 64)
    for _ in range(2):
        assert torch.equal(boundary(x), x)
        boundary.next_step()
    assert int(torch.count_nonzero(boundary(x))) == 4 * keep_count(64, 0.1)


def test_backward_feedback_accumulates_dropped_gradient() -> None:
    opts = LinkOptions(
        mode="global", grad_codec="topk", error_feedback=True, value_dtype="float32", min_sparse_numel=0
    )
    boundary = CompressionBoundary.of("none", backward_spec="topk:0.1", backward_options=opts)
    g = torch.randn(100, generator=torch.Generator().manual_seed(1))
    total = torch.zeros(100)
    steps = 30
    for _ in range(steps):
        x = torch.zeros(100, requires_grad=True)
        boundary(x).backward(g)
        total += x.grad
        boundary.next_step()
    residual = boundary.backward.feedback.residual("grad/cut")
    # exact bookkeeping: what arrived = what was meant - what is still owed
    torch.testing.assert_close(total, steps * g - residual, rtol=0, atol=1e-4)
    # without feedback the same 10 coordinates would arrive every time; with it, many more do
    assert int(torch.count_nonzero(total)) > 50
    assert residual.norm() < 0.2 * (steps * g).norm()


def test_link_counters() -> None:
    c = LinkCounters(100, 20) + LinkCounters(50, 10)
    assert c == LinkCounters(150, 30) and c.reduction == 5.0
    assert LinkCounters().reduction == 1.0


def test_bad_config() -> None:
    with pytest.raises(ValueError):
        CompressionBoundary.of("topk:0.0")
    with pytest.raises(ValueError):
        LinkOptions(mode="column")
    with pytest.raises(ValueError):
        CompressionBoundary.of("zip")


def test_adatopk_config_quantizes_gradients_and_warmup() -> None:
    # a link far too slow for the stage time: the policy compresses (below 5%: the floor lowered from
    # AdaTopK's default to see the codec at a low ratio)
    opts = dataclasses.replace(adatopk_config(warmup_steps=1), min_sparse_numel=0, k_min=0.01)
    boundary = CompressionBoundary.of("adatopk", opts, bandwidth_bps=1e4, target_time_s=0.1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, 32, generator=g) + 2.0
    w = torch.randn(4, 16, 32, generator=g) * 1e-4
    x0 = x.clone().requires_grad_(True)
    y = boundary(x0)  # warm-up: q8 both ways, close but not exact
    assert (
        not torch.equal(y.detach(), x) and float((y.detach() - x).abs().max()) <= float(x.abs().max()) / 127
    )
    (y * w).sum().backward()
    assert float((x0.grad - w).norm() / w.norm()) < 0.02
    assert (
        boundary.forward_counters.wire_bytes < boundary.forward_counters.dense_bytes / 3
    )  # q8 + scales + framing
    boundary.next_step()
    x1 = x.clone().requires_grad_(True)
    y = boundary(x1)  # centered global top-k: dropped elements decode to the channel mean
    assert boundary.forward_ratio <= 0.05  # as the policy set it
    mean = x.view(-1, 32).mean(0).half().float()  # what the sender sends as channel means
    assert int(torch.count_nonzero(y.detach() != mean)) <= keep_count(x.numel(), 0.05)
    (y * w).sum().backward()
    assert boundary.backward_ratio <= 0.05
    assert int(torch.count_nonzero(x1.grad)) > 0.9 * x.numel()  # q8, not top-k
    assert float((x1.grad - w).norm() / w.norm()) < 0.02
