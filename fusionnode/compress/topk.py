"""The "topk" tensor codec: keep the k largest-magnitude elements, send (indices, values).

Payload layout and validation rules are specified language-neutrally in
protocol/COMPRESSION.md; this module is the Python implementation.

Selection modes:
- "global": the k elements of largest |x| over the whole tensor; indices are flat
  positions in [0, numel).
- "row": the k_row elements of largest |x| within each last-dimension row (per token
  for activations [B, T, C]); indices are positions within the row, [0, row_len).

Indices are sent sorted (strictly increasing, within each row in "row" mode), either
as a list of unsigned little-endian integers of the smallest width that holds the
index range, or as a bitmap of numel bits when that is smaller. Values follow, in
the same order, as float16 / bfloat16 / float32 little-endian.

Everything is vectorised (torch / numpy), single-threaded friendly: selection is an
exact radix select on the float bit patterns (histogram of the top 16 bits, then an
exact k-th value inside the one boundary bucket), so sorting is never needed.
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

CODEC_NAME = "topk"
FORMAT_VERSION = 1  # params["v"]; a receiver refuses any other value
MODES = ("global", "row")
DEFAULT_MODE = "global"
DEFAULT_VALUE_DTYPE = "float16"
# value dtypes that may carry the kept values, with their size in bytes
VALUE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
VALUE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}
# integer index list encodings: name -> (bytes per index, numpy little-endian dtype)
INDEX_LISTS: dict[str, tuple[int, str]] = {
    "u8": (1, "<u1"),
    "u16": (2, "<u2"),
    "u32": (4, "<u4"),
    "u64": (8, "<u8"),
}
BITMAP = "bitmap"
INDEX_ENCODINGS = (*INDEX_LISTS, BITMAP)
# floating dtypes the codec accepts (the decoded tensor gets this dtype back)
PARAM_KEYS = frozenset({"v", "mode", "k", "ratio", "index", "values", "row_len", "center"})

FLOAT16_MAX = 65504.0  # largest finite float16; larger finite kept values saturate to it
_RADIX_SHIFT = 15  # float32 bit pattern >> 15 keeps 16 bits: 65536 histogram buckets
_RADIX_BUCKETS = 1 << (31 - _RADIX_SHIFT)  # |x| has a clear sign bit
_LITTLE = sys.byteorder == "little"


# ----------------------------------------------------------------- sizes


def keep_count(numel: int, ratio: float) -> int:
    """Elements kept out of `numel` at keep ratio `ratio`: ceil(ratio * numel), at least 1."""
    if not (0.0 < ratio <= 1.0):
        raise ValueError(f"keep ratio must be in (0, 1], got {ratio!r}")
    if numel <= 0:
        return 0
    return min(numel, max(1, math.ceil(ratio * numel - 1e-9)))


def index_list_encoding(index_limit: int) -> str:
    """Smallest unsigned integer encoding that holds every index in [0, index_limit)."""
    top = max(index_limit - 1, 0)
    for name, (width, _) in INDEX_LISTS.items():
        if top < 1 << (8 * width):
            return name
    raise ValueError(f"index range {index_limit} does not fit in 64 bits")


def bitmap_bytes(numel: int) -> int:
    return (numel + 7) // 8


def choose_index_encoding(numel: int, k: int, index_limit: int) -> tuple[str, int]:
    """The index encoding with the fewest bytes: (name, index section bytes). Ties go to the list."""
    name = index_list_encoding(index_limit)
    list_bytes = k * INDEX_LISTS[name][0]
    bm = bitmap_bytes(numel)
    return (BITMAP, bm) if bm < list_bytes else (name, list_bytes)


def payload_bytes(
    numel: int,
    ratio: float,
    value_dtype: str = DEFAULT_VALUE_DTYPE,
    row_len: int | None = None,
    center_channels: int = 0,
) -> int:
    """Exact payload size of a topk message for a tensor of `numel` elements.

    `row_len` None means global mode; otherwise the last-dimension length in row mode.
    `center_channels`: shape[-1] when the message is centered, else 0.
    Used by the policy to turn a byte budget into a keep ratio.
    """
    if row_len is None:
        k = keep_count(numel, ratio)
        limit = numel
    else:
        rows = numel // row_len if row_len else 0
        k = rows * keep_count(row_len, ratio)
        limit = row_len
    _, index_bytes = choose_index_encoding(numel, k, limit)
    return (center_channels + k) * VALUE_BYTES[value_dtype] + index_bytes


# ----------------------------------------------------------------- selection


def topk_mask(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the k largest entries of a 1-D non-negative float32 tensor.

    Exact; ties at the threshold are broken towards the lowest index, so the result is
    deterministic. Radix select: histogram of the top 16 bits of the IEEE-754 pattern
    (monotone for non-negative floats), then an exact kthvalue inside the bucket
    that holds the k-th largest element.
    """
    n = magnitude.numel()
    if k >= n:
        return torch.ones(n, dtype=torch.bool)
    if k <= 0:
        return torch.zeros(n, dtype=torch.bool)
    bits = magnitude.view(torch.int32)
    buckets = bits >> _RADIX_SHIFT
    counts = torch.bincount(buckets, minlength=_RADIX_BUCKETS)
    above = counts.flip(0).cumsum(0).flip(0)  # above[b] = elements in buckets >= b
    b = int(torch.searchsorted(-above, torch.tensor(-k), right=True)) - 1  # last b with above[b] >= k
    in_bucket = buckets == b
    candidates = magnitude[in_bucket]
    higher = int(above[b + 1]) if b + 1 < _RADIX_BUCKETS else 0
    need = k - higher  # how many of the bucket's elements are kept, >= 1
    # the need-th largest candidate is the exact threshold value
    threshold = torch.kthvalue(candidates, candidates.numel() - need + 1).values
    mask = magnitude >= threshold
    if int(torch.count_nonzero(mask)) == k:  # the usual case: no surplus ties at the threshold
        return mask
    # more elements equal the threshold than there is room for: keep the lowest-index ones
    mask = magnitude > threshold
    short = k - int(torch.count_nonzero(mask))
    tie_idx = (magnitude == threshold).nonzero().squeeze(1)[:short]
    mask[tie_idx] = True
    return mask


