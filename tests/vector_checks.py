"""Checks every tensor-codec golden-vector suite runs (protocol/vectors/*.json and their generators)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from fusionnode.errors import ProtocolError
from fusionnode.wire.codec_api import EncodedTensor
from fusionnode.wire.tensors import decode_tensor, pack_encoded, unpack_encoded
from fusionnode.wire.vectors import tensor_json

VECTOR_DIR = pathlib.Path(__file__).resolve().parents[1] / "protocol" / "vectors"


def invalid_cases(vectors: list[pathlib.Path]) -> list[tuple[pathlib.Path, int]]:
    """(file, index) of every invalid variant in the files: pytest parameters."""
    return [(p, i) for p in vectors for i in range(len(json.loads(p.read_text())["invalid"]))]


def case_id(v: object) -> str:
    return v.stem if isinstance(v, pathlib.Path) else str(v)


def check_valid(path: pathlib.Path) -> EncodedTensor:
    """The vector's bytes decode to its stated meaning and re-encode byte for byte."""
    vector = json.loads(path.read_text())
    buf = bytes.fromhex(vector["hex"])
    enc = unpack_encoded(buf)
    assert tensor_json(enc) == vector["decoded"]
    assert pack_encoded(enc) == buf
    return enc


def check_invalid(path: pathlib.Path, index: int) -> None:
    case = json.loads(path.read_text())["invalid"][index]
    with pytest.raises(ProtocolError):
        decode_tensor(unpack_encoded(bytes.fromhex(case["hex"])))


def check_generator_current(script: str, vectors: list[pathlib.Path]) -> None:
    """The generator is deterministic and the files on disk are what it writes."""
    spec = importlib.util.spec_from_file_location(
        f"fusionnode_{pathlib.Path(script).stem}", VECTOR_DIR / script
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    built = module.build_vectors()
    assert built == module.build_vectors()
    assert sorted(f"{name}.json" for name in built) == [p.name for p in vectors]
    for name, vector in built.items():
        assert (VECTOR_DIR / f"{name}.json").read_text() == module.render(vector), f"{name}.json is stale"
