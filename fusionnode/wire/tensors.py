"""Tensor codecs "raw" and "fp16", and the standalone msgpack form of one encoded tensor.

"raw" sends the exact little-endian bytes of the tensor in its own dtype; "fp16" sends a float
tensor as IEEE float16 and decodes it back to its logical dtype. Both are registered in the codec
registry of `codec_api` when this module is imported (importing `fusionnode.wire` does it).

Decoding is zero-copy when the payload lies in writable, aligned memory (frames read by
`wire.stream.read_message` do); a payload in immutable memory (a `bytes` object) is copied once so
the returned tensor never aliases memory Python considers read-only.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from fusionnode.errors import ProtocolError
from fusionnode.wire.codec_api import DTYPE_NAMES, DTYPES, EncodedTensor, get_codec, register_codec
from fusionnode.wire.limits import DEFAULT_LIMITS, Limits
from fusionnode.wire.values import check_map, check_value, field, pack, unpack

FLOAT16_MAX = 65504.0  # largest finite float16; finite values beyond it saturate in the fp16 codec
FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_LITTLE_ENDIAN_HOST = sys.byteorder == "little"

BytesLike = bytes | bytearray | memoryview


# ---------------------------------------------------------------- validation shared with frames


def wire_dtype(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise ProtocolError(f"unknown dtype {name!r} (known: {sorted(DTYPES)})")
    return DTYPES[name]


def check_shape(shape: object, limits: Limits = DEFAULT_LIMITS) -> int:
    """Validate a declared shape and return its element count, refusing it before any allocation."""
    return shape_numel(shape, limits.max_tensor_elements, limits.max_ndim)


def shape_numel(shape: object, max_elements: int, max_ndim: int = DEFAULT_LIMITS.max_ndim) -> int:
    """Element count of a declared shape; ProtocolError for a bad shape or more than `max_elements`."""
    if not isinstance(shape, (tuple, list)):
        raise ProtocolError(f"shape must be an array of ints, got {type(shape).__name__}")
    if len(shape) > max_ndim:
        raise ProtocolError(f"tensor of {len(shape)} dims exceeds max_ndim={max_ndim}")
    numel = 1
    for dim in shape:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise ProtocolError(f"shape {shape!r}: every dim must be an int >= 0")
        # a zero anywhere makes the tensor empty, but the other dims are still bounded
        if dim > max_elements:
            raise ProtocolError(f"shape {shape!r}: dim {dim} exceeds max_tensor_elements={max_elements}")
        numel *= dim
    if numel > max_elements:
        raise ProtocolError(
            f"shape {list(shape)} has {numel} elements, over max_tensor_elements={max_elements}"
        )
    return numel


_ITEMSIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in DTYPES.values()}


def itemsize(dtype: torch.dtype) -> int:
    return _ITEMSIZE[dtype]


def _tensor_dtype_name(t: torch.Tensor) -> str:
    if not isinstance(t, torch.Tensor):
        raise ProtocolError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ProtocolError(f"only dense (strided) tensors cross the wire, got layout {t.layout}")
    try:
        return DTYPE_NAMES[t.dtype]
    except KeyError:
        raise ProtocolError(f"dtype {t.dtype} cannot cross the wire (allowed: {sorted(DTYPES)})") from None


def _little_endian_bytes(t: torch.Tensor, owned: bool = False) -> memoryview:
    """The tensor's elements, C order, little-endian, as a read-only memoryview over private memory.

    At most one copy, into numpy-allocated memory (huge pages for big buffers, which a fresh `bytes`
    object does not get); none when `t` is a private temporary (`owned`) or had to be copied anyway.
    """
    original = t
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    raw = t.reshape(-1).view(torch.uint8).numpy()
    owned = owned or t.data_ptr() != original.data_ptr()
    if not _LITTLE_ENDIAN_HOST and t.element_size() > 1:
        raw = raw.view(f"u{t.element_size()}").byteswap().view(np.uint8)
    elif not owned:
        raw = raw.copy()
    raw.flags.writeable = False
    return memoryview(raw)


def _flat_from_payload(data: BytesLike, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A flat tensor of `numel` elements over `data` (len(data) already checked): a view when possible."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    size = itemsize(dtype)
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if mv.readonly or not _LITTLE_ENDIAN_HOST:
        flat = torch.from_numpy(np.frombuffer(mv, dtype=np.uint8).copy())  # numpy memory: huge pages
    else:
        flat = torch.frombuffer(mv, dtype=torch.uint8)
        if flat.data_ptr() % size:
            flat = flat.clone()  # misaligned for this dtype: copy into aligned memory
    if not _LITTLE_ENDIAN_HOST and size > 1:
        flat.numpy().view(f"u{size}").byteswap(inplace=True)
    return flat.view(dtype)


def _check_payload_len(enc: EncodedTensor, numel: int, size: int) -> None:
    expected = numel * size
    if len(enc.data) != expected:
        raise ProtocolError(
            f"{enc.codec} payload of {len(enc.data)} bytes for dtype {enc.dtype} shape {list(enc.shape)}:"
            f" expected {expected}"
        )


# ---------------------------------------------------------------- codecs


class RawCodec:
    """The tensor's own dtype, little-endian, C order, no parameters. Lossless."""

    name = "raw"

    def encode(self, tensor: torch.Tensor, **options: Any) -> EncodedTensor:
        if options:
            raise ProtocolError(f"codec 'raw' takes no options, got {sorted(options)}")
        dtype_name = _tensor_dtype_name(tensor)
        return EncodedTensor(
            dtype_name, tuple(int(d) for d in tensor.shape), self.name, {}, _little_endian_bytes(tensor)
        )

    def decode(self, enc: EncodedTensor, max_elements: int) -> torch.Tensor:
        dtype = wire_dtype(enc.dtype)
        numel = shape_numel(enc.shape, max_elements)
        if enc.params:
            raise ProtocolError(f"codec 'raw' takes no params, got {sorted(enc.params)}")
        _check_payload_len(enc, numel, itemsize(dtype))
        if dtype is torch.bool:
            flat = _flat_from_payload(enc.data, torch.uint8, numel)
            if numel and int(flat.max()) > 1:
                raise ProtocolError("bool tensor payload holds a byte other than 0 or 1")
            return flat.view(torch.bool).reshape(enc.shape)
        return _flat_from_payload(enc.data, dtype, numel).reshape(enc.shape)


