"""Encode and check the tensors of the job's data messages: `tensor_message` builds one of a known
kind (wire/job.py `TensorKind`), `decode_checked` decodes one and refuses a tensor of another name,
dtype or shape than the receiver expects, or with non-finite values, blaming its sender.
"""

from __future__ import annotations

from typing import Any

import torch

from fusionnode.wire.job import ErrorCode, JobError, TensorKind
from fusionnode.wire.messages import TensorMessage
from fusionnode.wire.tensors import decode_tensor, encode_tensor


def tensor_message(
    kind: str,
    meta: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    codec: str = "raw",
    **codec_options: Any,
) -> TensorMessage:
    """A data message of one of `TensorKind.ALL`; float tensors in `codec`, the others raw."""
    if kind not in TensorKind.ALL:
        raise ValueError(f"unknown tensor kind {kind!r} (known: {sorted(TensorKind.ALL)})")
    enc = {}
    for name, t in tensors.items():
        t = t.detach()
        if codec != "raw" and t.is_floating_point():
            enc[name] = encode_tensor(t.cpu(), codec, **codec_options)
        else:
            enc[name] = encode_tensor(t.cpu(), "raw")
    return TensorMessage(kind=kind, meta=meta, tensors=enc)


def decode_checked(
    msg: TensorMessage, expected: dict[str, dict[str, Any]] | None, batch: int | None, sender: str
) -> dict[str, torch.Tensor]:
    """Decodes every tensor, checking exact dtype and shape (where known) and finiteness; a
    `JobError(bad_tensor)` blaming `sender` otherwise."""
    out = {}
    for name, enc in msg.tensors.items():
        if expected is not None:
            spec = expected.get(name)
            if spec is None:
                raise JobError(
                    ErrorCode.BAD_TENSOR,
                    f"peer {sender[:12]}… sent an unexpected tensor {name!r} in {msg.kind!r}",
                    sender,
                )
            want_shape = tuple(spec["shape"]) if batch is None else (batch, *tuple(spec["shape"])[1:])
            if tuple(enc.shape) != want_shape or enc.dtype != spec["dtype"]:
                raise JobError(
                    ErrorCode.BAD_TENSOR,
                    f"peer {sender[:12]}… sent {name!r} as {enc.dtype}{list(enc.shape)}, "
                    f"expected {spec['dtype']}{list(want_shape)}",
                    sender,
                )
        t = decode_tensor(enc)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise JobError(
                ErrorCode.BAD_TENSOR,
                f"peer {sender[:12]}… sent non-finite values in {name!r} ({msg.kind!r})",
                sender,
            )
        out[name] = t
    return out


__all__ = ["decode_checked", "tensor_message"]
