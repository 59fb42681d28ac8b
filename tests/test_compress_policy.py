"""AdaTopKPolicy (keep ratio from link speed, with hysteresis) and the --compress parser."""

from __future__ import annotations

import random

import pytest

from fusionnode.compress.policy import AdaTopKPolicy, CompressSpec, link_time, parse_compress
from fusionnode.compress.topk import payload_bytes
from fusionnode.errors import ConfigError

MIB = 1 << 20
ACT_BYTES = 16 * 128 * 128 * 4  # a gpt2-tiny activation, float32: 1 MiB
GBIT = 1e9  # bit/s
MBIT = 1e6  # bit/s
LOW = 0.01  # the codec's minimum: below AdaTopK's default floor, to see the policy's rule at low ratios


def test_dense_on_fast_link() -> None:
    policy = AdaTopKPolicy()
    # 1 MiB at 1 Gbit/s takes 8.4 ms; the stage takes 50 ms
    assert policy.choose(GBIT, 0.001, ACT_BYTES, 0.050) == 1.0


def test_default_floor_is_the_plans() -> None:
    """The runtime's floor is the one a plan counts on (plan/estimator.py PLAN_KEEP_FLOOR): on a link
    that cannot carry even that, the policy answers the floor, never less."""
    from fusionnode.compress.link import LinkOptions
    from fusionnode.compress.policy import DEFAULT_K_MIN
    from fusionnode.plan.estimator import PLAN_KEEP_FLOOR

    assert DEFAULT_K_MIN == PLAN_KEEP_FLOOR == LinkOptions().k_min
    assert AdaTopKPolicy().choose(8 * MBIT, 0.010, ACT_BYTES, 0.080) == PLAN_KEEP_FLOOR
    assert AdaTopKPolicy(k_min=LOW).choose(8 * MBIT, 0.010, ACT_BYTES, 0.080) < PLAN_KEEP_FLOOR


def test_compresses_to_at_most_ten_percent_on_slow_link() -> None:
    policy = AdaTopKPolicy(k_min=LOW)
    r = policy.choose(8 * MBIT, 0.010, ACT_BYTES, 0.080)
    assert 0.01 <= r <= 0.10
    # the chosen payload fits the time budget, counting index and value bytes
    numel = ACT_BYTES // 4
    assert link_time(payload_bytes(numel, r), 8 * MBIT, 0.010) <= 0.8 * 0.080 + 1e-9
    # and a slightly larger ratio would not (the ratio is the largest that fits)
    assert link_time(payload_bytes(numel, min(1.0, r * 1.05)), 8 * MBIT, 0.010) > 0.8 * 0.080


def test_ratio_counts_index_bytes_not_four_bytes_per_element() -> None:
    policy = AdaTopKPolicy()
    numel = ACT_BYTES // 4
    r = policy.ideal_ratio(8 * MBIT, 0.0, ACT_BYTES, 0.2)
    naive = 0.8 * 0.2 * 8 * MBIT / 8 / (numel * 4)  # as if a kept element cost its 4 dense bytes
    assert r != pytest.approx(naive, rel=0.05)
    assert payload_bytes(numel, r) <= 0.8 * 0.2 * 1e6


def test_row_mode_accounts_for_narrow_indices() -> None:
    glob = AdaTopKPolicy(k_min=LOW).ideal_ratio(8 * MBIT, 0.0, ACT_BYTES, 0.03)
    row = AdaTopKPolicy(k_min=LOW, row_len=128).ideal_ratio(8 * MBIT, 0.0, ACT_BYTES, 0.03)
    assert row > glob  # one-byte row indices buy more kept elements than four-byte flat ones


def test_k_min_floor_when_nothing_fits() -> None:
    policy = AdaTopKPolicy(k_min=0.02)
    assert policy.choose(1 * MBIT, 0.5, ACT_BYTES, 0.1) == 0.02  # latency alone exceeds the target


def test_monotone_in_bandwidth() -> None:
    policy = AdaTopKPolicy()
    ratios = [policy.ideal_ratio(bw * MBIT, 0.005, 16 * MIB, 0.1) for bw in (5, 10, 50, 100, 500, 2000)]
    assert ratios == sorted(ratios)
    assert ratios[0] == policy.k_min and ratios[-1] == 1.0


