"""The spot-checks' comparison of lossy link messages (verify/lossy.py): what a worker sent over an
AdaTopK link against what the link codec makes of the verifier's recompute.

Honest messages (the worker's tensor differs from the recompute by summation order, ~1e-6) pass,
near-ties and exact ties at the top-k threshold included, for every seed of the quantizers'
stochastic rounding tried; a 1% scaling, 1% RMS noise, another step's tensor, a keep ratio under
the floor and a codec the job does not use are caught."""

from __future__ import annotations

import pytest
import torch

from fusionnode.compress.link import LinkCompressor, LinkOptions
from fusionnode.verify.compare import CPU_REL_TOL
from fusionnode.verify.lossy import LinkRules, compare_sent
from fusionnode.wire.tensors import decode_tensor, encode_tensor

RULES = LinkRules.of("adatopk", {})


def _activation(seed: int, shape=(1, 32, 128)) -> torch.Tensor:
    g = torch.Generator().manual_seed(20_000 + seed)
    offsets = 3 * torch.randn(shape[-1], generator=g)  # activations carry per-channel offsets
    heavy = torch.randn(shape, generator=g) * torch.rand(shape, generator=g).pow(2) * 4
    return offsets + heavy


def _gradient(seed: int, shape=(1, 32, 128)) -> torch.Tensor:
    # a seed apart from the quantizer's dither seeds (1, 2, ...: the same seed would draw the same
    # uniforms the data was made of, and correlate the two)
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randn(shape, generator=g) * torch.rand((*shape[:-1], 1), generator=g) * 1e-3


def _worker_copy(y: torch.Tensor, seed: int) -> torch.Tensor:
    """What the worker computed: the recompute up to summation order (relative 1e-6)."""
    g = torch.Generator().manual_seed(30_000 + seed)
    return y * (1 + 1e-6 * torch.randn(y.shape, generator=g))


def _judge(enc, want, key="act", rules=RULES):
    return compare_sent("t", enc, decode_tensor(enc), want, rules, key, CPU_REL_TOL)


def _topk(x: torch.Tensor, ratio: float = 0.2, **kw) -> object:
    opts = {"ratio": ratio, "value_dtype": "float16", "mode": "global", "center": True, **kw}
    return encode_tensor(x.contiguous(), "topk", **opts)


def _lies(x: torch.Tensor, seed: int, stale: torch.Tensor) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(40_000 + seed)
    rms = x.pow(2).mean().sqrt()
    return {
        "scale": x * 1.01,
        "noise": x + 0.01 * rms * torch.randn(x.shape, generator=g),
        "stale": stale,
    }


@pytest.mark.parametrize("seed", range(8))
def test_topk_activations_honest_pass_and_lies_are_caught(seed):
    y = _activation(seed)
    w = _worker_copy(y, seed)
    assert _judge(_topk(w), y) is None
    for kind, lie in _lies(w, seed, _activation(seed + 100)).items():
        why = _judge(_topk(lie), y)
        assert why is not None, kind


def test_topk_near_and_exact_ties_at_the_threshold_pass():
    # many elements of (nearly) the same magnitude straddle the k-th largest: the worker's summation
    # order picks other ones than the recompute's, and exact ties go to the lowest index on one side only
    y = torch.zeros(1, 32, 128)
    y.view(-1)[::3] = 1.0  # 1366 exact ties, k = 820 of 4096
    y.view(-1)[1::7] = -1.0
    y.view(-1)[5::11] = 2.0
    centered_off = dict(center=False)
    rules = LinkRules.of("adatopk", {"center": False})
    g = torch.Generator().manual_seed(3)
    w = y * (1 + 1e-6 * torch.randn(y.shape, generator=g))  # breaks the ties differently
    enc = _topk(w, **centered_off)
    assert set(torch.nonzero(decode_tensor(enc).view(-1)).squeeze(1).tolist()) != set(
        torch.nonzero(decode_tensor(_topk(y, **centered_off)).view(-1)).squeeze(1).tolist()
    )  # a different index set than the recompute's own top-k
    assert _judge(enc, y, rules=rules) is None
    # an element far under the threshold sent instead of a tied one: not a top-k
    bad = w.clone()
    bad.view(-1)[2] = 1.5  # would be kept...
    enc_bad = _topk(bad, **centered_off)
    assert "not a top-k" in str(_judge(enc_bad, y, rules=rules))


@pytest.mark.parametrize("seed", range(6))
def test_q8_gradients_honest_pass_for_every_dither_and_lies_are_caught(seed):
    y = _gradient(seed)
    w = _worker_copy(y, seed)
    for dither in range(1, 21):  # the worker's stochastic-rounding seed is its send counter
        assert _judge(encode_tensor(w, "q8", seed=dither), y, "grad") is None
    for kind, lie in _lies(w, seed, _gradient(seed + 100)).items():
        why = _judge(encode_tensor(lie, "q8", seed=seed + 1), y, "grad")
        assert why is not None, kind


def test_q8_a_scaling_on_the_grid_is_caught_by_its_bias():
    # every element rounded away from zero: each on one of the two grid points around its true value,
    # every row's scale unchanged, so only the error's correlation with the recompute shows it
    y = _gradient(1, (8, 32, 128))
    s = y.abs().amax(dim=-1, keepdim=True) / 127
    lie = torch.sign(y) * torch.ceil(y.abs() / s).clamp(max=127) * s
    why = _judge(encode_tensor(lie, "q8"), y, "grad")
    assert why is not None and "correlated" in str(why)
    # and a 0.2% scaling that keeps every row's largest element
    absmax = y.abs().amax(dim=-1, keepdim=True)
    assert _judge(encode_tensor(torch.clamp(y * 1.002, -absmax, absmax), "q8", seed=3), y, "grad") is not None


