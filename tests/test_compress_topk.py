"""The "topk" codec: round trips, index encodings, and every validation rule of protocol/COMPRESSION.md."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fusionnode.compress  # registers "topk"
from fusionnode.compress.topk import (
    TOPK,
    choose_index_encoding,
    index_list_encoding,
    keep_count,
    payload_bytes,
    topk_mask,
)
from fusionnode.errors import ProtocolError
from fusionnode.wire.codec_api import get_codec
from fusionnode.wire.tensors import decode_tensor, pack_encoded, unpack_encoded

BIG = 1 << 30  # max_elements for tests that do not probe the limit


def _distinct(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random values with distinct magnitudes (so the true top-k set is unique)."""
    numel = math.prod(shape)
    gen = torch.Generator().manual_seed(seed)
    mags = (torch.randperm(numel, generator=gen) + 1).float() / 64.0  # multiples of 1/64, distinct
    signs = torch.where(torch.rand(numel, generator=gen) < 0.5, -1.0, 1.0)
    return (mags * signs).reshape(shape)


def _check_global(x: torch.Tensor, ratio: float) -> None:
    enc = TOPK.encode(x, ratio=ratio)
    y = TOPK.decode(enc, BIG)
    k = keep_count(x.numel(), ratio)
    assert enc.params["k"] == k
    assert y.dtype == x.dtype and y.shape == x.shape
    true_idx = set(torch.topk(x.abs().reshape(-1), k).indices.tolist())
    kept = set(torch.nonzero(y.reshape(-1)).squeeze(1).tolist())
    assert kept == true_idx
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    idx = torch.tensor(sorted(kept), dtype=torch.long)
    assert torch.equal(flat_y[idx], flat_x[idx].half().float())  # values travel as float16
    assert len(enc.data) == payload_bytes(x.numel(), ratio)


def test_registered_under_topk() -> None:
    assert get_codec("topk") is TOPK
    assert fusionnode.compress.TOPK is TOPK


