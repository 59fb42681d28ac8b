"""The keyed dither of q8/q4 links (compress/dither.py) and the exact-grid check it allows
(verify/lossy.py): review finding 4 of issue 20.

A worker that keeps each element's chance of rounding up at its honest value f, but couples the
directions to a vector d of its choice (the reviewer's construction), passes the grid and z-tests when
the checker does not know the dither (a per-link counter seed): 0.5% of ||y|| along d. With the dither
keyed by (job, stage, step, micro-batch, key, name) the checker asks for the exact grid point and
catches it; honest workers (their tensor the recompute up to summation order) pass."""

from __future__ import annotations

import pytest
import torch

from fusionnode.compress.dither import dither_seed
from fusionnode.compress.link import LinkCompressor, LinkOptions
from fusionnode.errors import ConfigError
from fusionnode.verify.compare import CPU_REL_TOL
from fusionnode.verify.lossy import LinkRules, compare_sent, compare_sent_all
from fusionnode.wire.tensors import decode_tensor, encode_tensor

JOB = "job-7f3a"
KEYED = LinkRules.of("adatopk", {}, job=JOB)
COUNTER = LinkRules.of("adatopk", {"dither": "counter"}, job=JOB)


def _gradient(seed: int, shape=(64, 768)) -> torch.Tensor:
    g = torch.Generator().manual_seed(50_000 + seed)
    return torch.randn(shape, generator=g)


def _worker_copy(y: torch.Tensor, seed: int) -> torch.Tensor:
    """What the worker computed: the recompute up to summation order (relative 1e-6)."""
    g = torch.Generator().manual_seed(60_000 + seed)
    return y * (1 + 1e-6 * torch.randn(y.shape, generator=g))


def _steered(y: torch.Tensor, d: torch.Tensor, seed: int) -> torch.Tensor:
    """The reviewer's liar: every element on one of its two grid points, P(up) = f on average over the
    sign of d (the variance of honest rounding), but rounded up where d > 0 more often."""
    s = y.abs().amax(dim=1, keepdim=True) / 127
    f = y / s - torch.floor(y / s)
    u = torch.rand(y.shape, generator=torch.Generator().manual_seed(70_000 + seed))
    up = torch.where(d > 0, u < (2 * f).clamp(max=1), u < (2 * f - 1).clamp(min=0))
    return (torch.floor(y / s) + up.float()) * s


def _sent(link: LinkCompressor, w: torch.Tensor, step: int, mb: int):
    return link.encode({"g": w}, step, "grad", mb=mb)


def _compressing_link(stage: int = 3) -> LinkCompressor:
    link = LinkCompressor("topk:0.2", LinkOptions(), dither_key=(JOB, stage))
    return link


def test_the_seed_is_a_fixed_function_of_the_message():
    # the golden value (protocol/vectors/q8_keyed_dither.json): any change of the derivation is a new
    # DOMAIN, not silently other bits
    assert dither_seed("job-7f3a", 3, 12, 1, "grad", "x") == 0x6437871AD023B517
    seeds = {dither_seed(JOB, st, step, mb, k, n) for st in (0, 1) for step in (0, 1) for mb in (0, 1)
             for k in ("act", "grad") for n in ("x", "h")}  # fmt: skip
    assert len(seeds) == 32 and all(0 <= v < 2**63 for v in seeds)


@pytest.mark.parametrize("seed", range(4))
def test_an_honest_keyed_worker_passes_the_exact_grid_check(seed):
    y = _gradient(seed)
    w = _worker_copy(y, seed)
    link = _compressing_link()
    for step, mb in ((0, 0), (5, 1), (11, 3)):
        enc = _sent(link, w, step, mb)
        assert enc["g"].codec == "q8"
        got = {"g": decode_tensor(enc["g"])}
        assert (
            compare_sent_all(got, enc, {"g": y}, KEYED, "grad", CPU_REL_TOL, "gradient", (3, step, mb)) == []
        )
        # the same message judged as another micro-batch's: its dither is not that one's
        bad = compare_sent_all(got, enc, {"g": y}, KEYED, "grad", CPU_REL_TOL, "gradient", (3, step, mb + 1))
        assert bad and "rounding steered" in str(bad[0]), bad