def test_q4_warm_up_and_round_to_nearest_are_judged_within_their_bounds():
    y = _activation(4)
    w = _worker_copy(y, 4)
    assert _judge(encode_tensor(w, "q8", seed=9), y) is None  # warm-up: q8 both ways
    q4 = LinkRules.of("adatopk", {"warmup_codec": "q4", "grad_codec": "q4"})
    assert _judge(encode_tensor(w, "q4", seed=9), y, "grad", q4) is None
    assert _judge(encode_tensor(w * 1.01, "q4", seed=9), y, "grad", q4) is not None
    nearest = LinkRules.of("adatopk", {"stochastic": False})
    assert _judge(encode_tensor(w, "q8"), y, "grad", nearest) is None
    noisy = w + 0.01 * w.pow(2).mean().sqrt() * torch.randn(
        w.shape, generator=torch.Generator().manual_seed(1)
    )
    assert _judge(encode_tensor(noisy, "q8"), y, "grad", nearest) is not None


def test_the_codec_and_its_settings_are_the_jobs_not_the_workers():
    y = _activation(2)
    w = _worker_copy(y, 2)
    assert "under the job's floor" in str(_judge(_topk(w, ratio=0.05), y))  # sparser than k_min
    assert "not this job's" in str(_judge(_topk(w, mode="row"), y))
    assert "not this job's" in str(_judge(_topk(w, value_dtype="bfloat16"), y))
    assert "do not use" in str(_judge(encode_tensor(w, "q4", seed=1), y))  # q4 is not this job's
    fixed = LinkRules.of("topk:0.3", {})
    assert _judge(_topk(w, ratio=0.3), y, rules=fixed) is None
    assert "instead of the job's" in str(_judge(_topk(w, ratio=0.4), y, rules=fixed))
    dense = LinkRules.of("none", {})
    assert "do not use" in str(_judge(_topk(w), y, rules=dense))
    # a small tensor sent dense as fp16 (under min_sparse_numel): within float16's rounding
    small = _activation(3, (1, 4, 128))
    assert _judge(encode_tensor(_worker_copy(small, 3), "fp16"), small) is None
    assert _judge(encode_tensor(small * 1.01, "fp16"), small) is not None


def test_the_link_compressors_own_messages_pass_warm_up_and_top_k():
    """What a worker's LinkCompressor (the runtime's, AdaTopK at its floor) sends, step after step."""
    link = LinkCompressor("adatopk", LinkOptions(warmup_steps=2), bandwidth_bps=1e6)
    for step in range(5):
        y = _activation(step)
        w = _worker_copy(y, step)
        enc = link.encode({"x": w}, step, "act", target_time_s=1e-3)["x"]
        assert enc.codec == ("q8" if step < 2 else "topk")
        assert _judge(enc, y) is None
        g = _gradient(step)
        genc = link.encode({"x": _worker_copy(g, step)}, step, "grad", target_time_s=1e-3)["x"]
        assert genc.codec == "q8" and _judge(genc, g, "grad") is None


@pytest.mark.parametrize("spec", ["topk:0.05", "topk:0.1"])
def test_a_fixed_keep_ratio_under_adatopks_floor_is_the_jobs_own(spec):
    """`--compress topk:R` with R under k_min: the link sends R as given (no floor), so an honest
    message at R passes; another ratio, and a 1% scaling at R, are still caught."""
    rules = LinkRules.of(spec, {})
    ratio = float(spec.split(":")[1])
    link = LinkCompressor(spec, LinkOptions())
    y = _activation(4)
    enc = link.encode({"x": _worker_copy(y, 4)}, 5, "act")["x"]
    assert enc.codec == "topk" and enc.params["ratio"] == ratio
    assert _judge(enc, y, rules=rules) is None
    assert "instead of the job's" in str(_judge(_topk(y, ratio=0.2), y, rules=rules))
    assert _judge(link.encode({"x": y * 1.01}, 6, "act")["x"], y, rules=rules) is not None


@pytest.mark.parametrize("seed", range(4))
def test_fp16_and_topk_values_are_bounded_per_element_not_by_one_budget(seed):
    """Review 4 finding 5: the fp16 and top-k value bounds were one relative-L2 budget over the tensor
    (about 1.1e-3 of its norm), which a liar could spend on one chosen coordinate. Each element now
    stays within its own float16 rounding (plus the compute slack): honest copies, near-ties of the
    rounding included, pass; half that old budget put into one element is caught."""
    y = _activation(seed)
    w = _worker_copy(y, seed)
    assert _judge(encode_tensor(w, "fp16"), y) is None
    # near-ties: values a hair either side of float16 rounding midpoints round either way
    h = y.half()
    mid = (h.float() + (h.view(torch.int16) + 1).view(torch.float16).float()) / 2  # exact in float32
    near = mid * (1 + 1e-7 * torch.sign(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))))
    assert _judge(encode_tensor(near, "fp16"), mid) is None
    lie = w.clone()
    lie.view(-1)[7] += 5e-4 * float(y.norm())
    assert "fp16" in str(_judge(encode_tensor(lie, "fp16"), y))
    # top-k values (no centering, so the lie moves no channel mean): one kept value moved
    rules = LinkRules.of("adatopk", {"center": False})
    plain = dict(center=False)
    assert _judge(_topk(w, **plain), y, rules=rules) is None
    enc = _topk(w, **plain)
    kept = decode_tensor(enc).view(-1) != 0
    lie = w.clone()
    i = int(torch.nonzero(kept)[0])
    lie.view(-1)[i] += 5e-4 * float(y.view(-1)[kept].norm()) * torch.sign(y.view(-1)[i])
    assert "top-k values" in str(_judge(_topk(lie, **plain), y, rules=rules))
