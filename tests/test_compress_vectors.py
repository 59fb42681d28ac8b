"""Golden vectors of protocol/COMPRESSION.md: valid ones decode to their stated meaning, invalid ones are refused."""

from __future__ import annotations

import json
import pathlib

import pytest
from vector_checks import (
    VECTOR_DIR,
    case_id,
    check_generator_current,
    check_invalid,
    check_valid,
    invalid_cases,
)

import fusionnode.compress  # noqa: F401  (registers "topk")

VECTORS = sorted(VECTOR_DIR.glob("topk_*.json"))


def test_vectors_cover_every_index_encoding_and_mode() -> None:
    params = [json.loads(p.read_text())["decoded"]["params"] for p in VECTORS]
    assert {p["index"] for p in params} >= {"u8", "u16", "bitmap"}
    assert {p["mode"] for p in params} == {"global", "row"}
    assert {p["values"] for p in params} >= {"float16", "bfloat16"}


@pytest.mark.parametrize("path", VECTORS, ids=lambda p: p.stem)
def test_valid_vector(path: pathlib.Path) -> None:
    enc = check_valid(path)
    assert enc.codec == "topk"


@pytest.mark.parametrize(("path", "index"), invalid_cases(VECTORS), ids=case_id)
def test_invalid_variant_is_refused(path: pathlib.Path, index: int) -> None:
    check_invalid(path, index)


def test_generator_is_current() -> None:
    check_generator_current("generate_topk.py", VECTORS)