@pytest.mark.parametrize("seed", range(4))
def test_a_directed_rounding_liar_is_caught_with_the_keyed_dither(seed):
    y = _gradient(seed)
    d = torch.randn(y.shape, generator=torch.Generator().manual_seed(80_000 + seed))
    lie = _steered(y, d, seed)
    enc = encode_tensor(lie, "q8")  # on-grid values: round to nearest gives them back, scales unchanged
    got = decode_tensor(enc)
    along = float(((got - y) * d).sum() / d.norm() / y.norm())
    print(f"free steer along d: {along:.3g} of ||y||")
    assert along > 3e-3  # the steer: ~0.5% of ||y|| along d (honest rounding: ~1e-5)
    # without the keyed dither (the old per-link counter) it passes every test the checker has
    assert compare_sent("g", enc, got, y, COUNTER, "grad", CPU_REL_TOL) is None
    # with it, the checker knows u and asks for floor(y / s + u)
    why = compare_sent("g", enc, got, y, KEYED, "grad", CPU_REL_TOL, KEYED.seed((3, 4, 0), "grad", "g"))
    assert why is not None and "rounding steered" in str(why), why


def test_what_is_left_to_steer_is_the_recompute_slack_band():
    # a liar that flips only the elements within the slack of a grid boundary (all it may) moves the
    # message along d by a small fraction of what the free choice gave
    y = _gradient(9)
    d = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
    link = _compressing_link()
    enc = _sent(link, y, 4, 0)["g"]
    honest = decode_tensor(enc)
    s = y.abs().amax(dim=1, keepdim=True) / 127
    from fusionnode.compress.quant import dither_rows

    w = y / s + dither_rows(KEYED.seed((3, 4, 0), "grad", "g"), *y.shape)
    slack = 1e-3 + CPU_REL_TOL * 127
    frac = w - torch.floor(w)
    band_up = (frac > 1 - slack) & (d > 0)  # may round up one more
    band_down = (frac < slack) & (d < 0)  # may round down one fewer
    q = torch.round(honest / s) + band_up.float() - band_down.float()
    lie = q.clamp(-127, 127) * s
    enc_lie = encode_tensor(lie, "q8")
    got = decode_tensor(enc_lie)
    seed = KEYED.seed((3, 4, 0), "grad", "g")
    assert compare_sent("g", enc_lie, got, y, KEYED, "grad", CPU_REL_TOL, seed) is None  # within the band
    along = float(((got - y) * d).sum() / d.norm() / y.norm())
    print(f"band-only steer along d: {along:.3g} of ||y||")
    assert 0 < along < 5e-4, along


def test_the_dither_option_is_checked_and_counter_links_keep_their_counter():
    with pytest.raises(ConfigError):
        LinkOptions(dither="random")
    y = _gradient(1)
    counter = LinkCompressor("topk:0.2", LinkOptions(dither="counter"), dither_key=(JOB, 3))
    first = _sent(counter, y, 0, 0)["g"]
    assert first.data == encode_tensor(y, "q8", seed=1).data  # seed 1: the link's first send
    keyed = _sent(_compressing_link(), y, 0, 0)["g"]
    assert keyed.data == encode_tensor(y, "q8", seed=dither_seed(JOB, 3, 0, 0, "grad", "g")).data


def test_the_golden_vector_is_the_keyed_encoding():
    import json
    import pathlib

    from fusionnode.wire import pack_encoded

    path = pathlib.Path(__file__).resolve().parents[1] / "protocol" / "vectors" / "q8_keyed_dither.json"
    vector = json.loads(path.read_text())
    ctx = dict(vector["dither"])
    seed = ctx.pop("seed")
    assert dither_seed(**ctx) == seed
    values = torch.tensor(vector["decoded"]["values"]).reshape(vector["decoded"]["shape"])
    w = torch.tensor([[0.3, -0.71, 0.05, 0.9], [-1.2, 0.44, 0.61, -0.02]])
    enc = encode_tensor(w, "q8", seed=seed)
    assert pack_encoded(enc).hex() == vector["hex"]
    assert torch.equal(decode_tensor(enc), values)