class Fp16Codec:
    """Float tensors as IEEE-754 binary16, little-endian. Lossy: round to nearest even; finite values
    beyond +-65504 saturate to +-65504; inf and NaN pass through. Decodes to the logical dtype."""

    name = "fp16"

    def encode(self, tensor: torch.Tensor, **options: Any) -> EncodedTensor:
        if options:
            raise ProtocolError(f"codec 'fp16' takes no options, got {sorted(options)}")
        dtype_name = _tensor_dtype_name(tensor)
        if tensor.dtype not in FLOAT_DTYPES:
            raise ProtocolError(f"codec 'fp16' encodes float tensors only, got {tensor.dtype}")
        src = tensor.detach()
        if src.device.type != "cpu":
            src = src.cpu()
        half = src.to(torch.float16)
        if src.dtype is not torch.float16 and half.numel():
            overflow = torch.isinf(half) & torch.isfinite(src)
            if bool(overflow.any()):
                half[overflow] = torch.where(src[overflow] > 0, FLOAT16_MAX, -FLOAT16_MAX).to(torch.float16)
        return EncodedTensor(
            dtype_name,
            tuple(int(d) for d in tensor.shape),
            self.name,
            {},
            _little_endian_bytes(half, owned=half is not src),
        )

    def decode(self, enc: EncodedTensor, max_elements: int) -> torch.Tensor:
        dtype = wire_dtype(enc.dtype)
        if dtype not in FLOAT_DTYPES:
            raise ProtocolError(f"codec 'fp16' decodes to float dtypes only, got {enc.dtype}")
        numel = shape_numel(enc.shape, max_elements)
        if enc.params:
            raise ProtocolError(f"codec 'fp16' takes no params, got {sorted(enc.params)}")
        _check_payload_len(enc, numel, 2)
        half = _flat_from_payload(enc.data, torch.float16, numel).reshape(enc.shape)
        return half if dtype is torch.float16 else half.to(dtype)


RAW = register_codec(RawCodec())
FP16 = register_codec(Fp16Codec())
_OWN_CODECS = frozenset({RAW.name, FP16.name})


# ---------------------------------------------------------------- public API


