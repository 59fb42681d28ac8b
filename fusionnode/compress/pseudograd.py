"""Pseudo-gradient compression for SparseLoCo: the "ctopk2" codec and the error-feedback accumulator.

"ctopk2" (chunked top-k, 2-bit values) cuts the flattened tensor into chunks of `chunk` elements
(the last one may be shorter), keeps in each chunk the `k` elements of largest magnitude (ties
towards the lower index; a short last chunk keeps min(k, its length)), and sends each kept value
in 2 bits: a sign bit and a level bit choosing one of the chunk's two magnitudes `lo <= hi`. The
reference sender splits the kept magnitudes at their mean: `hi` is the mean of those >= the mean,
`lo` the mean of the others (`lo = hi` when there are none), one Lloyd step of a 2-level
quantiser. Layout and validation: protocol/COMPRESSION.md ("ctopk2"); golden vectors
protocol/vectors/ctopk2_*.json.

The int8 pseudo-gradient codec is "q8" (compress/quant.py: per-row absmax, 8 bits).

`ErrorFeedbackAccumulator` keeps, per parameter name, SparseLoCo's accumulator
    e <- β e + Δ;  c <- decode(encode(e));  e <- e − c
and returns what is sent (the encoded c) and its decoded value.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from fusionnode.errors import ProtocolError
from fusionnode.wire.codec_api import (
    DTYPES,
    EncodedTensor,
    check_float_header,
    float_input,
    get_codec,
    register_codec,
)

CODEC_NAME = "ctopk2"
FORMAT_VERSION = 1  # params["v"]; a receiver refuses any other value
MAX_CHUNK = 65536  # indices within a chunk fit in u16
PARAM_KEYS = frozenset({"v", "chunk", "k", "index"})
INDEX_WIDTH = {"u8": 1, "u16": 2}
SCALE_BYTES = 8  # per chunk: lo, hi as little-endian float32
_LITTLE = sys.byteorder == "little"


def index_encoding(chunk: int) -> str:
    """u8 when every position within a chunk fits in a byte, else u16."""
    return "u8" if chunk <= 256 else "u16"


def chunk_layout(numel: int, chunk: int, k: int) -> tuple[int, int, int, int]:
    """(full chunks, tail length, kept in the tail, kept in all) of a tensor of `numel` elements."""
    n_full, tail = divmod(numel, chunk)
    k_tail = min(k, tail)
    return n_full, tail, k_tail, n_full * k + k_tail


def ctopk2_payload_bytes(numel: int, chunk: int, k: int) -> int:
    """Exact payload size: 8 bytes of scales per chunk, the indices, then 2 bits per kept value."""
    n_full, tail, _, total_k = chunk_layout(numel, chunk, k)
    n_chunks = n_full + (1 if tail else 0)
    return n_chunks * SCALE_BYTES + total_k * INDEX_WIDTH[index_encoding(chunk)] + (total_k + 3) // 4


def _select(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the positions (increasing) and values of the k largest |x| (ties: lower index).

    Without sorting the row (5x faster than a stable sort on gpt2-tiny's pseudo-gradient, the same
    positions): the k-th largest magnitude t per row, every element above t, then the first
    elements equal to t (in index order) up to k."""
    mag = rows.abs()
    kth = torch.topk(mag, k, dim=1, sorted=False).values.min(dim=1, keepdim=True).values
    above = mag > kth
    room = k - above.sum(dim=1, keepdim=True)
    tied = mag == kth
    keep = above | (tied & (torch.cumsum(tied.to(torch.int32), dim=1) <= room))
    idx = keep.nonzero()[:, 1].view(rows.size(0), k)
    return idx, rows.gather(1, idx)


