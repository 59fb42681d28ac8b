"""SparseLoCo's ctopk2 codec and error-feedback accumulator: exact values, round trips, golden vectors."""

from __future__ import annotations

import pathlib

import pytest
import torch
from vector_checks import (
    VECTOR_DIR,
    case_id,
    check_generator_current,
    check_invalid,
    check_valid,
    invalid_cases,
)

import fusionnode.compress  # noqa: F401  (registers "ctopk2")
from fusionnode.compress.pseudograd import (
    CTOPK2,
    ErrorFeedbackAccumulator,
    ctopk2_payload_bytes,
    decode_pseudograd,
    encode_pseudograd,
)
from fusionnode.errors import ProtocolError
from fusionnode.wire.tensors import decode_tensor, pack_encoded, unpack_encoded

torch.set_num_threads(1)
VECTORS = sorted(VECTOR_DIR.glob("ctopk2_*.json"))


def test_hand_computed_values() -> None:
    # chunk [0.5 -4 0.1 2]: keep -4, 2; mean magnitude 3 -> hi = 4, lo = 2
    # chunk [0 -1 3 0.2]: keep -1, 3 -> hi = 3, lo = 1; tail [-0.3 0.05] keeps both: hi 0.3, lo 0.05
    x = torch.tensor([[0.5, -4.0, 0.1, 2.0, 0.0], [-1.0, 3.0, 0.2, -0.3, 0.05]])
    enc = CTOPK2.encode(x, chunk=4, k=2)
    assert enc.params == {"v": 1, "chunk": 4, "k": 2, "index": "u8"}
    assert len(enc.data) == ctopk2_payload_bytes(10, 4, 2) == 3 * 8 + 6 + 2
    expected = torch.tensor([[0.0, -4.0, 0.0, 2.0, 0.0], [-1.0, 3.0, 0.0, -0.3, 0.05]])
    assert torch.equal(CTOPK2.decode(enc, 100), expected)
    # three kept magnitudes 4, 1, 1 (mean 2): hi = 4, lo = 1; the 2-bit level of 1.2 and 0.8 is lo
    y = torch.tensor([4.0, -1.2, 0.8, 0.1])
    assert torch.allclose(
        CTOPK2.decode(CTOPK2.encode(y, chunk=4, k=3), 4), torch.tensor([4.0, -1.0, 1.0, 0.0])
    )


def test_round_trip_keeps_density_and_signs() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 129, generator=g)  # 8 full chunks and a tail of 256
    enc = CTOPK2.encode(x, chunk=4096, k=64)
    assert enc.params["index"] == "u16"
    buf = pack_encoded(enc)
    back = decode_tensor(unpack_encoded(buf))
    n_full, tail = divmod(x.numel(), 4096)
    assert int((back != 0).sum()) == n_full * 64 + min(64, tail)
    kept = back != 0
    assert torch.equal(torch.sign(back[kept]), torch.sign(x[kept]))
    # every kept element is at least as large as every dropped one of its chunk
    flat, kflat = (
        x.reshape(-1)[: n_full * 4096].view(n_full, 4096),
        kept.reshape(-1)[: n_full * 4096].view(n_full, 4096),
    )
    for row, k in zip(flat, kflat, strict=True):
        assert row[k].abs().min() >= row[~k].abs().max()
    # full chunks of 4096 at density 1/64: 152 bytes instead of 16384 (about 108x)
    assert ctopk2_payload_bytes(8 * 4096, 4096, 64) == 8 * 152


def test_selection_is_the_stable_sorts_top_k() -> None:
    # the encoder's top-k (no sort) keeps what a stable descending sort keeps: ties to the lower index
    from fusionnode.compress.pseudograd import _select

    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(-3, 4, (64, 37), generator=gen).float()  # many ties, zeros, signs
    for k in (1, 5, 20, 36, 37):
        order = torch.sort(rows.abs(), dim=1, descending=True, stable=True).indices[:, :k]
        idx, vals = _select(rows, k)
        assert torch.equal(idx, order.sort(dim=1).values)
        assert torch.equal(vals, rows.gather(1, idx))


