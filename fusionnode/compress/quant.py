"""The "q8" and "q4" tensor codecs: per-row absmax integer quantization (dense, no index).

Every last-dimension row `r` (a token of an activation gradient `[B, T, C]`) gets one
scale `s_r = max|x_r| / Q` (Q = 127 for q8, 7 for q4), sent as float32 (or float16), and
every element becomes the integer `q = clamp(round(x / s_r), -Q, Q)`; the receiver
rebuilds `q * s_r`. Rounding is to nearest, or stochastic (`seed` given): `floor(x / s + u)`
with `u` uniform in [0, 1) from a seeded generator, so the decoded value is an unbiased
estimate of `x` (what matters for gradients) and the result is deterministic per seed.
Layout and validation are specified language-neutrally in protocol/COMPRESSION.md.
"""

from __future__ import annotations

import logging
import math
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
    register_codec,
)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # params["v"]; a receiver refuses any other value
QMAX: dict[str, int] = {"q8": 127, "q4": 7}  # largest magnitude of a quantized element per codec
BITS: dict[str, int] = {"q8": 8, "q4": 4}
SCALE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16}
SCALE_BYTES: dict[str, int] = {"float32": 4, "float16": 2}
DEFAULT_SCALE_DTYPE = "float32"  # float16 scales underflow for small gradients (< 6e-8 * 127)
PARAM_KEYS = frozenset({"v", "row_len", "scale"})
_LITTLE = sys.byteorder == "little"
_CHUNK_ELEMENTS = 1 << 16  # elements quantized per pass (256 KiB of float32 temporaries)


