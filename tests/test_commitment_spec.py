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


def test_the_golden_act_message_carries_the_b3_commitment_of_its_tensors() -> None:
    """protocol/vectors/message_act_commitment.json: the digest in its meta is what a receiver computes
    from the frame's tensors (a self-describing "b3:" digest: SPEC.md 5.4 and 13.4)."""
    import json
    from pathlib import Path

    from fusionnode.verify.commitment import DIGEST_KEY, digest_alg
    from fusionnode.wire import decode_message

    path = Path(__file__).resolve().parents[1] / "protocol" / "vectors" / "message_act_commitment.json"
    msg = decode_message(bytes.fromhex(json.loads(path.read_text())["hex"]))
    claimed = msg.meta[DIGEST_KEY]
    assert digest_alg(claimed) == "b3" and len(claimed) == len("b3:") + 32
    assert digest_encoded(msg.tensors) == claimed