def test_equal_magnitudes_decode() -> None:
    # seven kept values of 0.1: their float32 mean rounds above 0.1, so none is "high"; the encoder
    # must still write lo <= hi (it wrote hi = 0 and the decoder refused its own peer's message)
    x = torch.zeros(256)
    x[:7] = 0.1
    enc = CTOPK2.encode(x, chunk=256, k=7)
    out = CTOPK2.decode(enc, 256)
    assert torch.equal(out != 0, x != 0)
    assert torch.allclose(out, x, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("shape", "chunk", "k"),
    [((3, 700), 256, 16), ((1000,), 64, 5), ((5,), 256, 16), ((0,), 8, 2), ((512,), 256, 256)],
)
def test_encoded_value_is_the_decoders_bit_for_bit(shape, chunk, k) -> None:
    # the error feedback subtracts what the encoder says it sent, without parsing its own payload:
    # it must be exactly what every receiver decodes (ties, equal magnitudes, a short tail chunk)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g)
    if x.numel() > 20:
        x.view(-1)[:20] = 0.25  # ties and equal kept magnitudes
        x.view(-1)[20:25] = -0.25
    enc, dense = CTOPK2.encode_decoded(x, chunk=chunk, k=k)
    assert enc == CTOPK2.encode(x, chunk=chunk, k=k)
    decoded = CTOPK2.decode(enc, max(1, x.numel()))
    assert dense.dtype == decoded.dtype == torch.float32 and dense.shape == decoded.shape == x.shape
    assert torch.equal(dense, decoded)


def test_encode_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        CTOPK2.encode(torch.tensor([1.0, float("nan")]), chunk=2, k=1)
    with pytest.raises(ValueError, match="k must"):
        CTOPK2.encode(torch.ones(4), chunk=2, k=3)
    with pytest.raises(ValueError, match="floating"):
        CTOPK2.encode(torch.ones(4, dtype=torch.int32), chunk=2, k=1)


def test_error_feedback_hand_computed() -> None:
    # e1 = Δ1 = [3, 1, -2, 0.5]; k=1 of chunk 4 sends 3 at index 0 -> e = [0, 1, -2, 0.5]
    ef = ErrorFeedbackAccumulator(decay=0.5, chunk=4, k=1)
    _, sent = ef.compress("w", torch.tensor([3.0, 1.0, -2.0, 0.5]))
    assert torch.equal(sent, torch.tensor([3.0, 0.0, 0.0, 0.0]))
    assert torch.equal(ef.acc["w"], torch.tensor([0.0, 1.0, -2.0, 0.5]))
    # e2 = 0.5 e + Δ2 = [0, 0.5, -1, 0.25] + [0, 0, -1.5, 0] = [0, 0.5, -2.5, 0.25]: sends -2.5
    enc, sent = ef.compress("w", torch.tensor([0.0, 0.0, -1.5, 0.0]))
    assert torch.equal(sent, torch.tensor([0.0, 0.0, -2.5, 0.0]))
    assert torch.equal(ef.acc["w"], torch.tensor([0.0, 0.5, 0.0, 0.25]))
    assert torch.equal(decode_pseudograd(enc, 4), sent)


def test_int8_pseudograd_is_q8() -> None:
    x = torch.tensor([[1.0, -0.5], [0.0, 0.25]])
    enc = encode_pseudograd(x, "q8")
    assert enc.codec == "q8" and len(enc.data) == 2 * 4 + 4
    assert torch.allclose(decode_pseudograd(enc, 4), x, atol=1 / 127)


def test_decoder_refuses_too_many_elements() -> None:
    enc = CTOPK2.encode(torch.ones(64), chunk=16, k=2)
    with pytest.raises(ProtocolError):
        CTOPK2.decode(enc, 63)


def test_vectors_cover_both_index_widths() -> None:
    assert {check_valid(p).params["index"] for p in VECTORS} == {"u8", "u16"}


@pytest.mark.parametrize("path", VECTORS, ids=lambda p: p.stem)
def test_valid_vector(path: pathlib.Path) -> None:
    enc = check_valid(path)
    assert enc.codec == "ctopk2"
    # the reference encoder reproduces the bytes from the decoded tensor (the values are its levels)
    again = CTOPK2.encode(decode_tensor(enc), chunk=enc.params["chunk"], k=enc.params["k"])
    assert decode_tensor(again).equal(decode_tensor(enc))


@pytest.mark.parametrize(("path", "index"), invalid_cases(VECTORS), ids=case_id)
def test_invalid_variant_is_refused(path: pathlib.Path, index: int) -> None:
    check_invalid(path, index)


def test_generator_is_current() -> None:
    check_generator_current("generate_ctopk2.py", VECTORS)
