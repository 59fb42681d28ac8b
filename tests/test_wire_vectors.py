"""Golden vectors (protocol/vectors/*.json): decode, compare with the stated meaning, re-encode byte for byte."""

from __future__ import annotations

import importlib
import importlib.util
import json
import pathlib
import pkgutil

import pytest
import torch

from fusionnode.wire import (
    decode_message,
    decode_tensor,
    encode_message,
    encode_tensor,
    pack_encoded,
    unpack_encoded,
)
from fusionnode.wire.frames import FLAG_CRC32
from fusionnode.wire.vectors import message_json, tensor_json

torch.set_num_threads(1)

VECTOR_DIR = pathlib.Path(__file__).resolve().parents[1] / "protocol" / "vectors"
VECTORS = sorted(VECTOR_DIR.glob("*.json"))


def _register_all_codecs() -> None:
    """Codecs other than raw/fp16 register when their module is imported: import all of fusionnode.compress."""
    package = importlib.import_module("fusionnode.compress")
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)


def test_there_are_vectors_of_both_kinds() -> None:
    kinds = [json.loads(p.read_text())["kind"] for p in VECTORS]
    assert kinds.count("message") >= 5 and kinds.count("tensor") >= 10


@pytest.mark.parametrize("path", VECTORS, ids=lambda p: p.stem)
def test_vector(path: pathlib.Path) -> None:
    _register_all_codecs()
    vector = json.loads(path.read_text())
    assert set(vector) >= {"description", "kind", "hex", "decoded"}
    buf = bytes.fromhex(vector["hex"])
    if vector["kind"] == "message":
        msg = decode_message(buf)
        assert message_json(msg) == vector["decoded"]
        assert encode_message(msg, checksum=bool(buf[7] & FLAG_CRC32)) == buf
    else:
        assert vector["kind"] == "tensor"
        enc = unpack_encoded(buf)
        assert tensor_json(enc) == vector["decoded"]
        assert pack_encoded(enc) == buf
        if enc.codec in ("raw", "fp16"):
            # the encoder itself reproduces the vector from the decoded tensor (fp16 values are exact in fp16)

            assert pack_encoded(encode_tensor(decode_tensor(enc), enc.codec)) == buf


def test_generator_is_deterministic_and_files_are_current() -> None:
    spec = importlib.util.spec_from_file_location("fusionnode_vector_generate", VECTOR_DIR / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    first, second = module.build_vectors(), module.build_vectors()
    assert first == second
    for name, vector in first.items():
        assert not name.startswith("topk_")
        assert (VECTOR_DIR / f"{name}.json").read_text() == module.render(vector), f"{name}.json is stale"
