"""Compression at a pipeline cut, in one process: what a link would do to the tensors crossing it.

`CompressionBoundary` is a callable placed between two halves of a model. Forward, it
sends the activation through the real wire path (codec encode -> `pack_encoded` ->
`unpack_encoded` -> `decode_tensor`) and returns what the next stage would receive;
backward, it does the same to the activation gradient (optionally with error
feedback) and hands it to the previous stage unchanged otherwise (straight-through,
as the real sender's local autograd would). Bytes are counted exactly per direction.
This measures convergence under compression without a network; the runtime may
reuse `transmit` for its links.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

import fusionnode.compress.quant  # noqa: F401  (registers "q8" and "q4")
from fusionnode.compress.feedback import ErrorFeedback
from fusionnode.compress.topk import DEFAULT_VALUE_DTYPE, MODES, VALUE_DTYPES
from fusionnode.wire.limits import DEFAULT_LIMITS, Limits
from fusionnode.wire.tensors import decode_tensor, encode_tensor, pack_encoded, unpack_encoded

logger = logging.getLogger(__name__)

DENSE_CODECS = ("raw", "fp16")
QUANT_CODECS = ("q8", "q4")
DEFAULT_DENSE_CODEC = "raw"  # what "dense" sends: the tensor's own dtype


@dataclasses.dataclass(frozen=True)
class LinkCounters:
    """Bytes that crossed one link direction: `dense_bytes` as the tensors' own dtype, `wire_bytes` as packed."""

    dense_bytes: int = 0
    wire_bytes: int = 0

    def __add__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(self.dense_bytes + other.dense_bytes, self.wire_bytes + other.wire_bytes)

    @property
    def reduction(self) -> float:
        """dense_bytes / wire_bytes (how many times fewer bytes crossed); 1.0 when nothing crossed."""
        return self.dense_bytes / self.wire_bytes if self.wire_bytes else 1.0


def transmit(
    tensor: torch.Tensor,
    ratio: float | None,
    *,
    mode: str = "row",
    value_dtype: str = DEFAULT_VALUE_DTYPE,
    center: bool = False,
    dense_codec: str = DEFAULT_DENSE_CODEC,
    limits: Limits = DEFAULT_LIMITS,
    quant: str | None = None,
    seed: int | None = None,
) -> tuple[torch.Tensor, LinkCounters]:
    """Encode, pack, unpack and decode `tensor` as a link would: (received tensor, bytes).

    `ratio` None or 1.0 sends it dense with `dense_codec`; otherwise top-k at `ratio`, or,
    when `quant` ("q8" | "q4") is given, that quantizing codec instead of top-k (`seed`:
    its stochastic rounding seed, None = round to nearest).
    """
    if ratio is None or ratio >= 1.0:
        enc = encode_tensor(tensor, dense_codec)
    elif quant is not None:
        enc = encode_tensor(tensor, quant, seed=seed)
    else:
        enc = encode_tensor(tensor, "topk", ratio=ratio, value_dtype=value_dtype, mode=mode, center=center)
    packed = pack_encoded(enc)
    received = decode_tensor(unpack_encoded(packed, limits), limits)
    counters = LinkCounters(tensor.numel() * tensor.element_size(), len(packed))
    return received, counters


@dataclasses.dataclass(frozen=True)
class BoundaryConfig:
    """How one cut compresses. Ratios None mean dense; `warmup_steps` steps are dense first."""

    forward_ratio: float | None = 0.1  # keep ratio of activations, None = dense
    backward_ratio: float | None = 0.1  # keep ratio of activation gradients, None = dense
    forward_mode: str = "row"  # "row" (per token) or "global" top-k for activations
    backward_mode: str = "row"  # same, for activation gradients
    forward_center: bool = False  # send channel means; top-k of the centered activation
    backward_center: bool = False  # same, for activation gradients
    value_dtype: str = DEFAULT_VALUE_DTYPE  # "float16" | "bfloat16" | "float32" kept values
    forward_feedback: bool = False  # error feedback on activations (not sound: samples differ)
    backward_feedback: bool = False  # error feedback on activation gradients
    warmup_steps: int = 0  # steps sent dense before compression starts
    dense_codec: str = DEFAULT_DENSE_CODEC  # codec of dense sends: "raw" or "fp16"
    backward_quant: str | None = None  # "q8" | "q4": quantize gradients instead of top-k when compressing
    stochastic: bool = True  # stochastic (seeded, unbiased) rounding for backward_quant
    forward_quant_warmup: str | None = None  # "q8" | "q4": send activations with it during warm-up
    backward_quant_warmup: str | None = None  # same, gradients during warm-up

    def __post_init__(self) -> None:
        for name in ("forward_ratio", "backward_ratio"):
            r = getattr(self, name)
            if r is not None and not (0.0 < r <= 1.0):
                raise ValueError(f"{name} must be None or in (0, 1], got {r!r}")
        for name in ("forward_mode", "backward_mode"):
            if getattr(self, name) not in MODES:
                raise ValueError(f"{name} must be one of {MODES}")
        if self.value_dtype not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {sorted(VALUE_DTYPES)}")
        if self.dense_codec not in DENSE_CODECS:
            raise ValueError(f"dense_codec must be one of {DENSE_CODECS}")
        for name in ("backward_quant", "forward_quant_warmup", "backward_quant_warmup"):
            if getattr(self, name) not in (None, *QUANT_CODECS):
                raise ValueError(f"{name} must be None or one of {QUANT_CODECS}")
        if self.warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")


