"""AdaTopK keep-ratio policy and the `--compress` setting.

The policy answers one question per link: what fraction of a tensor's elements can we
send so that moving it takes no longer than the pipeline's compute-bound stage time?
It counts the real payload of the "topk" codec (index section + value bytes, see
`topk.payload_bytes`), not 4 bytes per kept element, and answers 1.0 (dense, no top-k)
when the link keeps up. Bandwidth is smoothed by an EWMA of observed transfers and the
ratio in force is kept while its transfer time stays within a band of width `hysteresis`
(a factor) under the stage time, so a noisy link does not make it flap.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from fusionnode.compress.topk import DEFAULT_VALUE_DTYPE, VALUE_BYTES, payload_bytes
from fusionnode.errors import ConfigError
from fusionnode.plan.estimator import PLAN_KEEP_FLOOR

logger = logging.getLogger(__name__)

# smallest keep ratio the policy will choose: AdaTopK's floor, where the benchmark measured the loss
# it costs (plan/estimator.py PLAN_KEEP_FLOOR, the same figure a plan may count on)
DEFAULT_K_MIN = PLAN_KEEP_FLOOR
DEFAULT_HYSTERESIS = 1.5  # factor on transfer time: the band in which the ratio in force is kept
DEFAULT_EWMA_ALPHA = 0.2  # weight of the newest bandwidth sample in the EWMA
DEFAULT_TARGET_FRACTION = 0.8  # aim the link at this fraction of the stage time (headroom)
DEFAULT_ELEMENT_BYTES = 4  # bytes per element of the dense tensor (float32)
_BISECT_STEPS = 48  # bisection steps on the ratio; 2^-48 is far below one element

COMPRESS_KINDS = ("adatopk", "topk", "fp16", "none")


@dataclasses.dataclass(frozen=True)
class CompressSpec:
    """A parsed `--compress` setting: kind, and the fixed keep ratio for kind "topk"."""

    kind: str  # one of COMPRESS_KINDS
    ratio: float | None = None  # keep ratio in (0, 1] for "topk"; None otherwise

    @property
    def adaptive(self) -> bool:
        return self.kind == "adatopk"


def parse_compress(spec: str) -> CompressSpec:
    """Parse "adatopk" | "topk:RATIO" | "fp16" | "none" (case-insensitive); ConfigError otherwise."""
    if not isinstance(spec, str):
        raise ConfigError(f"compression setting must be a string, got {type(spec).__name__}")
    text = spec.strip().lower()
    if text in ("adatopk", "fp16", "none"):
        return CompressSpec(kind=text)
    if text.startswith("topk:"):
        raw = text[len("topk:") :]
        try:
            ratio = float(raw)
        except ValueError:
            raise ConfigError(
                f"topk ratio {raw!r} is not a number (expected topk:RATIO, 0 < RATIO <= 1)"
            ) from None
        if not (math.isfinite(ratio) and 0.0 < ratio <= 1.0):
            raise ConfigError(f"topk ratio must be in (0, 1], got {raw!r}")
        return CompressSpec(kind="topk", ratio=ratio)
    if text == "topk":
        raise ConfigError("topk needs a keep ratio: topk:RATIO, e.g. topk:0.1")
    raise ConfigError(f"unknown compression {spec!r} (expected adatopk, topk:RATIO, fp16 or none)")


def link_time(nbytes: int, bandwidth_bps: float, latency_s: float) -> float:
    """Seconds to move `nbytes` over a link of `bandwidth_bps` bits/s and one-way `latency_s`."""
    return latency_s + nbytes * 8.0 / bandwidth_bps


class AdaTopKPolicy:
    """Per-link keep-ratio chooser with a smoothed bandwidth and hysteresis (one instance per link)."""

    def __init__(
        self,
        k_min: float = DEFAULT_K_MIN,
        hysteresis: float = DEFAULT_HYSTERESIS,
        *,
        ewma_alpha: float = DEFAULT_EWMA_ALPHA,
        target_fraction: float = DEFAULT_TARGET_FRACTION,
        value_dtype: str = DEFAULT_VALUE_DTYPE,
        element_bytes: int = DEFAULT_ELEMENT_BYTES,
        row_len: int | None = None,
        center_channels: int = 0,
    ) -> None:
        if not (0.0 < k_min <= 1.0):
            raise ConfigError(f"k_min must be in (0, 1], got {k_min!r}")
        if not hysteresis >= 1.0:
            raise ConfigError(f"hysteresis is a factor >= 1, got {hysteresis!r}")
        if not (0.0 < ewma_alpha <= 1.0):
            raise ConfigError(f"ewma_alpha must be in (0, 1], got {ewma_alpha!r}")
        if not (0.0 < target_fraction <= 1.0):
            raise ConfigError(f"target_fraction must be in (0, 1], got {target_fraction!r}")
        if value_dtype not in VALUE_BYTES:
            raise ConfigError(f"value_dtype must be one of {sorted(VALUE_BYTES)}, got {value_dtype!r}")
        self.k_min = k_min
        self.hysteresis = hysteresis
        self.ewma_alpha = ewma_alpha
        self.target_fraction = target_fraction
        self.value_dtype = value_dtype
        self.element_bytes = element_bytes
        self.row_len = row_len  # None: global top-k; else the row length of per-row top-k
        self.center_channels = center_channels  # channel means sent per message (centered topk), else 0
        self._bandwidth_bps: float | None = None
        self._ratio = 1.0

    @property
    def bandwidth_bps(self) -> float | None:
        """Smoothed bandwidth in bits per second, None before the first observation."""
        return self._bandwidth_bps

    @property
    def ratio(self) -> float:
        """The keep ratio currently in force (1.0 = dense)."""
        return self._ratio

    def observe(self, nbytes: int, seconds: float) -> None:
        """Fold one measured transfer (`nbytes` in `seconds`) into the bandwidth EWMA."""
        if nbytes <= 0 or not seconds > 0.0:
            return
        sample = nbytes * 8.0 / seconds
        prev = self._bandwidth_bps
        self._bandwidth_bps = sample if prev is None else prev + self.ewma_alpha * (sample - prev)

    def ideal_ratio(
        self, bandwidth_bps: float, latency_s: float, dense_bytes: int, target_time_s: float
    ) -> float:
        """Stateless: the largest keep ratio whose payload crosses the link within the target.

        1.0 when the dense tensor already fits in `target_time_s`; otherwise the largest r in
        [k_min, 1) with latency + payload_bytes(r) * 8 / bandwidth <= target_fraction * target;
        k_min when even that does not fit (the link stays the bottleneck).
        """
        if not bandwidth_bps > 0.0:
            raise ValueError(f"bandwidth must be positive, got {bandwidth_bps!r}")
        if link_time(dense_bytes, bandwidth_bps, latency_s) <= target_time_s:
            return 1.0
        numel = dense_bytes // self.element_bytes
        budget = (self.target_fraction * target_time_s - latency_s) * bandwidth_bps / 8.0  # bytes

        def fits(r: float) -> bool:
            return payload_bytes(numel, r, self.value_dtype, self.row_len, self.center_channels) <= budget

        if not fits(self.k_min):
            return self.k_min
        lo, hi = self.k_min, 1.0  # fits(lo), and hi either does not fit or is dense
        for _ in range(_BISECT_STEPS):
            mid = 0.5 * (lo + hi)
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def choose(
        self,
        bandwidth_bps: float | None,
        latency_s: float,
        dense_bytes: int,
        target_time_s: float,
    ) -> float:
        """The keep ratio to use for the next tensor on this link (1.0 = dense).

        `bandwidth_bps` None uses the EWMA of `observe`d transfers (dense until the first one).
        The ratio in force changes only when its transfer time leaves the band
        [target_fraction * target / hysteresis, target] (the link would become the bottleneck,
        or it wastes more than a factor `hysteresis` of the budget); leaving dense happens as
        soon as the dense tensor stops fitting in the target, going back to dense only once it
        fits `hysteresis` times over. A change always jumps to the ideal ratio.
        """
        bw = self._bandwidth_bps if bandwidth_bps is None else bandwidth_bps
        if bw is None:
            return self._ratio
        ideal = self.ideal_ratio(bw, latency_s, dense_bytes, target_time_s)
        current = self._ratio
        if current == 1.0:
            new = ideal  # dense: compress as soon as the dense tensor stops fitting
        elif link_time(dense_bytes, bw, latency_s) * self.hysteresis <= target_time_s:
            new = 1.0  # dense fits with a margin of `hysteresis`: stop compressing
        else:
            numel = dense_bytes // self.element_bytes
            t_cur = link_time(
                payload_bytes(numel, current, self.value_dtype, self.row_len, self.center_channels),
                bw,
                latency_s,
            )
            low = self.target_fraction * target_time_s / self.hysteresis
            # keep the ratio while its transfer neither overruns the stage time nor wastes
            # more than a factor `hysteresis` of the budget
            keep = (
                ideal == 1.0 or low <= t_cur <= target_time_s
            )  # ideal 1.0: dense fits, but not by the margin
            new = current if keep else ideal
        if new != current:
            logger.debug("adatopk ratio %.4f -> %.4f (bandwidth %.3g bit/s)", current, new, bw)
            self._ratio = new
        return new
