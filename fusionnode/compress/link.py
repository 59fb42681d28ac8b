"""The link compressor: what codec each tensor crossing a pipeline link gets (the only one).

The runtime's workers and the in-process AdaTopK benchmark (`CompressionBoundary` in
compress/boundary.py, `fusionnode bench adatopk`) both encode with it. One `LinkCompressor`
per (stage, direction): activations to the next stage,
activation gradients to the previous one. The job's ``--compress`` setting picks
the behaviour: ``none`` (raw), ``fp16``, ``topk:R`` (a fixed keep ratio), or
``adatopk`` (the ratio follows the link: dense while the link keeps up with the
pipeline's compute-bound stage time, as sparse as needed when it does not). The
bandwidth comes from the peer's link probe and is then tracked from the measured
sends. Counters keep the dense and the wire bytes of the link.

What a compressing link sends (protocol/COMPRESSION.md, "Measurements"): activations
(message key "act") as centered global top-k at the policy's ratio; activation
gradients (key "grad") as per-row int8 ("q8", seeded stochastic rounding) instead of
top-k, because sparsifying gradients is what costs convergence. `LinkOptions.grad_codec`
"topk" restores top-k gradients; "q4" halves their bytes again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import fusionnode.compress.quant  # noqa: F401  (registers "q8" and "q4")
from fusionnode.compress.dither import DITHERS, dither_seed
from fusionnode.compress.feedback import ErrorFeedback
from fusionnode.compress.policy import DEFAULT_K_MIN, AdaTopKPolicy, CompressSpec, parse_compress
from fusionnode.compress.topk import MODES, VALUE_DTYPES
from fusionnode.errors import ConfigError
from fusionnode.wire.codec_api import EncodedTensor
from fusionnode.wire.job import TensorKind
from fusionnode.wire.tensors import decode_tensor, encode_tensor

MIN_SPARSE_NUMEL = 4096  # tensors smaller than this always go dense (indices would cost more than they save)
DENSE_ABOVE = 0.98  # a keep ratio above this is sent dense: top-k would save next to nothing
MIN_OBSERVED_BYTES = 256 << 10  # smaller sends fit in socket buffers and token-bucket bursts: not timed
DEFAULT_LATENCY_S = 0.0  # seconds, when nothing better is known
ACT_KEY = TensorKind.ACT  # message key of activations (the forward direction)
GRAD_KEY = TensorKind.GRAD  # message key of activation gradients (the backward direction)
GRAD_CODECS = ("q8", "q4", "topk")  # what a compressing link does to gradients
WARMUP_CODECS = ("q8", "q4", "raw")  # what warm-up steps of a compressing link send
DEFAULT_DITHER = "keyed"  # what a driver writes into every job's link_options unless asked otherwise
ABSENT_DITHER = "counter"  # what a worker reads when an assignment's link_options carry no dither


@dataclasses.dataclass
class LinkOptions:
    mode: str = "global"  # top-k selection: "row" (per token, the last dimension) or "global"
    value_dtype: str = "float16"
    warmup_steps: int = 0  # steps sent dense before compression starts (AC-SGD's warm-up)
    error_feedback: bool = False  # carry what top-k dropped into the next message (top-k only)
    k_min: float = DEFAULT_K_MIN  # AdaTopK's keep-ratio floor (compress/policy.py)
    center: bool = True  # activations: send channel means, top-k of the centered tensor
    grad_codec: str = "q8"  # gradients ("grad" messages) on a compressing link: "q8", "q4" or "topk"
    stochastic: bool = True  # q8/q4: seeded stochastic (unbiased) rounding instead of nearest
    dither: str = DEFAULT_DITHER  # its seed: "keyed" (compress/dither.py) or "counter" (per link)
    warmup_codec: str = "q8"  # warm-up steps on a compressing link send this both ways: "q8", "q4" or "raw"
    center_gradients: bool = False  # with `center`: gradients centered too (an experiment's knob)
    min_sparse_numel: int = MIN_SPARSE_NUMEL  # smaller tensors go dense (fp16 on a compressing link)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.value_dtype not in VALUE_DTYPES:
            raise ConfigError(f"value_dtype must be one of {sorted(VALUE_DTYPES)}, got {self.value_dtype!r}")
        if self.grad_codec not in GRAD_CODECS:
            raise ConfigError(f"grad_codec must be one of {GRAD_CODECS}, got {self.grad_codec!r}")
        if self.dither not in DITHERS:
            raise ConfigError(f"dither must be one of {DITHERS}, got {self.dither!r}")
        if self.warmup_codec not in WARMUP_CODECS:
            raise ConfigError(f"warmup_codec must be one of {WARMUP_CODECS}, got {self.warmup_codec!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.min_sparse_numel, int) or self.min_sparse_numel < 0:
            raise ConfigError(f"min_sparse_numel must be an integer >= 0, got {self.min_sparse_numel!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> LinkOptions:
        """Options given in-process or by the user (a job's ``link_options``): the dataclass's
        defaults fill what is absent; an option this version does not know is refused (ConfigError
        naming it) rather than dropped, so no peer runs a link the job did not ask for."""
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ConfigError(f"unknown link option(s) {unknown} (this version knows {sorted(known)})")
        return cls(**d)

    @classmethod
    def from_wire(cls, d: dict[str, Any] | None) -> LinkOptions:
        """A stage assignment's ``link_options`` as a worker reads them: as `from_dict`, except that an
        absent ``dither`` is ``"counter"``, what drivers from before the keyed dither meant (they sent
        none and their checkers expected counted seeds); this version's driver always writes it
        (protocol/COMPRESSION.md, "Keyed dither")."""
        d = dict(d or {})
        d.setdefault("dither", ABSENT_DITHER)
        return cls.from_dict(d)


class LinkCompressor:
    """One direction of one link: picks each step's keep ratio and encodes each message."""

    def __init__(
        self,
        spec: str | CompressSpec,
        options: LinkOptions | None = None,
        *,
        bandwidth_bps: float | None = None,
        latency_s: float = DEFAULT_LATENCY_S,
        dither_key: tuple[str, int] | None = None,
    ):
        """`dither_key`: (job, stage) of the sender, which keys q8/q4 stochastic rounding
        (compress/dither.py) in the messages `encode` is given a micro-batch for."""
        self.spec = parse_compress(spec) if isinstance(spec, str) else spec
        self.options = options or LinkOptions()
        self.policy = AdaTopKPolicy(k_min=self.options.k_min, value_dtype=self.options.value_dtype)
        self.probed_bps = bandwidth_bps
        self.latency_s = latency_s
        self.feedback = ErrorFeedback() if self.options.error_feedback else None
        self.dither_key = dither_key
        self._sends = 0  # stochastic-rounding seed counter (dither "counter", or no key / micro-batch)
        self.dense_bytes = 0
        self.wire_bytes = 0
        self.last_ratio = 1.0

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes >= MIN_OBSERVED_BYTES:
            self.policy.observe(nbytes, seconds)

    def bandwidth_bps(self) -> float | None:
        """The link's bandwidth as far as we know: the bulk probe's figure, lowered (never raised) by
        what sends on the link actually took. A send that fits in buffers looks faster than the link
        is, so timings alone would overrate it; the next probe is what raises the figure again."""
        seen = self.policy.bandwidth_bps
        if self.probed_bps is None:
            return seen
        return self.probed_bps if seen is None else min(seen, self.probed_bps)

    def ratio_for(self, step: int, dense_bytes: int, target_time_s: float | None) -> float:
        if self.spec.kind in ("none", "fp16") or step < self.options.warmup_steps:
            return 1.0
        return self._link_ratio(dense_bytes, target_time_s)

    def _link_ratio(self, dense_bytes: int, target_time_s: float | None) -> float:
        kind = self.spec.kind
        if kind in ("none", "fp16"):
            return 1.0
        if kind == "topk":
            return float(self.spec.ratio)
        # adatopk: the ratio that lets the link keep up with the slowest stage
        bw = self.bandwidth_bps()
        if bw is None or not target_time_s:
            return self.policy.ratio
        ratio = self.policy.choose(bw, self.latency_s, dense_bytes, target_time_s)
        return 1.0 if ratio > DENSE_ABOVE else ratio

    def encode(
        self,
        tensors: dict[str, torch.Tensor],
        step: int,
        key: str,
        target_time_s: float | None = None,
        mb: int | None = None,
    ) -> dict[str, EncodedTensor]:
        """Encodes one message's tensors; `key` names the message slot ("act" or "grad"), `mb` its
        micro-batch (with the link's `dither_key`: the q8/q4 dither is keyed)."""
        seed_of = None
        if self.dither_key is not None and mb is not None and self.options.dither == "keyed":
            job, stage = self.dither_key
            seed_of = lambda name: dither_seed(job, stage, step, mb, key, name)  # noqa: E731
        floating = [t for t in tensors.values() if t.is_floating_point()]
        dense = sum(t.numel() * t.element_size() for t in floating)
        self._shape_policy(floating, key)
        warm = step < self.options.warmup_steps
        link_ratio = self._link_ratio(dense, target_time_s)
        ratio = 1.0 if warm else link_ratio
        # warm-up on a link that would compress: both directions quantized, no top-k yet
        warm_quant = warm and link_ratio < 1.0 and self.options.warmup_codec != "raw"
        self.last_ratio = ratio
        out: dict[str, EncodedTensor] = {}
        for name, t in tensors.items():
            t = t.detach().cpu()
            if not t.is_floating_point():
                enc = encode_tensor(t, "raw")
            elif warm_quant:
                enc = self._quantize(t, self.options.warmup_codec, seed_of and seed_of(name))
            elif ratio < 1.0 and key == GRAD_KEY and self.options.grad_codec != "topk":
                enc = self._quantize(t, self.options.grad_codec, seed_of and seed_of(name))
            elif ratio < 1.0 and t.numel() >= self.options.min_sparse_numel:
                mode = self.options.mode if t.dim() >= 2 else "global"
                center = (
                    self.options.center
                    and (key != GRAD_KEY or self.options.center_gradients)
                    and t.dim() >= 1
                )
                send = t
                if self.feedback is not None:
                    send = self.feedback.compensate(f"{key}/{name}", t)
                enc = encode_tensor(
                    send, "topk", ratio=ratio, value_dtype=self.options.value_dtype, mode=mode, center=center
                )
                if self.feedback is not None:
                    self.feedback.record(f"{key}/{name}", send, decode_tensor(enc))
            elif self.spec.kind == "fp16" or (ratio < 1.0 and self.spec.kind != "none"):
                enc = encode_tensor(t, "fp16")
            else:
                enc = encode_tensor(t, "raw")
            self.dense_bytes += t.numel() * t.element_size()
            self.wire_bytes += len(enc.data)
            out[name] = enc
        return out

    def _shape_policy(self, floating: list[torch.Tensor], key: str) -> None:
        """Tell the policy's byte model what top-k would send for this message's largest tensor:
        its row length in row mode, its channel means when centered."""
        big = max(floating, key=lambda t: t.numel(), default=None)
        if big is None or big.dim() == 0:
            return
        last = int(big.shape[-1])
        self.policy.row_len = last if self.options.mode == "row" and big.dim() >= 2 else None
        centered = self.options.center and (key != GRAD_KEY or self.options.center_gradients)
        self.policy.center_channels = last if centered else 0

    def _quantize(self, t: torch.Tensor, codec: str, keyed: int | None = None) -> EncodedTensor:
        """q8/q4 per row (seeded stochastic rounding by default, with the `keyed` seed when given);
        fp16 when `t` holds non-finite values."""
        seed = None
        if self.options.stochastic:
            self._sends += 1
            seed = self._sends if keyed is None else keyed
        try:
            return encode_tensor(t, codec, seed=seed)
        except ValueError:  # inf/nan have no quantized form; let the receiver see them
            return encode_tensor(t, "fp16")

    def counters(self) -> dict[str, Any]:
        return {
            "dense_bytes": self.dense_bytes,
            "wire_bytes": self.wire_bytes,
            "ratio": self.last_ratio,
            "bandwidth_bps": self.bandwidth_bps(),
        }


def adatopk_config(warmup_steps: int = 0) -> LinkOptions:
    """The AdaTopK default (protocol/COMPRESSION.md): activations centered global top-k at the
    policy's ratio, gradients q8 with stochastic rounding while compressing, warm-up steps q8 in
    both directions on a link that would compress. (LinkOptions' defaults.)"""
    return LinkOptions(warmup_steps=warmup_steps)