def _quantise(vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of kept values: (lo, hi) float32 and the 2-bit codes (bit 0 sign, bit 1 level)."""
    mag = vals.abs()
    mean = mag.mean(dim=1, keepdim=True)
    high = mag >= mean
    n_high = high.sum(dim=1)
    n_low = high.size(1) - n_high
    hi = torch.where(high, mag, torch.zeros_like(mag)).sum(dim=1) / n_high.clamp(min=1)
    lo_sum = torch.where(high, torch.zeros_like(mag), mag).sum(dim=1)
    lo = torch.where(n_low > 0, lo_sum / n_low.clamp(min=1), hi)
    # equal magnitudes can round their float32 mean above every one of them: no value is "high";
    # then hi takes lo (no code uses it) so that lo <= hi holds, as the decoder checks
    hi = torch.where(n_high > 0, hi, lo)
    codes = (vals < 0).to(torch.uint8) | (high.to(torch.uint8) << 1)
    return lo, hi, codes


class ChunkTopK2Codec:
    """SparseLoCo's pseudo-gradient codec: chunk-wise top-k with 2-bit values."""

    name = CODEC_NAME

    def encode(self, tensor: torch.Tensor, chunk: int = 4096, k: int = 64, **options: Any) -> EncodedTensor:
        """Raises ValueError for bad options, a non-floating tensor or non-finite values."""
        return self.encode_decoded(tensor, chunk, k, **options)[0]

    def encode_decoded(
        self, tensor: torch.Tensor, chunk: int = 4096, k: int = 64, **options: Any
    ) -> tuple[EncodedTensor, torch.Tensor]:
        """`encode`, and what `decode` of it returns (float32, the tensor's shape), built from the
        kept positions and their 2-bit values without parsing the payload (the error feedback's c)."""
        if options:
            raise ValueError(f"unknown {CODEC_NAME} options {sorted(options)}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= MAX_CHUNK:
            raise ValueError(f"{CODEC_NAME} chunk must be an integer in [1, {MAX_CHUNK}], got {chunk!r}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= chunk:
            raise ValueError(f"{CODEC_NAME} k must be an integer in [1, chunk], got {k!r}")
        dtype_name, x, shape = float_input(tensor, CODEC_NAME)
        flat = x.reshape(-1).to(torch.float32)
        if not bool(torch.isfinite(flat).all()):
            raise ValueError(f"{CODEC_NAME} cannot encode non-finite values")
        index = index_encoding(chunk)
        params = {"v": FORMAT_VERSION, "chunk": chunk, "k": k, "index": index}
        n_full, tail, k_tail, _ = chunk_layout(flat.numel(), chunk, k)
        parts = []
        if n_full:
            parts.append(_select(flat[: n_full * chunk].view(n_full, chunk), k))
        if tail:
            parts.append(_select(flat[n_full * chunk :].view(1, tail), k_tail))
        scales, idx_bytes, codes = [], [], []
        dense = torch.zeros(flat.numel(), dtype=torch.float32)
        for row0, (idx, vals) in zip((0, n_full), parts, strict=False):
            lo, hi, c = _quantise(vals)
            scales.append(torch.stack([lo, hi], dim=1).reshape(-1))
            idx_bytes.append(idx.reshape(-1))
            codes.append(c.reshape(-1))
            # the decoder's value: ±(hi if the level bit else lo), at chunk * row + position
            level = torch.where((c & 2).bool(), hi.unsqueeze(1), lo.unsqueeze(1))
            value = torch.where((c & 1).bool(), -level, level)
            rows = torch.arange(row0, row0 + idx.size(0), dtype=torch.int64).unsqueeze(1)
            dense[(rows * chunk + idx).reshape(-1)] = value.reshape(-1)
        if not parts:
            enc = EncodedTensor(dtype=dtype_name, shape=shape, codec=CODEC_NAME, params=params, data=b"")
            return enc, dense.view(tuple(shape))
        scale_arr = torch.cat(scales).numpy().astype("<f4")
        idx_arr = torch.cat(idx_bytes).numpy().astype("<u1" if index == "u8" else "<u2")
        code_arr = torch.cat(codes).numpy()
        pad = (-code_arr.size) % 4
        if pad:
            code_arr = np.concatenate([code_arr, np.zeros(pad, dtype=np.uint8)])
        quads = code_arr.reshape(-1, 4)
        packed = (quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)).astype(np.uint8)
        data = scale_arr.tobytes() + idx_arr.tobytes() + packed.tobytes()
        enc = EncodedTensor(dtype=dtype_name, shape=shape, codec=CODEC_NAME, params=params, data=data)
        return enc, dense.view(tuple(shape))

    def decode(self, enc: EncodedTensor, max_elements: int) -> torch.Tensor:
        """Validate everything (raising ProtocolError) and return the dense tensor."""
        numel = check_float_header(enc, CODEC_NAME, max_elements)
        params = enc.params
        if not isinstance(params, dict) or set(params) != PARAM_KEYS:
            keys = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ProtocolError(
                f"{CODEC_NAME} params must have exactly the keys {sorted(PARAM_KEYS)}, got {keys}"
            )
        v, chunk, k, index = params["v"], params["chunk"], params["k"], params["index"]
        if type(v) is not int or v != FORMAT_VERSION:
            raise ProtocolError(
                f"{CODEC_NAME} format version {v!r} not supported (this peer speaks {FORMAT_VERSION})"
            )
        if type(chunk) is not int or not 1 <= chunk <= MAX_CHUNK:
            raise ProtocolError(f"{CODEC_NAME} chunk must be an integer in [1, {MAX_CHUNK}], got {chunk!r}")
        if type(k) is not int or not 1 <= k <= chunk:
            raise ProtocolError(f"{CODEC_NAME} k must be an integer in [1, chunk], got {k!r}")
        if index not in INDEX_WIDTH or (index == "u8" and chunk > 256):
            raise ProtocolError(
                f"{CODEC_NAME} index encoding {index!r} cannot hold chunk positions < {chunk}"
            )
        n_full, tail, _, total_k = chunk_layout(numel, chunk, k)
        n_chunks = n_full + (1 if tail else 0)
        width = INDEX_WIDTH[index]
        expected = n_chunks * SCALE_BYTES + total_k * width + (total_k + 3) // 4
        data = memoryview(enc.data)
        if len(data) != expected:
            raise ProtocolError(f"{CODEC_NAME} payload is {len(data)} bytes, expected {expected}")
        out_dtype = DTYPES[enc.dtype]
        if numel == 0:
            return torch.zeros(tuple(enc.shape), dtype=out_dtype)
        scales = np.frombuffer(data, dtype="<f4", count=2 * n_chunks).astype(np.float32).reshape(n_chunks, 2)
        if not np.isfinite(scales).all() or (scales[:, 0] < 0).any() or (scales[:, 0] > scales[:, 1]).any():
            raise ProtocolError(f"{CODEC_NAME} scales must be finite with 0 <= lo <= hi")
        off = n_chunks * SCALE_BYTES
        idx = np.frombuffer(data, dtype="<u1" if index == "u8" else "<u2", count=total_k, offset=off).astype(
            np.int64
        )
        packed = np.frombuffer(data, dtype=np.uint8, offset=off + total_k * width)
        codes = np.empty(packed.size * 4, dtype=np.uint8)
        for j in range(4):
            codes[j::4] = (packed >> (2 * j)) & 3
        if (codes[total_k:] != 0).any():
            raise ProtocolError(f"{CODEC_NAME} padding bits after the last value must be 0")
        codes = codes[:total_k]
        # positions: strictly increasing within each chunk and inside it
        chunk_of = np.empty(total_k, dtype=np.int64)
        chunk_of[: n_full * k] = np.repeat(np.arange(n_full, dtype=np.int64), k)
        chunk_of[n_full * k :] = n_full
        limit = np.where(chunk_of < n_full, chunk, tail)
        if (idx >= limit).any():
            raise ProtocolError(f"{CODEC_NAME} index beyond its chunk")
        same_chunk = chunk_of[1:] == chunk_of[:-1]
        if (same_chunk & (idx[1:] <= idx[:-1])).any():
            raise ProtocolError(f"{CODEC_NAME} indices must be strictly increasing within each chunk")
        level = np.where(codes & 2, scales[chunk_of, 1], scales[chunk_of, 0])
        values = np.where(codes & 1, -level, level).astype(np.float32)
        out = torch.zeros(numel, dtype=torch.float32)
        out[torch.from_numpy(chunk_of * chunk + idx)] = torch.from_numpy(values)
        return out.to(out_dtype).view(tuple(enc.shape))


CTOPK2 = register_codec(ChunkTopK2Codec())


def encode_pseudograd(tensor: torch.Tensor, codec: str, *, chunk: int = 4096, k: int = 64) -> EncodedTensor:
    """A pseudo-gradient in the sync codec `codec` ("raw", "fp16", "q8" or "ctopk2")."""
    if codec == CODEC_NAME:
        return CTOPK2.encode(tensor, chunk=chunk, k=k)
    return get_codec(codec).encode(tensor)


def decode_pseudograd(enc: EncodedTensor, max_elements: int) -> torch.Tensor:
    return get_codec(enc.codec).decode(enc, max_elements)


class ErrorFeedbackAccumulator:
    """SparseLoCo's per-replica accumulators: e <- β e + Δ; send c = Q(topk(e)); e <- e − c."""

    def __init__(self, decay: float, chunk: int, k: int) -> None:
        if not 0 <= decay <= 1:
            raise ValueError(f"error-feedback decay must lie in [0, 1], got {decay}")
        self.decay = float(decay)
        self.chunk = chunk
        self.k = k
        self.acc: dict[str, torch.Tensor] = {}

    def compress(self, name: str, delta: torch.Tensor) -> tuple[EncodedTensor, torch.Tensor]:
        """Fold `delta` into the accumulator of `name`; returns (what is sent, its decoded value)."""
        d = delta.detach().to(torch.float32)
        e = self.acc.get(name)
        if e is None:
            e = d.clone()
            self.acc[name] = e
        else:
            e.mul_(self.decay).add_(d)
        enc, sent = CTOPK2.encode_decoded(e, chunk=self.chunk, k=self.k)  # = decode(enc), not parsed back
        e.sub_(sent)
        return enc, sent

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.acc)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.acc = {k: v.clone().to(torch.float32) for k, v in state.items()}