def encode_tensor(t: torch.Tensor, codec: str = "raw", **options: Any) -> EncodedTensor:
    """Encode `t` with the registered codec `codec` (options are codec-specific)."""
    enc = get_codec(codec).encode(t, **options)
    check_encoded(enc)
    return enc


def decode_tensor(enc: EncodedTensor, limits: Limits = DEFAULT_LIMITS) -> torch.Tensor:
    """Decode `enc` to a tensor of exactly `enc.dtype` and `enc.shape`; ProtocolError otherwise."""
    dtype = wire_dtype(enc.dtype)
    check_shape(enc.shape, limits)
    codec = get_codec(enc.codec)
    if enc.codec not in _OWN_CODECS and not isinstance(enc.data, bytes):
        # other codecs are promised `bytes`; frames hand out zero-copy memoryviews
        enc = EncodedTensor(enc.dtype, enc.shape, enc.codec, enc.params, bytes(enc.data))
    try:
        out = codec.decode(enc, limits.max_tensor_elements)
    except ProtocolError:
        raise
    except (ValueError, TypeError, RuntimeError, IndexError, OverflowError, KeyError) as exc:
        raise ProtocolError(f"codec {enc.codec!r} could not decode its payload: {exc}") from exc
    if not isinstance(out, torch.Tensor) or out.dtype != dtype or tuple(out.shape) != tuple(enc.shape):
        got = (out.dtype, tuple(out.shape)) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ProtocolError(f"codec {enc.codec!r} decoded {got}, declared ({dtype}, {tuple(enc.shape)})")
    return out


def check_encoded(enc: EncodedTensor, limits: Limits = DEFAULT_LIMITS) -> None:
    """Raise ProtocolError unless the header fields of `enc` are valid wire values (payload unchecked)."""
    if not isinstance(enc, EncodedTensor):
        raise ProtocolError(f"expected an EncodedTensor, got {type(enc).__name__}")
    wire_dtype(enc.dtype)
    check_shape(enc.shape, limits)
    if not isinstance(enc.codec, str) or not enc.codec:
        raise ProtocolError(f"codec name must be a non-empty string, got {enc.codec!r}")
    if not isinstance(enc.params, dict):
        raise ProtocolError(f"codec params must be a map, got {type(enc.params).__name__}")
    check_value(enc.params, limits, depth=1)
    if not isinstance(enc.data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"payload must be bytes, got {type(enc.data).__name__}")


def descriptor(enc: EncodedTensor) -> dict[str, Any]:
    """The header fields of `enc` as the wire map, in canonical key order (payload excluded)."""
    return {"dtype": enc.dtype, "shape": list(enc.shape), "codec": enc.codec, "params": enc.params}


def parse_descriptor(
    obj: object, what: str, limits: Limits = DEFAULT_LIMITS
) -> tuple[str, tuple[int, ...], str, dict]:
    """(dtype, shape, codec, params) from a decoded tensor map, validated against `limits`."""
    m = check_map(obj, what)
    dtype = field(m, "dtype", str, what)
    wire_dtype(dtype)
    shape = field(m, "shape", list, what)
    check_shape(shape, limits)
    codec = field(m, "codec", str, what)
    if not codec:
        raise ProtocolError(f"{what}: empty codec name")
    params = field(m, "params", dict, what)
    return dtype, tuple(shape), codec, params


def pack_encoded(enc: EncodedTensor) -> bytes:
    """Canonical standalone msgpack form: {dtype, shape, codec, params, data: bin}."""
    check_encoded(enc)
    body = descriptor(enc)
    body["data"] = enc.data
    return pack(body)


def unpack_encoded(buf: BytesLike, limits: Limits = DEFAULT_LIMITS) -> EncodedTensor:
    """Inverse of `pack_encoded`; validates the header fields but not the payload (see decode_tensor)."""
    if len(buf) > limits.max_frame_bytes:
        raise ProtocolError(
            f"encoded tensor of {len(buf)} bytes exceeds max_frame_bytes={limits.max_frame_bytes}"
        )
    obj = unpack(buf, limits)
    dtype, shape, codec, params = parse_descriptor(obj, "tensor", limits)
    data = field(obj, "data", bytes, "tensor")
    return EncodedTensor(dtype, shape, codec, params, data)