def quant_rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, row_len) of a tensor of `shape`: row_len = shape[-1] (1 for a scalar), rows = numel / row_len."""
    numel = math.prod(shape)
    row_len = shape[-1] if len(shape) else 1
    return (numel // row_len if row_len else 0), row_len


def quant_payload_bytes(
    numel: int, row_len: int, codec: str = "q8", scale_dtype: str = DEFAULT_SCALE_DTYPE
) -> int:
    """Exact payload size of a q8/q4 message of `numel` elements in rows of `row_len`."""
    rows = numel // row_len if row_len else 0
    value_bytes = numel if codec == "q8" else (numel + 1) // 2
    return rows * SCALE_BYTES[scale_dtype] + value_bytes


def dither_block(seed: int, rows: int, row_len: int) -> torch.Tensor:
    """The seeded block of uniforms in [0, 1) that stochastic rounding adds (`rows` x `row_len`)."""
    gen = torch.Generator().manual_seed(int(seed))
    return torch.rand(rows, row_len, generator=gen)


def dither_rows(seed: int, rows: int, row_len: int) -> torch.Tensor:
    """The uniforms `QuantCodec.encode(seed=seed)` adds to each of a tensor's `rows` x `row_len`
    elements: one block of `_CHUNK_ELEMENTS // row_len` rows, repeated for every chunk of rows."""
    chunk = max(1, _CHUNK_ELEMENTS // max(row_len, 1))
    block = dither_block(seed, min(rows, chunk), row_len)
    if rows <= chunk:
        return block
    return block.repeat((rows + chunk - 1) // chunk, 1)[:rows]


class QuantCodec:
    """Per-row absmax quantization to signed 8-bit ("q8") or 4-bit ("q4") integers."""

    def __init__(self, name: str) -> None:
        if name not in QMAX:
            raise ValueError(f"quantizing codec must be one of {sorted(QMAX)}")
        self.name = name
        self.qmax = QMAX[name]

    def encode(
        self,
        tensor: torch.Tensor,
        scale_dtype: str = DEFAULT_SCALE_DTYPE,
        seed: int | None = None,
        **options: Any,
    ) -> EncodedTensor:
        """Quantize `tensor` per last-dimension row; `seed` given = seeded stochastic rounding.

        Raises ValueError for non-floating or non-finite input (it has no quantized form).
        """
        if options:
            raise ValueError(f"unknown {self.name} options {sorted(options)}")
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {sorted(SCALE_DTYPES)}, got {scale_dtype!r}")
        dtype_name, x, shape = float_input(tensor, self.name)
        rows, row_len = quant_rows(shape)
        params = {"v": FORMAT_VERSION, "row_len": row_len, "scale": scale_dtype}
        if rows == 0:
            return EncodedTensor(dtype=dtype_name, shape=shape, codec=self.name, params=params, data=b"")
        x2 = x.reshape(rows, row_len)
        sdtype = SCALE_DTYPES[scale_dtype]
        scale = torch.empty(rows, dtype=sdtype)
        q = torch.empty(rows, row_len, dtype=torch.int8)
        # chunks of rows keep the float temporaries in cache; the dither (stochastic rounding) is
        # one seeded block of uniforms reused by every chunk: each element still gets u ~ U[0, 1)
        chunk = max(1, _CHUNK_ELEMENTS // max(row_len, 1))
        dither = None if seed is None else dither_block(seed, min(rows, chunk), row_len)
        buf = torch.empty(min(rows, chunk), row_len)
        for start in range(0, rows, chunk):
            stop = min(rows, start + chunk)
            y = buf[: stop - start]
            y.copy_(x2[start:stop])
            absmax = y.abs().amax(dim=1)
            if not bool(torch.isfinite(absmax).all()):
                raise ValueError(f"{self.name} cannot encode non-finite values")
            sc = (absmax / self.qmax).to(sdtype)
            if scale_dtype == "float16":
                sc = torch.where(torch.isinf(sc), torch.finfo(torch.float16).max, sc)
            scale[start:stop] = sc
            sc32 = sc.float()
            y.mul_(torch.where(sc32 > 0, 1.0 / sc32, torch.zeros_like(sc32)).unsqueeze(1))
            if dither is None:
                y.round_()
            else:
                y.add_(dither[: stop - start]).floor_()
            q[start:stop] = y.clamp_(-self.qmax, self.qmax)
        q = q.reshape(-1)
        if self.name == "q8":
            value_part = q.numpy().tobytes()
        else:
            nib = (q & 0x0F).to(torch.uint8)
            if nib.numel() % 2:
                nib = torch.cat([nib, torch.zeros(1, dtype=torch.uint8)])
            pairs = nib.view(-1, 2)
            value_part = (pairs[:, 0] | (pairs[:, 1] << 4)).numpy().tobytes()
        arr = scale.view(torch.int32 if scale_dtype == "float32" else torch.int16).numpy()
        if not _LITTLE:
            arr = arr.byteswap()
        data = arr.tobytes() + value_part
        return EncodedTensor(dtype=dtype_name, shape=shape, codec=self.name, params=params, data=data)

    def decode(self, enc: EncodedTensor, max_elements: int) -> torch.Tensor:
        """Validate everything (raising ProtocolError) and return the dense tensor."""
        name = self.name
        numel = check_float_header(enc, name, max_elements)
        shape = enc.shape
        params = enc.params
        if not isinstance(params, dict) or set(params) != PARAM_KEYS:
            keys = sorted(params) if isinstance(params, dict) else type(params).__name__
            raise ProtocolError(f"{name} params must have exactly the keys {sorted(PARAM_KEYS)}, got {keys}")
        v = params["v"]
        if v != FORMAT_VERSION or isinstance(v, bool):
            raise ProtocolError(
                f"{name} format version {v!r} not supported (this peer speaks {FORMAT_VERSION})"
            )
        rows, row_len = quant_rows(tuple(shape))
        if params["row_len"] != row_len or type(params["row_len"]) is not int:
            raise ProtocolError(f"{name} row_len must equal shape[-1] ({row_len}), got {params['row_len']!r}")
        scale_dtype = params["scale"]
        if not isinstance(scale_dtype, str) or scale_dtype not in SCALE_DTYPES:
            raise ProtocolError(f"{name} scale dtype {scale_dtype!r} unknown (known: {sorted(SCALE_DTYPES)})")
        scale_bytes = rows * SCALE_BYTES[scale_dtype]
        expected = quant_payload_bytes(numel, row_len, name, scale_dtype)
        data = memoryview(enc.data)
        if len(data) != expected:
            raise ProtocolError(
                f"{name} payload is {len(data)} bytes, expected {expected} ({rows} {scale_dtype} scales + values)"
            )
        out_dtype = DTYPES[enc.dtype]
        if rows == 0:
            return torch.zeros(tuple(shape), dtype=out_dtype)
        np_scale = "<f4" if scale_dtype == "float32" else "<f2"
        scale_np = np.frombuffer(data, dtype=np_scale, count=rows).astype(np.float32)
        if not (np.isfinite(scale_np).all() and (scale_np >= 0).all()):
            raise ProtocolError(f"{name} scales must be finite and non-negative")
        raw = np.frombuffer(data, dtype=np.int8 if name == "q8" else np.uint8, offset=scale_bytes)
        if name == "q8":
            if (raw == -128).any():
                raise ProtocolError("q8 value -128 is outside [-127, 127]")
            q = torch.from_numpy(raw.astype(np.float32))
        else:
            nibbles = np.empty(raw.size * 2, dtype=np.uint8)
            nibbles[0::2] = raw & 0x0F
            nibbles[1::2] = raw >> 4
            if (nibbles == 8).any():
                raise ProtocolError("q4 value -8 is outside [-7, 7]")
            if numel % 2 and nibbles[-1] != 0:
                raise ProtocolError("q4 padding nibble after the last element must be 0")
            signed = nibbles[:numel].astype(np.int8)
            signed[signed > 7] -= 16
            q = torch.from_numpy(signed.astype(np.float32))
        q2 = q.view(rows, row_len)
        scales = torch.from_numpy(scale_np).unsqueeze(1)
        if out_dtype == torch.float32:
            return q2.mul_(scales).view(tuple(shape))  # q is already a fresh float32 tensor
        out = torch.empty(rows, row_len, dtype=out_dtype)
        chunk = max(1, _CHUNK_ELEMENTS // max(row_len, 1))
        for start in range(0, rows, chunk):
            out[start : start + chunk] = q2[start : start + chunk] * scales[start : start + chunk]
        return out.view(tuple(shape))


Q8 = register_codec(QuantCodec("q8"))
Q4 = register_codec(QuantCodec("q4"))
