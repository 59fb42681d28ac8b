"""Commitments: a digest of the tensors a worker sends, made before it can know whether they are checked.

A worker puts the digest of each activation or gradient message it sends into the message's meta
(``DIGEST_KEY``); its receiver recomputes it from the bytes that arrived and refuses a message whose
digest does not match. Both report their digests per micro-batch in the step's report, which reaches
the driver before the driver reveals which micro-batches it checks, so a worker cannot decide to be
honest only on the checked ones: what it sent is bound to what it will have to show.

The digest covers the encoded form (codec, its parameters, dtype, shape, payload bytes) of every
tensor of a message in name order, so it is the same on both ends of a link whatever the codec.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping

import torch

from fusionnode.wire.codec_api import DTYPE_NAMES, EncodedTensor
from fusionnode.wire.tensors import encode_tensor

DIGEST_KEY = "digest"  # in a TensorMessage's meta: hex digest of its tensors
COMMIT_KEY = "commit"  # in a gradient push's meta: true = the host records the digest of what arrived
DIGEST_SIZE = 16  # bytes of BLAKE2b output (128-bit: second preimages are out of reach)


def _update(h: hashlib._Hash, name: str, enc: EncodedTensor) -> None:
    head = f"{name}\x00{enc.codec}\x00{enc.dtype}\x00{list(enc.shape)}\x00{sorted(enc.params.items())}\x00"
    h.update(head.encode())
    data = enc.data
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def digest_encoded(tensors: Mapping[str, EncodedTensor]) -> str:
    """Digest of a message's encoded tensors (what travels on the wire), in name order."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for name in sorted(tensors):
        _update(h, name, tensors[name])
    return h.hexdigest()


def digest_tensors(tensors: Mapping[str, torch.Tensor]) -> str:
    """Digest of plain tensors (a stage's parameters, gradients): the digest of their raw encoding
    (what `digest_encoded` gives for them sent with the raw codec), so equal values on any device
    give the same digest. Hashes a little-endian host's CPU tensors in place, without a copy."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for name in sorted(tensors):
        t = tensors[name].detach()
        if t.device.type != "cpu" or sys.byteorder != "little" or t.dtype not in DTYPE_NAMES:
            _update(h, name, encode_tensor(t.cpu().contiguous(), "raw"))
            continue
        t = t.resolve_conj().resolve_neg().contiguous()
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        _update(h, name, EncodedTensor(DTYPE_NAMES[t.dtype], tuple(int(d) for d in t.shape), "raw", {}, data))
    return h.hexdigest()


def digest_value(value: float) -> str:
    """Digest of a scalar (a micro-batch's loss, reported by the last stage)."""
    return digest_tensors({"value": torch.tensor([float(value)], dtype=torch.float64)})


__all__ = ["COMMIT_KEY", "DIGEST_KEY", "DIGEST_SIZE", "digest_encoded", "digest_tensors", "digest_value"]
