"""Tensor codecs, messages and frames of fusionnode.wire: exact round trips and refusals."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from fusionnode.errors import ProtocolError, VersionMismatchError
from fusionnode.wire import (
    DEFAULT_LIMITS,
    DTYPES,
    HEADER_LEN,
    PROTOCOL_MAJOR,
    Call,
    EncodedTensor,
    Hello,
    Limits,
    Reply,
    TensorMessage,
    decode_message,
    decode_tensor,
    encode_message,
    encode_tensor,
    pack_encoded,
    registered_codecs,
    unpack_encoded,
)
from fusionnode.wire.frames import FLAG_CRC32, MAGIC, pack_header

torch.set_num_threads(1)


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen, dtype=dtype)


def test_raw_and_fp16_are_registered() -> None:
    assert {"raw", "fp16"} <= set(registered_codecs())


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)])
def test_raw_round_trip_is_exact(name: str, shape: tuple[int, ...]) -> None:
    t = _sample(DTYPES[name], shape)
    enc = encode_tensor(t)
    assert (enc.dtype, enc.shape, enc.codec, enc.params) == (name, shape, "raw", {})
    assert len(enc.data) == t.numel() * t.element_size()
    for e in (enc, unpack_encoded(pack_encoded(enc))):
        out = decode_tensor(e)
        assert out.dtype == t.dtype and out.shape == t.shape
        assert torch.equal(out, t)


def test_raw_bytes_are_little_endian_c_order() -> None:
    t = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32).t()  # non-contiguous
    assert encode_tensor(t).data == struct.pack("<4i", 1, 3, 2, 4)
    assert encode_tensor(torch.tensor([1.0], dtype=torch.bfloat16)).data == b"\x80\x3f"


@pytest.mark.parametrize("codec", ["raw", "fp16"])
def test_encoded_payload_does_not_alias_the_tensor(codec: str) -> None:
    for t in (torch.ones(8), torch.ones(8, dtype=torch.float16), torch.ones(4, 4).t()):
        enc = encode_tensor(t, codec)
        before = bytes(enc.data)
        t.add_(1.0)
        assert bytes(enc.data) == before
        assert memoryview(enc.data).readonly


def test_fp16_round_trip_and_saturation() -> None:
    t = torch.tensor([1.0, -2.5, 1e5, -1e6, float("inf"), 1e-9], dtype=torch.float32)
    enc = encode_tensor(t, "fp16")
    assert enc.dtype == "float32" and len(enc.data) == 2 * t.numel()
    out = decode_tensor(enc)
    assert out.dtype == torch.float32
    assert out.tolist()[:5] == [1.0, -2.5, 65504.0, -65504.0, float("inf")]
    assert out[5].item() == pytest.approx(1e-9, abs=6e-8)  # below float16's smallest subnormal
    nan = decode_tensor(encode_tensor(torch.tensor([float("nan")], dtype=torch.float64), "fp16"))
    assert nan.dtype == torch.float64 and torch.isnan(nan).all()
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(decode_tensor(encode_tensor(x, "fp16")), x, rtol=0, atol=0)


def test_fp16_refuses_integer_tensors() -> None:
    with pytest.raises(ProtocolError, match="float"):
        encode_tensor(torch.arange(3), "fp16")
    bad = EncodedTensor("int64", (1,), "fp16", {}, b"\x00\x3c")
    with pytest.raises(ProtocolError, match="float"):
        decode_tensor(bad)


def test_decode_from_writable_buffer_is_zero_copy() -> None:
    t = torch.arange(1024, dtype=torch.float32)
    frame = bytearray(encode_message(TensorMessage.from_tensors("activation", {}, {"x": t})))
    out = decode_message(frame).tensors["x"]
    x = decode_tensor(out)
    assert torch.equal(x, t)
    x[0] = 42.0  # shares the frame's memory
    assert decode_tensor(decode_message(frame).tensors["x"])[0].item() == 42.0


def test_decode_from_bytes_copies_so_bytes_stay_immutable() -> None:
    t = torch.arange(16, dtype=torch.float32)
    frame = encode_message(TensorMessage.from_tensors("activation", {}, {"x": t}))
    x = decode_tensor(decode_message(frame).tensors["x"])
    x.add_(1.0)
    assert encode_message(decode_message(frame)) == frame


@pytest.mark.parametrize(
    ("enc", "match"),
    [
        (EncodedTensor("float32", (2,), "raw", {}, b"\x00" * 4), "expected 8"),
        (EncodedTensor("float32", (2,), "raw", {}, b"\x00" * 12), "expected 8"),
        (EncodedTensor("complex64", (1,), "raw", {}, b"\x00" * 8), "unknown dtype"),
        (EncodedTensor("float32", (-1,), "raw", {}, b""), "dim"),
        (EncodedTensor("float32", (1 << 20, 1 << 20), "raw", {}, b""), "elements"),
        (EncodedTensor("float32", (1,) * 40, "raw", {}, b"\x00" * 4), "max_ndim"),
        (EncodedTensor("float32", (1,), "raw", {"x": 1}, b"\x00" * 4), "params"),
        (EncodedTensor("bool", (2,), "raw", {}, b"\x01\x02"), "0 or 1"),
        (EncodedTensor("float32", (1,), "nope", {}, b"\x00" * 4), "unknown tensor codec"),
    ],
)
def test_decode_tensor_refusals(enc: EncodedTensor, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_tensor(enc)


def test_element_limit_is_configurable() -> None:
    enc = encode_tensor(torch.zeros(100))
    with pytest.raises(ProtocolError, match="max_tensor_elements"):
        decode_tensor(enc, Limits(max_tensor_elements=99))
    assert decode_tensor(enc, Limits(max_tensor_elements=100)).shape == (100,)


MESSAGES = [
    Hello(peer_id="12D3KooW", software="fusionnode/0.1.0"),
    Call(
        method="ping",
        args={"a": [1, 2.5, None, True, b"\x00", {"b": "c"}], "neg": -(2**63), "big": 2**64 - 1},
    ),
    Reply(ok=True, result={"x": 1}),
    Reply(ok=False, result={}, error="boom"),
    TensorMessage(kind="params", meta={"names": []}, tensors={}),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("checksum", [False, True])
def test_message_round_trip(msg, checksum: bool) -> None:
    frame = encode_message(msg, checksum=checksum)
    assert frame[:4] == MAGIC and frame[4] == PROTOCOL_MAJOR
    assert decode_message(frame) == msg
    assert decode_message(bytearray(frame)) == msg
    assert encode_message(decode_message(frame), checksum=checksum) == frame


def test_tensor_message_round_trip_and_alignment() -> None:
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.tensor([True, False, True]),
        "c": torch.randn(2, 2, dtype=torch.float64),
        "d": torch.zeros(0, 4),
        "e": torch.tensor(7, dtype=torch.int16),
        "f": torch.randn(7, dtype=torch.bfloat16),
    }
    meta = {"job": "j", "step": 12, "micro_batch": 3, "stage": 1, "plan_version": 4}
    msg = TensorMessage.from_tensors("activation", meta, tensors)
    frame = bytearray(encode_message(msg))
    back = decode_message(frame)
    assert back.kind == "activation" and back.meta == meta and list(back.tensors) == list(tensors)
    base = memoryview(frame)
    for name, t in back.decode_tensors().items():
        assert t.dtype == tensors[name].dtype and t.shape == tensors[name].shape
        assert torch.equal(t, tensors[name])
    for enc in back.tensors.values():
        assert isinstance(enc.data, memoryview) and enc.data.obj is frame  # zero-copy views
    # payload offsets are multiples of 8 from the frame start
    start = np.frombuffer(base, np.uint8).ctypes.data
    for enc in back.tensors.values():
        if len(enc.data):
            assert (np.frombuffer(enc.data, np.uint8).ctypes.data - start) % 8 == 0
    mixed = TensorMessage.from_tensors("gradient", {}, {"g": torch.randn(4)}, codec="fp16")
    assert decode_message(encode_message(mixed)) == mixed


def _frame(msg_type: int = 2, flags: int = 0, meta_len: int = 0, body_len: int = 0, crc: int = 0) -> bytes:
    return pack_header(msg_type, flags, meta_len, body_len, crc)


def test_other_major_version_is_refused_clearly() -> None:
    frame = bytearray(encode_message(Hello("p", "s")))
    frame[4] = PROTOCOL_MAJOR + 1
    with pytest.raises(
        VersionMismatchError, match=rf"protocol {PROTOCOL_MAJOR + 1}\.0.*major versions differ"
    ):
        decode_message(bytes(frame))
    with pytest.raises(VersionMismatchError):
        decode_message(bytes(frame[:6]))  # refused from the prefix alone


def test_newer_minor_version_is_accepted() -> None:
    frame = bytearray(encode_message(Call("m", {"x": 1})))
    frame[5] = 7
    assert decode_message(bytes(frame)) == Call("m", {"x": 1})


def test_unknown_envelope_fields_are_ignored() -> None:
    from fusionnode.wire.values import pack

    envelope = pack({"method": "m", "args": {}, "added_in_1_3": [1, 2]})
    frame = _frame(2, 0, len(envelope), len(envelope)) + envelope
    assert decode_message(frame) == Call("m", {})


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (b"", "truncated"),
        (b"XXXX\x01\x00" + bytes(18), "magic"),
        (_frame(msg_type=99), "unknown message type"),
        (_frame(flags=0x80), "flags"),
        (_frame(body_len=1 << 60), "max_frame_bytes"),
        (_frame(meta_len=10, body_len=5), "exceeds body length"),
        (_frame(crc=5), "crc32 field"),
        (_frame(body_len=5, meta_len=5) + b"\x80", "truncated"),
        (encode_message(Call("m")) + b"\x00", "trailing"),
        (encode_message(Call("m"))[:-1], "truncated"),
    ],
)
def test_frame_refusals(frame: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_message(frame)


def test_crc_mismatch_is_refused() -> None:
    frame = bytearray(
        encode_message(TensorMessage.from_tensors("g", {}, {"x": torch.ones(4)}), checksum=True)
    )
    assert frame[7] & FLAG_CRC32
    frame[-1] ^= 0x01
    with pytest.raises(ProtocolError, match="CRC"):
        decode_message(bytes(frame))


def test_envelope_limits() -> None:
    deep: dict = {}
    node = deep
    for _ in range(DEFAULT_LIMITS.max_depth + 1):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(ProtocolError, match="max_depth"):
        encode_message(Call("m", deep))
    with pytest.raises(ProtocolError, match="max_str"):
        decode_message(encode_message(Call("m", {"s": "x" * 100})), Limits(max_string=50))
    with pytest.raises(ProtocolError, match=r"container|max_array_len|exceeds"):
        decode_message(encode_message(Call("m", {"l": list(range(20))})), Limits(max_container_len=10))
    many = TensorMessage.from_tensors("g", {}, {str(i): torch.zeros(1) for i in range(5)})
    with pytest.raises(ProtocolError, match="max_tensors"):
        decode_message(encode_message(many), Limits(max_tensors=4))
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        decode_message(encode_message(Call("m", {"b": bytes(1000)})), Limits(max_frame_bytes=512))


def test_envelope_schema_refusals() -> None:
    from fusionnode.wire.values import pack

    def frame(msg_type: int, body: object) -> bytes:
        env = pack(body)
        return _frame(msg_type, 0, len(env), len(env)) + env

    with pytest.raises(ProtocolError, match="missing field 'args'"):
        decode_message(frame(2, {"method": "m"}))
    with pytest.raises(ProtocolError, match="must be bool"):
        decode_message(frame(3, {"ok": 1, "result": {}, "error": ""}))
    with pytest.raises(ProtocolError, match="must be a map"):
        decode_message(frame(2, [1, 2]))
    with pytest.raises(ProtocolError, match="map keys must be strings"):
        decode_message(frame(2, {"method": "m", "args": {b"k": 1}}))
    with pytest.raises(ProtocolError, match="protocol"):
        decode_message(frame(1, {"peer_id": "p", "software": "s", "protocol": [1, 2, 3]}))
    bad_layout = {
        "kind": "g",
        "meta": {},
        "tensors": {"x": {"dtype": "float32", "shape": [1], "codec": "raw", "params": {}, "nbytes": 4}},
    }
    with pytest.raises(ProtocolError, match="payload layout"):
        decode_message(frame(4, bad_layout))
    dup = b"\x82\xa6method\xa1m\xa6method\xa1n"  # {"method": "m", "method": "n"}
    with pytest.raises(ProtocolError, match="duplicate"):
        decode_message(_frame(2, 0, len(dup), len(dup)) + dup)
    ext = b"\x82\xa6method\xa1m\xa4args\xd4\x05\x00"  # args = ext type 5
    with pytest.raises(ProtocolError, match="ext"):
        decode_message(_frame(2, 0, len(ext), len(ext)) + ext)


def test_nonzero_padding_is_refused() -> None:
    frame = bytearray(encode_message(TensorMessage.from_tensors("g", {}, {"x": torch.ones(2)})))
    meta_len = int.from_bytes(frame[8:12], "little")
    pad_at = HEADER_LEN + meta_len
    assert pad_at % 8, "test needs an envelope that leaves padding"
    frame[pad_at] = 1
    with pytest.raises(ProtocolError, match="padding"):
        decode_message(bytes(frame))


def test_encoder_refuses_non_wire_values() -> None:
    with pytest.raises(ProtocolError):
        encode_message(Call("m", {"x": object()}))
    with pytest.raises(ProtocolError):
        encode_message(Call("m", {1: "int key"}))  # type: ignore[dict-item]
    with pytest.raises(ProtocolError):
        encode_message(Reply(ok="yes"))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        encode_tensor(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ProtocolError):
        encode_message("not a message")  # type: ignore[arg-type]
