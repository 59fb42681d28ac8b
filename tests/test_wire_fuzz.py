"""Property and fuzz tests of the wire decoder: round trips, and nothing but ProtocolError on bad bytes."""

from __future__ import annotations

import importlib
import json
import pathlib
import pkgutil
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusionnode.errors import ProtocolError
from fusionnode.wire import (
    DTYPES,
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
    unpack_encoded,
)
from fusionnode.wire.frames import pack_header
from fusionnode.wire.values import pack

torch.set_num_threads(1)

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)
SMALL = Limits(
    max_frame_bytes=1 << 16,
    max_tensor_elements=4096,
    max_tensors=8,
    max_string=256,
    max_depth=6,
    max_container_len=64,
)

keys = st.text(max_size=8)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=12,
)
maps = st.dictionaries(keys, values, max_size=5)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    name = draw(st.sampled_from(sorted(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[name]
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float32).mul(1000).to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


@st.composite
def encoded(draw: st.DrawFn) -> EncodedTensor:
    t = draw(tensors())
    codec = draw(st.sampled_from(["raw", "fp16"])) if t.is_floating_point() else "raw"
    return encode_tensor(t, codec)


messages = st.one_of(
    st.builds(
        Hello, st.text(max_size=30), st.text(max_size=30), st.tuples(st.integers(0, 255), st.integers(0, 255))
    ),
    st.builds(Call, st.text(max_size=20), maps),
    st.builds(Reply, st.booleans(), maps, st.text(max_size=20)),
    st.builds(TensorMessage, st.text(max_size=10), maps, st.dictionaries(keys, encoded(), max_size=4)),
)


@settings(FUZZ, max_examples=120)
@given(messages, st.booleans())
def test_message_round_trip(msg, checksum: bool) -> None:
    frame = encode_message(msg, checksum=checksum)
    back = decode_message(frame)
    assert back == msg
    assert encode_message(back, checksum=checksum) == frame


@FUZZ
@given(tensors())
def test_raw_tensor_round_trip(t: torch.Tensor) -> None:
    enc = unpack_encoded(pack_encoded(encode_tensor(t)))
    out = decode_tensor(enc)
    assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)


def _decode_fully(buf: bytes, limits: Limits) -> None:
    msg = decode_message(buf, limits)
    if isinstance(msg, TensorMessage):
        msg.decode_tensors(limits)


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_protocol_error(buf: bytes) -> None:
    for limits in (SMALL, Limits()):
        try:
            _decode_fully(buf, limits)
        except ProtocolError:
            pass
        try:
            decode_tensor(unpack_encoded(buf, limits), limits)
        except ProtocolError:
            pass


@FUZZ
@given(st.integers(1, 4), st.integers(0, 255), st.binary(max_size=300))
def test_valid_header_random_envelope(msg_type: int, flags: int, envelope: bytes) -> None:
    frame = pack_header(msg_type, flags & 1, len(envelope), len(envelope), 0) + envelope
    try:
        _decode_fully(frame, SMALL)
    except ProtocolError:
        pass


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    frame = bytearray(encode_message(draw(messages), checksum=draw(st.booleans())))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]))
        if not frame:
            break
        i = draw(st.integers(0, len(frame) - 1))
        if op == "flip":
            frame[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            frame[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC1, 0xCF, 0xDD, 0xDF, 0xFF]))
        elif op == "truncate":
            del frame[i:]
        elif op == "insert":
            frame[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:
            del frame[i : i + draw(st.integers(1, 8))]
    return bytes(frame)


@FUZZ
@given(mutated_frames())
def test_mutated_frames_raise_only_protocol_error(frame: bytes) -> None:
    for limits in (SMALL, Limits()):
        try:
            _decode_fully(frame, limits)
            _decode_fully(bytearray(frame), limits)
        except ProtocolError:
            pass


@FUZZ
@given(encoded(), st.integers(0, 10_000), st.integers(0, 255))
def test_mutated_encoded_tensors_raise_only_protocol_error(enc: EncodedTensor, pos: int, byte: int) -> None:
    buf = bytearray(pack_encoded(enc))
    buf[pos % len(buf)] = byte
    for candidate in (bytes(buf), bytes(buf[: pos % len(buf)])):
        try:
            out = decode_tensor(unpack_encoded(candidate, SMALL), SMALL)
        except ProtocolError:
            continue
        assert out.numel() <= SMALL.max_tensor_elements


def _tensor_frame(shape: list[int], nbytes: int, payload: bytes = b"", dtype: str = "float32") -> bytes:
    desc = {"dtype": dtype, "shape": shape, "codec": "raw", "params": {}, "nbytes": nbytes}
    env = pack({"kind": "g", "meta": {}, "tensors": {"x": desc}})
    pad = bytes(-(24 + len(env)) % 8)
    body = env + pad + payload
    return pack_header(4, 0, len(env), len(body), 0) + body


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (pack_header(4, 0, 0, 1 << 60, 0), "max_frame_bytes"),
        (pack_header(4, 0, 1 << 31, (1 << 64) - 1, 0), "max_frame_bytes"),
        (_tensor_frame([1 << 40], 0), "elements"),
        (_tensor_frame([1 << 20, 1 << 20], 4), "elements"),
        (_tensor_frame([0, 1 << 62], 0), "max_tensor_elements"),
        (_tensor_frame([4], 1 << 40), "layout"),
        (_tensor_frame([4], 16, b"\x00" * 8), "layout"),
        (_tensor_frame([4], 16, b"\x00" * 16)[:-3], "truncated"),
        (_tensor_frame([4], 8, b"\x00" * 8), "expected 16"),
    ],
    ids=[
        "body-2^60",
        "body-2^64",
        "shape-2^40",
        "shape-2^40-2d",
        "zero-dim-huge",
        "nbytes-2^40",
        "short-body",
        "cut",
        "short-payload",
    ],
)
def test_huge_declarations_are_refused_before_allocation(frame: bytes, match: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match=match):
            _decode_fully(frame, Limits())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decoder allocated {peak} bytes while refusing a {len(frame)}-byte frame"


def _golden() -> list[tuple[str, bytes]]:
    """Every golden vector (topk_* included) as (kind, bytes), with every codec module imported."""
    package = importlib.import_module("fusionnode.compress")
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
    vector_dir = pathlib.Path(__file__).resolve().parents[1] / "protocol" / "vectors"
    out = []
    for path in sorted(vector_dir.glob("*.json")):
        vector = json.loads(path.read_text())
        out.append((vector["kind"], bytes.fromhex(vector["hex"])))
    return out


GOLDEN = _golden()


@FUZZ
@given(
    st.sampled_from(GOLDEN),
    st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=3),
)
def test_mutated_golden_vectors_raise_only_protocol_error(
    vector: tuple[str, bytes], edits: list[tuple[int, int]]
) -> None:
    kind, data = vector
    buf = bytearray(data)
    for pos, byte in edits:
        buf[pos % len(buf)] = byte
    for candidate in (bytes(buf), bytes(buf[: edits[0][0] % len(buf)])):
        try:
            if kind == "message":
                _decode_fully(candidate, SMALL)
            else:
                out = decode_tensor(unpack_encoded(candidate, SMALL), SMALL)
                assert out.numel() <= SMALL.max_tensor_elements
        except ProtocolError:
            pass