@pytest.mark.parametrize("ratio", [0.01, 0.05, 0.1, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("shape", [(1000,), (4, 64, 32), (70000,), (3, 5)])
def test_global_round_trip_keeps_true_topk(shape: tuple[int, ...], ratio: float) -> None:
    _check_global(_distinct(shape), ratio)


@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("shape", [(8, 16, 128), (5, 300), (7,)])
def test_row_round_trip_keeps_per_row_topk(shape: tuple[int, ...], ratio: float) -> None:
    x = _distinct(shape, seed=1)
    enc = TOPK.encode(x, ratio=ratio, mode="row")
    y = TOPK.decode(enc, BIG)
    row_len = shape[-1]
    k_row = keep_count(row_len, ratio)
    rows_x, rows_y = x.reshape(-1, row_len), y.reshape(-1, row_len)
    assert enc.params["k"] == rows_x.shape[0] * k_row
    assert enc.params["row_len"] == row_len
    for rx, ry in zip(rows_x, rows_y, strict=True):
        true_idx = set(torch.topk(rx.abs(), k_row).indices.tolist())
        assert set(torch.nonzero(ry).squeeze(1).tolist()) == true_idx
        idx = torch.tensor(sorted(true_idx))
        assert torch.equal(ry[idx], rx[idx].half().float())
    assert len(enc.data) == payload_bytes(x.numel(), ratio, row_len=row_len)


def test_index_list_widths() -> None:
    assert index_list_encoding(1) == "u8"
    assert index_list_encoding(256) == "u8"
    assert index_list_encoding(257) == "u16"
    assert index_list_encoding(65536) == "u16"
    assert index_list_encoding(65537) == "u32"
    assert index_list_encoding(1 << 32) == "u32"
    assert index_list_encoding((1 << 32) + 1) == "u64"


@pytest.mark.parametrize(
    ("shape", "ratio", "mode", "expected"),
    [
        ((200,), 0.01, "global", "u8"),
        ((1000,), 0.01, "global", "u16"),
        ((70000,), 0.01, "global", "u32"),
        ((64, 128), 0.05, "row", "u8"),  # row indices < 128: one byte each
        ((1000,), 0.1, "global", "bitmap"),  # 100 * 2 bytes > 125 bytes of bitmap
        ((70000,), 0.1, "global", "bitmap"),
        ((64, 128), 0.5, "row", "bitmap"),
    ],
)
def test_index_encoding_chosen(shape: tuple[int, ...], ratio: float, mode: str, expected: str) -> None:
    x = _distinct(shape, seed=2)
    enc = TOPK.encode(x, ratio=ratio, mode=mode)
    assert enc.params["index"] == expected
    y = TOPK.decode(enc, BIG)
    assert int(torch.count_nonzero(y)) == enc.params["k"]


def test_bitmap_chosen_exactly_when_smaller() -> None:
    numel = 10_000  # u16 list: 2 bytes per index; bitmap: 1250 bytes
    assert choose_index_encoding(numel, 625, numel) == ("u16", 1250)  # tie goes to the list
    assert choose_index_encoding(numel, 626, numel) == ("bitmap", 1250)
    assert choose_index_encoding(numel, 100, numel) == ("u16", 200)


def _rebuild(enc, **changes):
    return dataclasses.replace(enc, **changes)


def test_u64_list_is_accepted_and_checked() -> None:
    """No tensor we can allocate needs u64, but a receiver must decode any list width."""
    x = _distinct((1000,), seed=3)
    enc = TOPK.encode(x, ratio=0.01)
    assert enc.params["index"] == "u16"
    k = enc.params["k"]
    idx = np.frombuffer(enc.data[: 2 * k], dtype="<u2").astype("<u8")
    wide = _rebuild(enc, params={**enc.params, "index": "u64"}, data=idx.tobytes() + enc.data[2 * k :])
    assert torch.equal(TOPK.decode(wide, BIG), TOPK.decode(enc, BIG))
    idx[-1] = (1 << 63) + 5  # would be negative as int64: must be rejected, not wrapped
    bad = _rebuild(wide, data=idx.tobytes() + enc.data[2 * k :])
    with pytest.raises(ProtocolError, match="out of range"):
        TOPK.decode(bad, BIG)


def test_ties_keep_lowest_indices() -> None:
    x = torch.ones(1000)
    x[500] = 2.0
    mask = topk_mask(x, 10)
    assert torch.nonzero(mask).squeeze(1).tolist() == [*range(9), 500]


def test_topk_mask_exact_on_large_random() -> None:
    a = torch.randn(300_000, generator=torch.Generator().manual_seed(4)).abs()
    for k in (1, 17, 3000, 150_000, 299_999):
        mask = topk_mask(a, k)
        assert int(mask.sum()) == k
        assert a[mask].min() >= a[~mask].max()


@pytest.mark.parametrize("value_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_value_and_tensor_dtypes(value_dtype: str, dtype: torch.dtype) -> None:
    x = torch.randn(50, 40, generator=torch.Generator().manual_seed(5)).to(dtype)
    enc = TOPK.encode(x, ratio=0.2, value_dtype=value_dtype)
    y = TOPK.decode(enc, BIG)
    assert y.dtype == dtype and y.shape == x.shape
    kept = y != 0
    expected = x[kept].to(getattr(torch, value_dtype)).to(dtype)
    assert torch.equal(y[kept], expected)


def test_float16_values_saturate() -> None:
    x = torch.zeros(100)
    x[3] = 1e6
    x[7] = -1e6
    y = TOPK.decode(TOPK.encode(x, ratio=0.02), BIG)
    assert y[3] == 65504.0 and y[7] == -65504.0


@pytest.mark.parametrize("shape", [(0,), (4, 0), (0, 8)])
@pytest.mark.parametrize("mode", ["global", "row"])
def test_empty_tensors(shape: tuple[int, ...], mode: str) -> None:
    enc = TOPK.encode(torch.zeros(shape), ratio=0.5, mode=mode)
    assert enc.params["k"] == 0 and enc.data == b""
    assert TOPK.decode(enc, BIG).shape == shape


def test_scalar() -> None:
    enc = TOPK.encode(torch.tensor(3.5), ratio=0.1, mode="row")
    y = TOPK.decode(enc, BIG)
    assert y.shape == () and float(y) == 3.5


def test_non_contiguous_input() -> None:
    x = _distinct((64, 48), seed=6).t()
    _check_global(x, 0.1)


def test_through_wire_pack() -> None:
    x = _distinct((16, 128), seed=7)
    enc = TOPK.encode(x, ratio=0.05, mode="row")
    back = decode_tensor(unpack_encoded(pack_encoded(enc)))
    assert torch.equal(back, TOPK.decode(enc, BIG))


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan")])
def test_encode_rejects_bad_ratio(bad: float) -> None:
    with pytest.raises(ValueError):
        TOPK.encode(torch.randn(10), ratio=bad)


def test_encode_rejects_integers_and_unknowns() -> None:
    with pytest.raises(ValueError):
        TOPK.encode(torch.arange(10), ratio=0.5)
    with pytest.raises(ValueError):
        TOPK.encode(torch.randn(10), ratio=0.5, mode="column")
    with pytest.raises(ValueError):
        TOPK.encode(torch.randn(10), ratio=0.5, value_dtype="int8")
    with pytest.raises(ValueError):
        TOPK.encode(torch.randn(10), ratio=0.5, bits=3)


# ------------------------------------------------------------------ validation


def _list_enc(mode: str = "global"):
    """An encoding with a u16 index list (global) or u8 row indices (row)."""
    if mode == "global":
        enc = TOPK.encode(_distinct((1000,), seed=8), ratio=0.01)
        assert enc.params["index"] == "u16"
    else:
        enc = TOPK.encode(_distinct((4, 100), seed=8), ratio=0.05, mode="row")
        assert enc.params["index"] == "u8"
    return enc


def _with_indices(enc, indices: list[int]):
    width, dt = {"u8": (1, "<u1"), "u16": (2, "<u2")}[enc.params["index"]]
    k = enc.params["k"]
    return _rebuild(enc, data=np.asarray(indices, dtype=dt).tobytes() + enc.data[k * width :])


def _indices(enc) -> list[int]:
    width, dt = {"u8": (1, "<u1"), "u16": (2, "<u2")}[enc.params["index"]]
    return np.frombuffer(enc.data[: enc.params["k"] * width], dtype=dt).tolist()


def test_rejects_index_out_of_range() -> None:
    enc = _list_enc()
    idx = _indices(enc)
    idx[-1] = 1000
    with pytest.raises(ProtocolError, match="out of range"):
        TOPK.decode(_with_indices(enc, idx), BIG)


def test_rejects_duplicate_indices() -> None:
    enc = _list_enc()
    idx = _indices(enc)
    idx[3] = idx[2]
    with pytest.raises(ProtocolError, match="strictly increasing"):
        TOPK.decode(_with_indices(enc, idx), BIG)


def test_rejects_unsorted_indices() -> None:
    enc = _list_enc()
    idx = _indices(enc)
    idx[2], idx[3] = idx[3], idx[2]
    with pytest.raises(ProtocolError, match="strictly increasing"):
        TOPK.decode(_with_indices(enc, idx), BIG)


def test_rejects_row_index_out_of_row_and_row_duplicates() -> None:
    enc = _list_enc("row")
    idx = _indices(enc)
    idx[4] = 100  # row_len is 100
    with pytest.raises(ProtocolError, match="out of range"):
        TOPK.decode(_with_indices(enc, idx), BIG)
    idx = _indices(enc)
    idx[6] = idx[5]  # k_row = 5: elements 5, 6 are in the second row
    with pytest.raises(ProtocolError, match="strictly increasing"):
        TOPK.decode(_with_indices(enc, idx), BIG)


@pytest.mark.parametrize("delta", [-1, 1])
def test_rejects_count_mismatch(delta: int) -> None:
    enc = _list_enc()
    bad = _rebuild(enc, params={**enc.params, "k": enc.params["k"] + delta})
    with pytest.raises(ProtocolError, match="payload"):
        TOPK.decode(bad, BIG)


def test_rejects_k_over_numel_and_bad_row_k() -> None:
    enc = _list_enc()
    with pytest.raises(ProtocolError, match="k="):
        TOPK.decode(_rebuild(enc, params={**enc.params, "k": 1001}), BIG)
    row = _list_enc("row")
    with pytest.raises(ProtocolError, match="rows"):
        TOPK.decode(_rebuild(row, params={**row.params, "k": 21}), BIG)


@pytest.mark.parametrize("ratio", [0.0, -0.5, 1.0001, 2, float("nan"), "0.1", True, None])
def test_rejects_ratio_outside_unit_interval(ratio: object) -> None:
    enc = _list_enc()
    with pytest.raises(ProtocolError, match="ratio"):
        TOPK.decode(_rebuild(enc, params={**enc.params, "ratio": ratio}), BIG)


@pytest.mark.parametrize("cut", [1, 2, 7])
def test_rejects_truncated_payload(cut: int) -> None:
    enc = _list_enc()
    with pytest.raises(ProtocolError, match="payload"):
        TOPK.decode(_rebuild(enc, data=enc.data[:-cut]), BIG)


def test_rejects_trailing_bytes() -> None:
    enc = _list_enc()
    with pytest.raises(ProtocolError, match="payload"):
        TOPK.decode(_rebuild(enc, data=enc.data + b"\x00"), BIG)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("index", "u24", "index encoding"),
        ("index", "delta", "index encoding"),
        ("values", "float8", "value dtype"),
        ("mode", "column", "mode"),
        ("v", 2, "version"),
        ("v", True, "version"),
        ("extra", 1, "unknown keys"),
    ],
)
def test_rejects_bad_params(key: str, value: object, match: str) -> None:
    enc = _list_enc()
    with pytest.raises(ProtocolError, match=match):
        TOPK.decode(_rebuild(enc, params={**enc.params, key: value}), BIG)


def test_rejects_missing_param() -> None:
    enc = _list_enc()
    params = dict(enc.params)
    del params["k"]
    with pytest.raises(ProtocolError):
        TOPK.decode(_rebuild(enc, params=params), BIG)


def test_rejects_row_params_mismatch() -> None:
    row = _list_enc("row")
    with pytest.raises(ProtocolError, match="row_len"):
        TOPK.decode(_rebuild(row, params={**row.params, "row_len": 50}), BIG)
    glob = _list_enc()
    with pytest.raises(ProtocolError, match="row_len"):
        TOPK.decode(_rebuild(glob, params={**glob.params, "row_len": 1000}), BIG)


def test_rejects_over_max_elements_before_reading() -> None:
    enc = _list_enc()
    with pytest.raises(ProtocolError, match="limit"):
        TOPK.decode(enc, 999)
    assert TOPK.decode(enc, 1000).shape == (1000,)


def test_rejects_non_float_dtype_and_foreign_codec() -> None:
    enc = _list_enc()
    with pytest.raises(ProtocolError, match="dtype"):
        TOPK.decode(_rebuild(enc, dtype="int32"), BIG)
    with pytest.raises(ProtocolError, match="codec"):
        TOPK.decode(_rebuild(enc, codec="raw"), BIG)


def _bitmap_enc(mode: str = "global"):
    if mode == "global":
        enc = TOPK.encode(_distinct((1001,), seed=9), ratio=0.2)  # 1001 bits: 7 padding bits
    else:
        enc = TOPK.encode(_distinct((4, 100), seed=9), ratio=0.5, mode="row")
    assert enc.params["index"] == "bitmap"
    return enc


def test_rejects_bitmap_popcount_mismatch() -> None:
    enc = _bitmap_enc()
    data = bytearray(enc.data)
    # clear one set bit: popcount becomes k - 1
    first = next(i for i, b in enumerate(data) if b)
    data[first] &= data[first] - 1
    with pytest.raises(ProtocolError, match="bits set"):
        TOPK.decode(_rebuild(enc, data=bytes(data)), BIG)


def test_rejects_bitmap_padding_bits() -> None:
    enc = _bitmap_enc()
    data = bytearray(enc.data)
    data[125] |= 0x80  # bit 1007 > 1000: past the last element
    with pytest.raises(ProtocolError, match="past the last"):
        TOPK.decode(_rebuild(enc, data=bytes(data)), BIG)


def test_rejects_row_bitmap_with_uneven_rows() -> None:
    enc = _bitmap_enc("row")
    bits = np.unpackbits(np.frombuffer(enc.data[:50], dtype=np.uint8), bitorder="little")
    row0_on = int(np.flatnonzero(bits[:100])[0])
    row1_off = 100 + int(np.flatnonzero(bits[100:200] == 0)[0])
    bits[row0_on], bits[row1_off] = 0, 1  # same popcount, rows 49 and 51
    data = np.packbits(bits, bitorder="little").tobytes() + enc.data[50:]
    with pytest.raises(ProtocolError, match="every row"):
        TOPK.decode(_rebuild(enc, data=data), BIG)


def test_wire_decode_tensor_wraps_topk_errors() -> None:
    enc = _list_enc()
    packed = pack_encoded(_rebuild(enc, data=enc.data[:-1]))
    with pytest.raises(ProtocolError):
        decode_tensor(unpack_encoded(packed))


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 6),
    row_len=st.integers(1, 300),
    ratio=st.floats(0.001, 1.0),
    mode=st.sampled_from(["global", "row"]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(rows: int, row_len: int, ratio: float, mode: str, seed: int) -> None:
    x = torch.randn(rows, row_len, generator=torch.Generator().manual_seed(seed))
    enc = TOPK.encode(x, ratio=ratio, mode=mode)
    y = decode_tensor(unpack_encoded(pack_encoded(enc)))
    kept = y != 0
    assert int(kept.sum()) == enc.params["k"]
    assert torch.equal(y[kept], x[kept].half().float())
    if mode == "row" and rows:
        per_row = kept.sum(dim=1)
        assert bool((per_row == keep_count(row_len, ratio)).all())
        # every kept element is at least as large as every dropped one in its row
        big = torch.where(kept, x.abs(), torch.inf).min(dim=1).values
        small = torch.where(kept, -torch.inf, x.abs()).max(dim=1).values
        assert bool((big >= small).all())
    elif rows:
        assert x.abs()[kept].min() >= (x.abs()[~kept].max() if (~kept).any() else 0)


# ------------------------------------------------------------------ centered


@pytest.mark.parametrize("mode", ["global", "row"])
def test_centered_round_trip(mode: str) -> None:
    gen = torch.Generator().manual_seed(10)
    offset = torch.linspace(-3, 3, 32)  # a per-channel offset, as in a residual stream
    x = torch.randn(6, 20, 32, generator=gen) * 0.5 + offset
    enc = TOPK.encode(x, ratio=0.1, mode=mode, value_dtype="float32", center=True)
    assert enc.params["center"] == 1
    row_len = 32 if mode == "row" else None
    assert len(enc.data) == payload_bytes(x.numel(), 0.1, "float32", row_len, center_channels=32)
    y = TOPK.decode(enc, BIG)
    mean = x.reshape(-1, 32).mean(0)
    delta = x - mean
    kept = (y - mean).abs() > 0
    assert int(kept.sum()) == enc.params["k"]
    torch.testing.assert_close(y[kept], x[kept], rtol=0, atol=1e-5)
    torch.testing.assert_close(y[~kept], mean.expand_as(x)[~kept], rtol=0, atol=1e-6)
    # the kept set is the top-k of the centered tensor, and centering beats plain top-k here
    assert delta.abs()[kept].min() >= delta.abs()[~kept].max() if mode == "global" else True
    plain = TOPK.decode(TOPK.encode(x, ratio=0.1, mode=mode, value_dtype="float32"), BIG)
    assert (y - x).norm() < 0.8 * (plain - x).norm()


def test_centered_empty_and_scalar() -> None:
    enc = TOPK.encode(torch.zeros(0, 4), ratio=0.5, center=True)
    assert len(enc.data) == 4 * 2  # the four channel means, nothing else
    assert TOPK.decode(enc, BIG).shape == (0, 4)
    with pytest.raises(ValueError):
        TOPK.encode(torch.tensor(1.0), ratio=0.5, center=True)


@pytest.mark.parametrize("center", [2, -1, True, "1", 1.0])
def test_rejects_bad_center(center: object) -> None:
    enc = TOPK.encode(torch.randn(4, 8), ratio=0.25, center=True)
    with pytest.raises(ProtocolError, match="center"):
        TOPK.decode(_rebuild(enc, params={**enc.params, "center": center}), BIG)


def test_rejects_centered_payload_without_center_section() -> None:
    enc = TOPK.encode(torch.randn(4, 8), ratio=0.25, center=True)
    params = {k: v for k, v in enc.params.items() if k != "center"}
    with pytest.raises(ProtocolError, match="payload"):
        TOPK.decode(_rebuild(enc, params=params), BIG)
