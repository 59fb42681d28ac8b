"""Compression on a pipeline link: what codec each tensor crossing it gets.

One `LinkCompressor` per (stage, direction): activations to the next stage,
activation gradients to the previous one. The job's ``--compress`` setting picks
the behaviour: ``none`` (raw), ``fp16``, ``topk:R`` (a fixed keep ratio), or
``adatopk`` (the ratio follows the link: dense while the link keeps up with the
pipeline's compute-bound stage time, as sparse as needed when it does not). The
bandwidth comes from the peer's link probe and is then tracked from the measured
sends. Counters keep the dense and the wire bytes of the link.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fusionnode.compress.feedback import ErrorFeedback
from fusionnode.compress.policy import AdaTopKPolicy, CompressSpec, parse_compress
from fusionnode.wire.codec_api import EncodedTensor
from fusionnode.wire.tensors import decode_tensor, encode_tensor

MIN_SPARSE_NUMEL = 4096  # tensors smaller than this always go dense (indices would cost more than they save)
DENSE_ABOVE = 0.98  # a keep ratio above this is sent dense: top-k would save next to nothing
MIN_OBSERVED_BYTES = 256 << 10  # smaller sends fit in socket buffers and token-bucket bursts: not timed
DEFAULT_LATENCY_S = 0.0  # seconds, when nothing better is known


@dataclasses.dataclass
class LinkOptions:
    mode: str = "row"  # top-k selection: "row" (per token, the last dimension) or "global"
    value_dtype: str = "float16"
    warmup_steps: int = 0  # steps sent dense before compression starts (AC-SGD's warm-up)
    error_feedback: bool = False  # carry what top-k dropped into the next message (gradient direction)
    k_min: float = 0.01

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> LinkOptions:
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


class LinkCompressor:
    def __init__(
        self,
        spec: str | CompressSpec,
        options: LinkOptions | None = None,
        *,
        bandwidth_bps: float | None = None,
        latency_s: float = DEFAULT_LATENCY_S,
    ):
        self.spec = parse_compress(spec) if isinstance(spec, str) else spec
        self.options = options or LinkOptions()
        self.policy = AdaTopKPolicy(k_min=self.options.k_min, value_dtype=self.options.value_dtype)
        self.probed_bps = bandwidth_bps
        self.latency_s = latency_s
        self.feedback = ErrorFeedback() if self.options.error_feedback else None
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
        kind = self.spec.kind
        if kind in ("none", "fp16") or step < self.options.warmup_steps:
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
        self, tensors: dict[str, torch.Tensor], step: int, key: str, target_time_s: float | None = None
    ) -> dict[str, EncodedTensor]:
        """Encodes one message's tensors; `key` names the message slot for error feedback."""
        floating = [t for t in tensors.values() if t.is_floating_point()]
        dense = sum(t.numel() * t.element_size() for t in floating)
        ratio = self.ratio_for(step, dense, target_time_s)
        self.last_ratio = ratio
        out: dict[str, EncodedTensor] = {}
        for name, t in tensors.items():
            t = t.detach().cpu()
            if not t.is_floating_point():
                enc = encode_tensor(t, "raw")
            elif ratio < 1.0 and t.numel() >= MIN_SPARSE_NUMEL:
                mode = self.options.mode if t.dim() >= 2 else "global"
                send = t
                if self.feedback is not None:
                    send = self.feedback.compensate(f"{key}/{name}", t)
                enc = encode_tensor(
                    send, "topk", ratio=ratio, value_dtype=self.options.value_dtype, mode=mode
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

    def counters(self) -> dict[str, Any]:
        return {
            "dense_bytes": self.dense_bytes,
            "wire_bytes": self.wire_bytes,
            "ratio": self.last_ratio,
            "bandwidth_bps": self.bandwidth_bps(),
        }
