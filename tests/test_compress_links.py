"""The runtime's per-link compressor (fusionnode.compress.link) with the AdaTopK default configuration."""

from __future__ import annotations

import pytest
import torch

from fusionnode.compress.link import LinkCompressor, LinkOptions
from fusionnode.compress.policy import DEFAULT_K_MIN
from fusionnode.errors import ConfigError
from fusionnode.wire.tensors import decode_tensor

torch.set_num_threads(1)

SLOW_BPS = 8e6  # bit/s: 1 MiB of activations cannot cross in the 100 ms stage time
STAGE_S = 0.1  # s


def _act() -> torch.Tensor:
    return torch.randn(16, 128, 128, generator=torch.Generator().manual_seed(0)) + 3.0


def test_defaults_on_a_slow_link_are_centered_global_topk_and_q8_gradients() -> None:
    link = LinkCompressor("adatopk", LinkOptions.from_dict({}), bandwidth_bps=SLOW_BPS)
    x = _act()
    act = link.encode({"h": x}, step=0, key="act", target_time_s=STAGE_S)["h"]
    assert act.codec == "topk" and act.params["mode"] == "global" and act.params["center"] == 1
    assert link.last_ratio == DEFAULT_K_MIN  # the link cannot carry even that: AdaTopK's floor
    grad = link.encode({"h": x * 1e-5}, step=0, key="grad", target_time_s=STAGE_S)["h"]
    assert grad.codec == "q8"
    back = decode_tensor(grad)
    assert float((back - x * 1e-5).norm() / (x * 1e-5).norm()) < 0.02
    c = link.counters()
    assert c["dense_bytes"] == 2 * x.numel() * 4
    assert c["dense_bytes"] / c["wire_bytes"] >= 5.0  # q8 (about 1/4) + top-k at the floor: > 5x together


def test_fast_link_sends_dense_and_options_restore_topk_gradients() -> None:
    fast = LinkCompressor("adatopk", bandwidth_bps=1e11)
    assert fast.encode({"h": _act()}, 0, "grad", STAGE_S)["h"].codec == "raw"
    old = LinkCompressor(
        "adatopk", LinkOptions.from_dict({"grad_codec": "topk", "mode": "row"}), bandwidth_bps=SLOW_BPS
    )
    enc = old.encode({"h": _act()}, 0, "grad", STAGE_S)["h"]
    assert enc.codec == "topk" and enc.params["mode"] == "row" and "center" not in enc.params


def test_stochastic_gradients_are_deterministic_per_link_and_non_finite_falls_back() -> None:
    a = LinkCompressor("topk:0.05", LinkOptions(grad_codec="q4"))
    b = LinkCompressor("topk:0.05", LinkOptions(grad_codec="q4"))
    g = torch.randn(4, 64)
    assert bytes(a.encode({"g": g}, 0, "grad")["g"].data) == bytes(b.encode({"g": g}, 0, "grad")["g"].data)
    g[0, 0] = float("inf")
    assert a.encode({"g": g}, 1, "grad")["g"].codec == "fp16"


def test_unknown_gradient_codec_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        LinkCompressor("adatopk", LinkOptions(grad_codec="zip"))


def test_warmup_on_a_slow_link_sends_q8_both_ways_then_topk() -> None:
    link = LinkCompressor("adatopk", LinkOptions.from_dict({"warmup_steps": 2}), bandwidth_bps=SLOW_BPS)
    x = _act()
    for step in range(2):
        assert link.encode({"h": x}, step, "act", STAGE_S)["h"].codec == "q8"
        assert link.encode({"h": x}, step, "grad", STAGE_S)["h"].codec == "q8"
        assert link.ratio_for(step, x.numel() * 4, STAGE_S) == 1.0
    assert link.encode({"h": x}, 2, "act", STAGE_S)["h"].codec == "topk"
    fast = LinkCompressor("adatopk", LinkOptions(warmup_steps=2), bandwidth_bps=1e11)
    assert fast.encode({"h": x}, 0, "act", STAGE_S)["h"].codec == "raw"  # a link that keeps up stays dense
