"""A pipeline cut in one process: the runtime's link compressor between two halves of a model.

`CompressionBoundary` is a callable placed between two halves of a model, holding one
`LinkCompressor` (compress/link.py, the one the workers use) per direction. Forward, the
activation is encoded by the forward compressor and goes through the real wire path
(`pack_encoded` -> `unpack_encoded` -> `decode_tensor`); the boundary returns what the next
stage would receive. Backward, the activation gradient goes the same way through the
backward compressor and reaches the previous stage unchanged otherwise (straight-through,
as the real sender's local autograd would). Packed bytes are counted exactly per
direction. This measures convergence under compression without a network
(`fusionnode bench adatopk`). `transmit` is the same wire path for one tensor with an
explicitly chosen codec (no policy).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

import fusionnode.compress.quant  # noqa: F401  (registers "q8" and "q4")
from fusionnode.compress.link import ACT_KEY, GRAD_KEY, LinkCompressor, LinkOptions, adatopk_config
from fusionnode.compress.topk import DEFAULT_VALUE_DTYPE
from fusionnode.wire.codec_api import EncodedTensor
from fusionnode.wire.limits import DEFAULT_LIMITS, Limits
from fusionnode.wire.tensors import decode_tensor, encode_tensor, pack_encoded, unpack_encoded

logger = logging.getLogger(__name__)

DEFAULT_DENSE_CODEC = "raw"  # what "dense" sends: the tensor's own dtype

__all__ = [
    "CompressionBoundary",
    "LinkCounters",
    "LinkOptions",
    "adatopk_config",
    "roundtrip",
    "transmit",
]


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
    return roundtrip(tensor, enc, limits)


def roundtrip(
    tensor: torch.Tensor, enc: EncodedTensor, limits: Limits = DEFAULT_LIMITS
) -> tuple[torch.Tensor, LinkCounters]:
    """Pack `enc` (the encoding of `tensor`), unpack and decode it as the receiver would:
    (received tensor, bytes: `tensor`'s own and the packed ones)."""
    packed = pack_encoded(enc)
    received = decode_tensor(unpack_encoded(packed, limits), limits)
    return received, LinkCounters(tensor.numel() * tensor.element_size(), len(packed))


class CompressionBoundary:
    """A pipeline cut in one process: `y = boundary(x)`; call `next_step()` once per optimizer step.

    `forward` compresses the activations, `backward` their gradients (two LinkCompressors, as
    a worker's two links); `target_time_s` is the compute-bound stage time the link must keep
    up with (what the AdaTopK policy of an "adatopk" compressor aims at)."""

    def __init__(
        self,
        forward: LinkCompressor,
        backward: LinkCompressor,
        *,
        target_time_s: float | None = None,
        name: str = "cut",
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.forward = forward
        self.backward = backward
        self.target_time_s = target_time_s
        self.name = name
        self.limits = limits
        self.step = 0
        self.forward_counters = LinkCounters()
        self.backward_counters = LinkCounters()

    @classmethod
    def of(
        cls,
        spec: str = "adatopk",
        options: LinkOptions | None = None,
        *,
        backward_spec: str | None = None,
        backward_options: LinkOptions | None = None,
        bandwidth_bps: float | None = None,
        latency_s: float = 0.0,
        target_time_s: float | None = None,
        name: str = "cut",
    ) -> CompressionBoundary:
        """Both directions from a `--compress` setting and LinkOptions (the backward direction's
        own, when given), on a link of `bandwidth_bps` and one-way `latency_s`."""
        options = options or LinkOptions()

        def link(s: str, o: LinkOptions) -> LinkCompressor:
            return LinkCompressor(s, o, bandwidth_bps=bandwidth_bps, latency_s=latency_s)

        return cls(
            link(spec, options),
            link(backward_spec or spec, backward_options or options),
            target_time_s=target_time_s,
            name=name,
        )

    @property
    def counters(self) -> LinkCounters:
        """Both directions of the link together."""
        return self.forward_counters + self.backward_counters

    @property
    def forward_ratio(self) -> float:
        """Keep ratio of the last activation sent (1.0: dense)."""
        return self.forward.last_ratio

    @property
    def backward_ratio(self) -> float:
        return self.backward.last_ratio

    def next_step(self) -> None:
        self.step += 1

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _BoundaryFunction.apply(x, self)

    def send_forward(self, x: torch.Tensor) -> torch.Tensor:
        y, c = self._send(self.forward, x, ACT_KEY)
        self.forward_counters = self.forward_counters + c
        return y

    def send_backward(self, g: torch.Tensor) -> torch.Tensor:
        y, c = self._send(self.backward, g, GRAD_KEY)
        self.backward_counters = self.backward_counters + c
        return y

    def _send(self, link: LinkCompressor, t: torch.Tensor, key: str) -> tuple[torch.Tensor, LinkCounters]:
        enc = link.encode({self.name: t}, self.step, key, self.target_time_s)[self.name]
        y, c = roundtrip(t, enc, self.limits)
        return y.to(t.dtype), c


class _BoundaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, boundary: CompressionBoundary) -> torch.Tensor:
        ctx.boundary = boundary
        return boundary.send_forward(x.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.boundary.send_backward(grad.contiguous()), None