def _row_topk_indices(magnitude: torch.Tensor, k_row: int) -> torch.Tensor:
    """[rows, row_len] magnitudes -> [rows, k_row] within-row indices, sorted ascending."""
    idx = torch.topk(magnitude, k_row, dim=1, sorted=False).indices
    return torch.sort(idx, dim=1).values


# ----------------------------------------------------------------- byte helpers


def _values_to_bytes(values: torch.Tensor, value_dtype: str) -> bytes:
    v = values.to(VALUE_DTYPES[value_dtype]).contiguous()
    if value_dtype == "float16" and values.dtype != torch.float16 and v.numel():
        overflow = torch.isinf(v) & torch.isfinite(values)
        if bool(overflow.any()):  # saturate like the "fp16" codec: finite stays finite
            v[overflow] = torch.where(values[overflow] > 0, FLOAT16_MAX, -FLOAT16_MAX).to(torch.float16)
    int_dtype = torch.int32 if VALUE_BYTES[value_dtype] == 4 else torch.int16
    arr = v.view(int_dtype).numpy()
    if not _LITTLE:
        arr = arr.byteswap()
    return arr.tobytes()


def _values_from_bytes(data: memoryview, offset: int, k: int, value_dtype: str) -> torch.Tensor:
    width = VALUE_BYTES[value_dtype]
    np_dtype = "<i4" if width == 4 else "<i2"
    arr = np.frombuffer(data, dtype=np_dtype, count=k, offset=offset)
    arr = arr.astype(arr.dtype.newbyteorder("="), copy=True)  # native order, writable
    return torch.from_numpy(arr).view(VALUE_DTYPES[value_dtype])


def _indices_to_bytes(indices: torch.Tensor, encoding: str) -> bytes:
    return indices.numpy().astype(INDEX_LISTS[encoding][1], copy=False).tobytes()


def _bitmap_to_bytes(mask: torch.Tensor) -> bytes:
    return np.packbits(mask.numpy(), bitorder="little").tobytes()


# ----------------------------------------------------------------- codec


