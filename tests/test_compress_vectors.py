"""Golden vectors of protocol/COMPRESSION.md: valid ones decode to their stated meaning, invalid ones are refused."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

import fusionnode.compress  # noqa: F401  (registers "topk")
from fusionnode.errors import ProtocolError
from fusionnode.wire.tensors import decode_tensor, pack_encoded, unpack_encoded
from fusionnode.wire.vectors import tensor_json

VECTOR_DIR = pathlib.Path(__file__).resolve().parents[1] / "protocol" / "vectors"
VECTORS = sorted(VECTOR_DIR.glob("topk_*.json"))


def test_vectors_cover_every_index_encoding_and_mode() -> None:
    params = [json.loads(p.read_text())["decoded"]["params"] for p in VECTORS]
    assert {p["index"] for p in params} >= {"u8", "u16", "bitmap"}
    assert {p["mode"] for p in params} == {"global", "row"}
    assert {p["values"] for p in params} >= {"float16", "bfloat16"}


@pytest.mark.parametrize("path", VECTORS, ids=lambda p: p.stem)
def test_valid_vector(path: pathlib.Path) -> None:
    vector = json.loads(path.read_text())
    buf = bytes.fromhex(vector["hex"])
    enc = unpack_encoded(buf)
    assert enc.codec == "topk"
    assert tensor_json(enc) == vector["decoded"]
    assert pack_encoded(enc) == buf


@pytest.mark.parametrize(
    ("path", "index"),
    [(p, i) for p in VECTORS for i in range(len(json.loads(p.read_text())["invalid"]))],
    ids=lambda v: v.stem if isinstance(v, pathlib.Path) else str(v),
)
def test_invalid_variant_is_refused(path: pathlib.Path, index: int) -> None:
    case = json.loads(path.read_text())["invalid"][index]
    with pytest.raises(ProtocolError):
        decode_tensor(unpack_encoded(bytes.fromhex(case["hex"])))


def test_generator_is_current() -> None:
    spec = importlib.util.spec_from_file_location("fusionnode_topk_vectors", VECTOR_DIR / "generate_topk.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    vectors = module.build_vectors()
    assert vectors == module.build_vectors()
    assert sorted(f"{name}.json" for name in vectors) == [p.name for p in VECTORS]
    for name, vector in vectors.items():
        assert (VECTOR_DIR / f"{name}.json").read_text() == module.render(vector), f"{name}.json is stale"