def adatopk_config(warmup_steps: int = 0) -> BoundaryConfig:
    """The AdaTopK default (protocol/COMPRESSION.md): activations centered global top-k at the
    policy's ratio, gradients q8 with stochastic rounding while compressing, warm-up steps q8
    in both directions. Ratios start dense; a policy sets them per step."""
    return BoundaryConfig(
        forward_ratio=None,
        backward_ratio=None,
        forward_mode="global",
        backward_mode="global",
        forward_center=True,
        backward_quant="q8",
        stochastic=True,
        forward_quant_warmup="q8",
        backward_quant_warmup="q8",
        warmup_steps=warmup_steps,
    )


class CompressionBoundary:
    """A pipeline cut in one process: `y = boundary(x)`; call `next_step()` once per optimizer step."""

    def __init__(self, config: BoundaryConfig, name: str = "cut", limits: Limits = DEFAULT_LIMITS) -> None:
        self.config = config
        self.name = name
        self.limits = limits
        self.step = 0
        self._sends = 0
        self.forward_ratio = config.forward_ratio  # may be changed per step by a policy
        self.backward_ratio = config.backward_ratio
        self.forward_counters = LinkCounters()
        self.backward_counters = LinkCounters()
        self._forward_ef = ErrorFeedback() if config.forward_feedback else None
        self._backward_ef = ErrorFeedback() if config.backward_feedback else None

    @property
    def counters(self) -> LinkCounters:
        """Both directions of the link together."""
        return self.forward_counters + self.backward_counters

    @property
    def warming_up(self) -> bool:
        return self.step < self.config.warmup_steps

    def next_step(self) -> None:
        self.step += 1

    def _seed(self) -> int:
        """Stochastic-rounding seed of the next send: distinct per send, deterministic per run."""
        self._sends += 1
        return self._sends

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _BoundaryFunction.apply(x, self)

    def send_forward(self, x: torch.Tensor) -> torch.Tensor:
        ratio = None if self.warming_up else self.forward_ratio
        quant = None
        if self.warming_up and self.config.forward_quant_warmup is not None:
            ratio, quant = 0.0, self.config.forward_quant_warmup
        y, c = self._send(
            x,
            ratio,
            self.config.forward_mode,
            self.config.forward_center,
            self._forward_ef,
            "activation",
            quant,
        )
        self.forward_counters = self.forward_counters + c
        return y

    def send_backward(self, g: torch.Tensor) -> torch.Tensor:
        ratio = None if self.warming_up else self.backward_ratio
        quant = self.config.backward_quant
        if self.warming_up and self.config.backward_quant_warmup is not None:
            ratio, quant = 0.0, self.config.backward_quant_warmup
        y, c = self._send(
            g,
            ratio,
            self.config.backward_mode,
            self.config.backward_center,
            self._backward_ef,
            "gradient",
            quant,
        )
        self.backward_counters = self.backward_counters + c
        return y

    def _send(
        self,
        t: torch.Tensor,
        ratio: float | None,
        mode: str,
        center: bool,
        ef: ErrorFeedback | None,
        key: str,
        quant: str | None = None,
    ) -> tuple[torch.Tensor, LinkCounters]:
        counters: list[LinkCounters] = []

        def link(v: torch.Tensor) -> torch.Tensor:
            y, c = transmit(
                v,
                ratio,
                mode=mode,
                value_dtype=self.config.value_dtype,
                center=center,
                dense_codec=self.config.dense_codec,
                limits=self.limits,
                quant=quant,
                seed=self._seed() if self.config.stochastic else None,
            )
            counters.append(c)
            return y

        sparse = ratio is not None and ratio < 1.0 and quant is None
        y = ef.compress(key, t, link) if ef is not None and sparse else link(t)
        return y, counters[0]


class _BoundaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, boundary: CompressionBoundary) -> torch.Tensor:
        ctx.boundary = boundary
        return boundary.send_forward(x.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.boundary.send_backward(grad.contiguous()), None