class TopKCodec:
    """Top-k sparsification codec, registered as "topk" in the wire codec registry."""

    name = CODEC_NAME

    def encode(
        self,
        tensor: torch.Tensor,
        ratio: float = 0.1,
        value_dtype: str = DEFAULT_VALUE_DTYPE,
        mode: str = DEFAULT_MODE,
        center: bool = False,
        **options: Any,
    ) -> EncodedTensor:
        """Keep ceil(ratio * numel) elements (ceil(ratio * row_len) per row in "row" mode).

        `center`: send the mean over rows of each last-dimension channel first, and select
        the top-k of the tensor minus that mean; dropped elements decode to their channel
        mean instead of zero (activations carry a large per-channel offset).
        """
        if options:
            raise ValueError(f"unknown topk options {sorted(options)}")
        if not (isinstance(ratio, (int, float)) and 0.0 < ratio <= 1.0):
            raise ValueError(f"keep ratio must be in (0, 1], got {ratio!r}")
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {sorted(VALUE_DTYPES)}, got {value_dtype!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        dtype_name, x, shape = float_input(tensor, CODEC_NAME)
        flat = x.reshape(-1)
        numel = flat.numel()
        if mode == "row" and x.dim() == 0:
            mode = "global"  # a scalar is one row of one element; global is the same thing
        center_part = b""
        if center:
            if x.dim() == 0:
                raise ValueError("center needs a tensor with at least one dimension")
            channels = shape[-1]
            mean = flat.view(-1, channels).float().mean(dim=0) if numel else torch.zeros(channels)
            center_part = _values_to_bytes(mean, value_dtype)
            mean_q = mean.to(VALUE_DTYPES[value_dtype]).float()  # exactly what the receiver adds back
            flat = (flat.view(-1, channels).float() - mean_q).reshape(-1) if numel else flat
        params: dict[str, Any] = {
            "v": FORMAT_VERSION,
            "mode": mode,
            "ratio": float(ratio),
            "values": value_dtype,
        }

        if mode == "global":
            k = keep_count(numel, ratio)
            encoding, _ = choose_index_encoding(numel, k, numel)
            magnitude = flat.abs()
            if magnitude.dtype != torch.float32:
                magnitude = magnitude.float()
            mask = topk_mask(magnitude, k)
            idx = mask.nonzero().squeeze(1)
            values = flat[idx]
            index_part = _bitmap_to_bytes(mask) if encoding == BITMAP else _indices_to_bytes(idx, encoding)
        else:
            row_len = shape[-1]
            rows = numel // row_len if row_len else 0
            k_row = keep_count(row_len, ratio)
            k = rows * k_row
            params["row_len"] = row_len
            encoding, _ = choose_index_encoding(numel, k, row_len)
            if k:
                rows2d = flat.view(rows, row_len)
                idx2d = _row_topk_indices(rows2d.abs(), k_row)
                values = torch.gather(rows2d, 1, idx2d).reshape(-1)
            else:
                idx2d = torch.zeros((rows, 0), dtype=torch.int64)
                values = flat[:0]
            if encoding == BITMAP:
                mask = torch.zeros(numel, dtype=torch.bool)
                mask.view(rows, row_len).scatter_(1, idx2d, True)
                index_part = _bitmap_to_bytes(mask)
            else:
                index_part = _indices_to_bytes(idx2d.reshape(-1), encoding)
        ordered = {
            "v": FORMAT_VERSION,
            "mode": mode,
            "k": k,
            "ratio": float(ratio),
            "index": encoding,
            "values": value_dtype,
        }
        if mode == "row":
            ordered["row_len"] = params["row_len"]
        if center:
            ordered["center"] = 1
        params = ordered  # canonical key order (protocol/COMPRESSION.md)
        data = center_part + index_part + _values_to_bytes(values, value_dtype)
        return EncodedTensor(dtype=dtype_name, shape=shape, codec=CODEC_NAME, params=params, data=data)

    def decode(self, enc: EncodedTensor, max_elements: int) -> torch.Tensor:
        """Validate everything (raising ProtocolError) and return the dense tensor."""
        p = _validated_params(enc, max_elements)
        numel, k, _mode, encoding, value_dtype = p["numel"], p["k"], p["mode"], p["index"], p["values"]
        row_len = p.get("row_len")
        channels = enc.shape[-1] if p["center"] else 0
        center_bytes = channels * VALUE_BYTES[value_dtype]
        data = memoryview(enc.data)
        index_bytes = bitmap_bytes(numel) if encoding == BITMAP else k * INDEX_LISTS[encoding][0]
        expected = center_bytes + index_bytes + k * VALUE_BYTES[value_dtype]
        if len(data) != expected:
            raise ProtocolError(
                f"topk payload is {len(data)} bytes, expected {expected} (center {center_bytes} + "
                f"{encoding} index section {index_bytes} + {k} {value_dtype} values)"
            )
        out_dtype = DTYPES[enc.dtype]
        values = _values_from_bytes(data, center_bytes + index_bytes, k, value_dtype).to(out_dtype)
        out = torch.zeros(numel, dtype=out_dtype)
        index_raw = data[center_bytes : center_bytes + index_bytes]
        if encoding == BITMAP:
            mask = _decode_bitmap(index_raw, numel, k, row_len)
            out.masked_scatter_(mask, values)
        else:
            flat_idx = _decode_index_list(index_raw, encoding, numel, k, row_len)
            out[flat_idx] = values
        if channels and numel:
            mean = _values_from_bytes(data, 0, channels, value_dtype).to(out_dtype)
            out.view(-1, channels).add_(mean)
        return out.view(enc.shape)


def _validated_params(enc: EncodedTensor, max_elements: int) -> dict[str, Any]:
    numel = check_float_header(enc, CODEC_NAME, max_elements)
    shape = enc.shape
    params = enc.params
    if not isinstance(params, dict):
        raise ProtocolError("topk params must be a map")
    unknown = set(params) - PARAM_KEYS
    if unknown:
        raise ProtocolError(f"topk params has unknown keys {sorted(unknown)}")
    v = params.get("v")
    if v != FORMAT_VERSION or isinstance(v, bool):
        raise ProtocolError(f"topk format version {v!r} not supported (this peer speaks {FORMAT_VERSION})")
    mode = params.get("mode")
    if mode not in MODES:
        raise ProtocolError(f"topk mode {mode!r} unknown (known: {MODES})")
    ratio = params.get("ratio")
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not (0.0 < ratio <= 1.0):
        raise ProtocolError(f"topk ratio must be a number in (0, 1], got {ratio!r}")
    encoding = params.get("index")
    if encoding not in INDEX_ENCODINGS:
        raise ProtocolError(f"topk index encoding {encoding!r} unknown (known: {INDEX_ENCODINGS})")
    value_dtype = params.get("values")
    if not isinstance(value_dtype, str) or value_dtype not in VALUE_DTYPES:
        raise ProtocolError(f"topk value dtype {value_dtype!r} unknown (known: {sorted(VALUE_DTYPES)})")
    k = params.get("k")
    if not isinstance(k, int) or isinstance(k, bool) or not (0 <= k <= numel):
        raise ProtocolError(f"topk k={k!r} must be an int in [0, numel={numel}]")
    center = params.get("center", 0)
    if type(center) is not int or center not in (0, 1) or (center and len(shape) == 0):
        raise ProtocolError(f"topk center must be 0 or 1 (1 needs at least one dimension), got {center!r}")
    out = {"numel": numel, "k": k, "mode": mode, "index": encoding, "values": value_dtype, "center": center}
    if mode == "row":
        row_len = params.get("row_len")
        if len(shape) == 0 or row_len != shape[-1] or isinstance(row_len, bool):
            raise ProtocolError(
                f"topk row mode needs row_len == shape[-1], got {row_len!r} for {tuple(shape)}"
            )
        rows = numel // row_len if row_len else 0
        if rows == 0:
            if k != 0:
                raise ProtocolError(f"topk k={k} for an empty tensor")
        elif k % rows or k // rows > row_len:
            raise ProtocolError(f"topk row mode k={k} is not rows={rows} times a k_row <= {row_len}")
        out["row_len"] = row_len
    elif "row_len" in params:
        raise ProtocolError("topk global mode must not carry row_len")
    return out


def _decode_index_list(
    raw: memoryview, encoding: str, numel: int, k: int, row_len: int | None
) -> torch.Tensor:
    arr = np.frombuffer(raw, dtype=INDEX_LISTS[encoding][1], count=k)
    limit = numel if row_len is None else row_len
    if k and int(arr.max()) >= limit:  # on the unsigned values, before any signed conversion
        raise ProtocolError(f"topk index {int(arr.max())} out of range [0, {limit})")
    idx = torch.from_numpy(arr.astype(np.int64))
    if row_len is None:
        if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise ProtocolError("topk indices must be strictly increasing (no duplicates)")
        return idx
    if k == 0:
        return idx
    rows = numel // row_len
    idx2d = idx.view(rows, k // rows)
    if idx2d.shape[1] > 1 and not bool((idx2d[:, 1:] > idx2d[:, :-1]).all()):
        raise ProtocolError("topk row indices must be strictly increasing within each row (no duplicates)")
    return (idx2d + torch.arange(rows).unsqueeze(1) * row_len).reshape(-1)


def _decode_bitmap(raw: memoryview, numel: int, k: int, row_len: int | None) -> torch.Tensor:
    packed = np.frombuffer(raw, dtype=np.uint8)
    bits = np.unpackbits(packed, bitorder="little")
    if bits[numel:].any():
        raise ProtocolError("topk bitmap has bits set past the last element")
    mask = torch.from_numpy(bits[:numel].view(np.bool_))
    set_bits = int(torch.count_nonzero(mask))
    if set_bits != k:
        raise ProtocolError(f"topk bitmap has {set_bits} bits set, k={k}")
    if row_len is not None and k:
        rows = numel // row_len
        per_row = mask.view(rows, row_len).sum(dim=1)
        if not bool((per_row == k // rows).all()):
            raise ProtocolError(f"topk row bitmap must set exactly {k // rows} bits in every row")
    return mask


TOPK = register_codec(TopKCodec())
