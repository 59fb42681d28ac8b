"""Commitments: a digest of the tensors a worker sends, made before it can know whether they are checked.

A worker puts the digest of each activation or gradient message it sends into the message's meta
(``DIGEST_KEY``); its receiver recomputes it from the bytes that arrived and refuses a message whose
digest does not match. Both report their digests per micro-batch in the step's report, which reaches
the driver before the driver reveals which micro-batches it checks, so a worker cannot decide to be
honest only on the checked ones: what it sent is bound to what it will have to show.

The digest covers the encoded form (codec, its parameters, dtype, shape, payload bytes) of every
tensor of a message in name order, so it is the same on both ends of a link whatever the codec.

The hash is BLAKE3 truncated to 128 bits: every activation and gradient message of a checked step is
hashed by its sender and its receiver, and every pushed gradient by its optimizer host, so the hash's
speed is paid on every micro-batch. On this machine BLAKE3 hashes 3.2 MB (gpt2-tiny's gradients) in
0.43 ms against BLAKE2b's 3.0 ms (one thread; 7.4 vs 1.1 GB/s), and it is as sound a commitment
(a cryptographic hash: neither collisions nor second preimages are within reach at 128 bits).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
from blake3 import blake3

from fusionnode.wire.codec_api import DTYPE_NAMES, EncodedTensor
from fusionnode.wire.tensors import encode_tensor

DIGEST_KEY = "digest"  # in a TensorMessage's meta: hex digest of its tensors
COMMIT_KEY = "commit"  # in a gradient push's meta: true = the host records the digest of what arrived
DIGEST_SIZE = 16  # bytes of BLAKE3 output kept (128-bit: second preimages are out of reach)


def _update(h: Any, name: str, enc: EncodedTensor) -> None:
    head = f"{name}\x00{enc.codec}\x00{enc.dtype}\x00{list(enc.shape)}\x00{sorted(enc.params.items())}\x00"
    h.update(head.encode())
    data = enc.data
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def digest_encoded(tensors: Mapping[str, EncodedTensor]) -> str:
    """Digest of a message's encoded tensors (what travels on the wire), in name order."""
    h = blake3()
    for name in sorted(tensors):
        _update(h, name, tensors[name])
    return h.hexdigest(DIGEST_SIZE)


def digest_tensors(tensors: Mapping[str, torch.Tensor]) -> str:
    """Digest of plain tensors (a stage's parameters, gradients): the digest of their raw encoding
    (what `digest_encoded` gives for them sent with the raw codec), so equal values on any device
    give the same digest. Hashes a little-endian host's CPU tensors in place, without a copy."""
    h = blake3()
    for name in sorted(tensors):
        t = tensors[name].detach()
        if t.device.type != "cpu" or sys.byteorder != "little" or t.dtype not in DTYPE_NAMES:
            _update(h, name, encode_tensor(t.cpu().contiguous(), "raw"))
            continue
        t = t.resolve_conj().resolve_neg().contiguous()
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        _update(h, name, EncodedTensor(DTYPE_NAMES[t.dtype], tuple(int(d) for d in t.shape), "raw", {}, data))
    return h.hexdigest(DIGEST_SIZE)


def digest_value(value: float) -> str:
    """Digest of a scalar (a micro-batch's loss, reported by the last stage)."""
    return digest_tensors({"value": torch.tensor([float(value)], dtype=torch.float64)})


__all__ = ["COMMIT_KEY", "DIGEST_KEY", "DIGEST_SIZE", "digest_encoded", "digest_tensors", "digest_value"]