def test_ewma_bandwidth_and_first_choice_without_observation() -> None:
    policy = AdaTopKPolicy(ewma_alpha=0.5)
    assert policy.bandwidth_bps is None
    assert policy.choose(None, 0.0, ACT_BYTES, 0.05) == 1.0  # nothing known yet: stay dense
    policy.observe(1_000_000, 1.0)  # 8 Mbit/s
    assert policy.bandwidth_bps == pytest.approx(8e6)
    policy.observe(2_000_000, 1.0)
    assert policy.bandwidth_bps == pytest.approx(12e6)
    policy.observe(0, 1.0)  # ignored
    policy.observe(10, 0.0)  # ignored
    assert policy.bandwidth_bps == pytest.approx(12e6)
    assert policy.choose(None, 0.0, ACT_BYTES, 0.05) < 1.0


def test_hysteresis_prevents_flapping_on_noisy_bandwidth() -> None:
    rng = random.Random(0)
    smooth = AdaTopKPolicy(k_min=LOW)
    raw = AdaTopKPolicy(k_min=LOW, hysteresis=1.0, ewma_alpha=1.0)
    changes_smooth = changes_raw = 0
    prev_s = prev_r = None
    for _ in range(300):
        bw = 8 * MBIT * rng.uniform(0.6, 1.4)  # +-40% noise around 8 Mbit/s
        seconds = 1.0
        for policy in (smooth, raw):
            policy.observe(int(bw * seconds / 8), seconds)
        s = smooth.choose(None, 0.01, ACT_BYTES, 0.08)
        r = raw.choose(None, 0.01, ACT_BYTES, 0.08)
        changes_smooth += prev_s is not None and s != prev_s
        changes_raw += prev_r is not None and r != prev_r
        prev_s, prev_r = s, r
    assert changes_raw > 100  # without smoothing and hysteresis the ratio follows the noise
    assert changes_smooth <= 3
    assert 0.01 <= smooth.ratio <= 0.2


def test_hysteresis_band_around_dense() -> None:
    policy = AdaTopKPolicy(k_min=LOW, hysteresis=1.25)
    target = 0.1
    fits_bw = ACT_BYTES * 8 / target  # dense exactly fits at this bandwidth
    assert policy.choose(fits_bw * 0.95, 0.0, ACT_BYTES, target) < 1.0  # no longer fits: compress
    # just fitting again is not enough to go back to dense ...
    assert policy.choose(fits_bw * 1.05, 0.0, ACT_BYTES, target) < 1.0
    # ... fitting with a margin of the hysteresis factor is
    assert policy.choose(fits_bw * 1.3, 0.0, ACT_BYTES, target) == 1.0


def test_large_moves_are_followed() -> None:
    policy = AdaTopKPolicy(k_min=LOW)
    a = policy.choose(20 * MBIT, 0.0, ACT_BYTES, 0.08)
    b = policy.choose(5 * MBIT, 0.0, ACT_BYTES, 0.08)
    assert b < a / 1.25


def test_bad_policy_arguments() -> None:
    for kwargs in (
        {"k_min": 0.0},
        {"k_min": 1.5},
        {"hysteresis": 0.5},
        {"ewma_alpha": 0.0},
        {"value_dtype": "int8"},
    ):
        with pytest.raises(ConfigError):
            AdaTopKPolicy(**kwargs)
    with pytest.raises(ValueError):
        AdaTopKPolicy().ideal_ratio(0.0, 0.0, ACT_BYTES, 0.1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("adatopk", CompressSpec("adatopk")),
        ("AdaTopK", CompressSpec("adatopk")),
        ("fp16", CompressSpec("fp16")),
        ("none", CompressSpec("none")),
        ("topk:0.1", CompressSpec("topk", 0.1)),
        ("topk:1", CompressSpec("topk", 1.0)),
        (" topk:0.005 ", CompressSpec("topk", 0.005)),
    ],
)
def test_parse_compress(text: str, expected: CompressSpec) -> None:
    assert parse_compress(text) == expected


def test_parse_compress_adaptive_flag() -> None:
    assert parse_compress("adatopk").adaptive
    assert not parse_compress("topk:0.5").adaptive


@pytest.mark.parametrize(
    "text",
    [
        "",
        "topk",
        "topk:",
        "topk:0",
        "topk:-0.1",
        "topk:1.01",
        "topk:nan",
        "topk:inf",
        "topk:abc",
        "gzip",
        "top-k:0.1",
    ],
)
def test_parse_compress_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_compress(text)
