"""The q8/q4 codecs: accuracy, seeded unbiased stochastic rounding, strict decoding and golden vectors."""

from __future__ import annotations

import json
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

from fusionnode.compress.quant import Q4, Q8, quant_payload_bytes
from fusionnode.errors import ProtocolError
from fusionnode.wire.codec_api import EncodedTensor
from fusionnode.wire.limits import Limits
from fusionnode.wire.tensors import decode_tensor, encode_tensor, pack_encoded, unpack_encoded

torch.set_num_threads(1)

VECTORS = sorted(VECTOR_DIR.glob("q8_*.json"))


def _roundtrip(t: torch.Tensor, codec: str, **options: object) -> tuple[torch.Tensor, int]:
    packed = pack_encoded(encode_tensor(t, codec, **options))
    return decode_tensor(unpack_encoded(packed)), len(packed)


@pytest.mark.parametrize(("codec", "bound"), [("q8", 0.5 / 127), ("q4", 0.5 / 7)])
def test_nearest_rounding_error_is_half_a_step_per_row(codec: str, bound: float) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 64, generator=g) * torch.logspace(-9, 2, 32).view(4, 8, 1)  # tiny to large rows
    y, _ = _roundtrip(x, codec)
    assert y.shape == x.shape and y.dtype == x.dtype
    absmax = x.abs().amax(dim=-1, keepdim=True)
    assert bool(((y - x).abs() <= absmax * bound * 1.0001).all())
    # the row maximum comes back up to float32 rounding of (absmax / Q) * Q
    torch.testing.assert_close(y.abs().amax(dim=-1, keepdim=True), absmax, rtol=1e-6, atol=0.0)


def test_payload_size_is_exact() -> None:
    x = torch.randn(16, 128, 128)
    for codec, per_elem in (("q8", 1.0), ("q4", 0.5)):
        enc = encode_tensor(x, codec)
        assert (
            len(enc.data) == quant_payload_bytes(x.numel(), 128, codec) == 16 * 128 * 4 + x.numel() * per_elem
        )
    assert len(encode_tensor(torch.randn(3, 3), "q4").data) == 3 * 4 + 5  # odd count: one padding nibble


def test_stochastic_rounding_is_seeded_and_unbiased() -> None:
    x = torch.full((2000, 8), 0.3)
    x[:, 0] = 1.0  # absmax 1: 0.3 sits between two q4 levels (2/7 and 3/7)
    a, _ = _roundtrip(x, "q4", seed=7)
    b, _ = _roundtrip(x, "q4", seed=7)
    c, _ = _roundtrip(x, "q4", seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.testing.assert_close(a[:, 1:].unique(), torch.tensor([2 / 7, 3 / 7]))
    assert abs(float(a[:, 1:].mean()) - 0.3) < 0.005  # nearest rounding would give 2/7 = 0.2857
    nearest, _ = _roundtrip(x, "q4")
    assert abs(float(nearest[:, 1:].mean()) - 2 / 7) < 1e-6


def test_encoder_refuses_what_it_cannot_represent() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        Q8.encode(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="floating"):
        Q8.encode(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="unknown"):
        Q8.encode(torch.ones(2), ratio=0.1)


def test_element_limit_is_checked_before_anything_else() -> None:
    enc = EncodedTensor(
        "float32", (1 << 20, 1 << 20), "q8", {"v": 1, "row_len": 1 << 20, "scale": "float32"}, b""
    )
    with pytest.raises(ProtocolError, match="exceeds"):
        Q8.decode(enc, Limits().max_tensor_elements)


def test_vectors_cover_both_codecs_and_scale_dtypes() -> None:
    decoded = [json.loads(p.read_text())["decoded"] for p in VECTORS]
    assert {d["codec"] for d in decoded} == {"q8", "q4"}
    assert {d["params"]["scale"] for d in decoded} == {"float32", "float16"}


@pytest.mark.parametrize("path", VECTORS, ids=lambda p: p.stem)
def test_valid_vector(path: pathlib.Path) -> None:
    check_valid(path)


@pytest.mark.parametrize(("path", "index"), invalid_cases(VECTORS), ids=case_id)
def test_invalid_variant_is_refused(path: pathlib.Path, index: int) -> None:
    check_invalid(path, index)


def test_generator_is_current() -> None:
    check_generator_current("generate_q8.py", VECTORS)


def test_decode_of_q4_rows_matches_codec_object() -> None:
    x = torch.randn(5, 7)
    assert torch.equal(Q4.decode(Q4.encode(x), 100), decode_tensor(encode_tensor(x, "q4")))
