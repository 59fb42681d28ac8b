"""The commitment digest is the one protocol/SPEC.md describes: "b3:" + BLAKE3-128 of the encoded tensors."""

import blake3
import torch

from fusionnode.verify.commitment import digest_encoded, digest_tensors
from fusionnode.wire.tensors import encode_tensor


def test_digest_is_blake3_128_of_the_documented_layout() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    enc = encode_tensor(t, "raw")
    head = f"x\x00{enc.codec}\x00{enc.dtype}\x00{list(enc.shape)}\x00{sorted(enc.params.items())}\x00"
    want = blake3.blake3(head.encode() + len(enc.data).to_bytes(8, "little") + bytes(enc.data))
    assert digest_encoded({"x": enc}) == "b3:" + want.hexdigest(16)
    assert digest_tensors({"x": t}) == "b3:" + want.hexdigest(16)  # plain tensors: their raw encoding
    assert digest_tensors({"x": t + 1e-7}) != "b3:" + want.hexdigest(16)
