"""What the driver does with a stage's audit once its messages arrived: off the driver's process.

An audit is the kept messages of a stage's checked micro-batches (and, for a gradient check, the
parameter gradients it pushed), as encoded on the wire. Judging it (`judge_audit`) means: every
shown message must match the commitment the stage made in its report (BLAKE3 of the encoded
tensors), the gradients must match what the optimizer hosts received, then the micro-batches are
recomputed and compared (verifier.check_stage_work). All of that is CPU work the driver's process
need not do: `AuditJob` carries it, as plain bytes and one flat buffer of parameters (one
shared-memory segment instead of one per tensor when it crosses to the check process), to the
daemon's low-priority check process (train/checks.py), or to a thread when there is none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fusionnode.verify.commitment import digest_encoded, digest_tensors
from fusionnode.verify.ledger import GRADS, unpack_audit
from fusionnode.wire.codec_api import EncodedTensor

SENT = "sent:"  # a part's key prefix for the encoded form of the message it sent ("sent:out", "sent:gout")
PackedTensors = tuple[torch.Tensor, list[tuple[str, torch.dtype, tuple[int, ...], int, int]]]


ALIGN = 16  # bytes: each tensor's offset in a packed buffer (a view as any dtype needs its alignment)


def pack_tensors(
    tensors: Mapping[str, torch.Tensor | bytes | memoryview],
    alloc: Callable[[int], torch.Tensor] | None = None,
) -> PackedTensors:
    """The tensors as one flat byte buffer and an index (name, dtype, shape, offset, bytes): one
    storage to share with another process (torch shares each storage as its own segment). A value
    that is bytes (or a contiguous memoryview) is packed as a uint8 tensor of its bytes.
    `alloc(n)`: a uint8 buffer of at least n bytes to pack into (say one kept in shared memory, so
    handing it over does not make a new segment each time); default a new one."""
    index = []
    offset = 0
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            size, dtype, shape = t.numel() * t.element_size(), t.dtype, tuple(t.shape)
        else:
            size = memoryview(t).nbytes
            dtype, shape = torch.uint8, (size,)
        index.append((name, dtype, shape, offset, size))
        offset += size + (-size % ALIGN)
    buf = torch.empty(offset, dtype=torch.uint8) if alloc is None else alloc(offset)[:offset]
    for (_name, _dtype, _shape, start, size), t in zip(index, tensors.values(), strict=True):
        if not size:
            continue
        if isinstance(t, torch.Tensor):
            buf[start : start + size].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        else:  # numpy reads a read-only buffer without a copy (torch.frombuffer would warn)
            buf[start : start + size].numpy()[:] = np.frombuffer(memoryview(t).cast("B"), dtype=np.uint8)
    return buf, index


def unpack_tensors(packed: PackedTensors) -> dict[str, torch.Tensor]:
    """`pack_tensors`'s tensors again: views of its buffer (no copy)."""
    buf, index = packed
    out = {}
    for name, dtype, shape, offset, size in index:
        if size == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = buf[offset : offset + size].view(dtype).reshape(shape)
    return out


def portable(chunks: list[dict[str, EncodedTensor]]) -> list[dict[str, EncodedTensor]]:
    """The audit's chunks with their payloads as bytes (a received frame's memoryviews do not pickle)."""
    return [
        {k: e if isinstance(e.data, bytes) else EncodedTensor(e.dtype, e.shape, e.codec, e.params, bytes(e.data))
         for k, e in chunk.items()}
        for chunk in chunks
    ]  # fmt: skip


PAYLOAD = (
    "\x00payload:"  # the name prefix of an audit payload packed with the parameters (no state-dict name)
)


def split_payloads(
    chunks: list[dict[str, EncodedTensor]],
) -> tuple[list[dict[str, EncodedTensor]], dict[str, bytes | memoryview]]:
    """The audit's chunks without their payloads, and the payloads by name, to pack into the buffer
    that carries the parameters to the check process (`pack_tensors`: one copy into shared memory
    instead of a copy to bytes and another through the pipe); `join_payloads` undoes it."""
    light: list[dict[str, EncodedTensor]] = []
    payloads: dict[str, bytes | memoryview] = {}
    for i, chunk in enumerate(chunks):
        light.append({})
        for key, e in chunk.items():
            payloads[f"{PAYLOAD}{i}:{key}"] = e.data
            light[-1][key] = EncodedTensor(e.dtype, e.shape, e.codec, e.params, b"")
    return light, payloads


def join_payloads(
    chunks: list[dict[str, EncodedTensor]], tensors: Mapping[str, torch.Tensor]
) -> tuple[list[dict[str, EncodedTensor]], dict[str, torch.Tensor]]:
    """(the chunks with their payloads back, as views of the unpacked buffer; the other tensors:
    the parameters). Chunks whose payloads were not split off are returned as they are."""
    rest = {n: t for n, t in tensors.items() if not n.startswith(PAYLOAD)}
    if len(rest) == len(tensors):
        return chunks, rest
    joined = []
    for i, chunk in enumerate(chunks):
        joined.append({})
        for key, e in chunk.items():
            data = memoryview(tensors[f"{PAYLOAD}{i}:{key}"].numpy())
            joined[-1][key] = EncodedTensor(e.dtype, e.shape, e.codec, e.params, data)
    return joined, rest


@dataclass
class AuditJob:
    """One stage's audit of one step, with all that judging it needs (picklable)."""

    a: dict[str, Any]  # the stage (verifier's map of a StageAssignment)
    commit: dict[str, Any]  # its report's commitments
    listed: dict[str, Any]  # the audit reply's parts: mb -> parts shown
    chunks: list[dict[str, EncodedTensor]]  # the audit's tensors (portable)
    src: str  # the peer that sent them
    mbs: list[int]  # micro-batches checked
    grads: bool  # a gradient check (all micro-batches, the parameter gradients shown)
    pushed: dict[str, dict[str, str]] | None  # hosts' digests: contributor -> name -> digest
    losses: list[float]  # the stage's reported losses (last stage)
    m: int  # micro-batches of the step
    rel_tol: float
    step: int
    link: dict[str, Any] | None = None  # the job's link codec: {"compress", "link_options", "job"} (lossy.py)


def examine_audit(job: AuditJob) -> str | tuple[dict[int, dict[str, dict[str, torch.Tensor]]], Any]:
    """The shown tensors against their commitments, decoded: (parts per micro-batch, the shown
    parameter gradients or None), or why the audit is refused."""
    from fusionnode.verify.verifier import decode_shown

    a, commit, listed, mbs = job.a, job.commit, job.listed, job.mbs
    try:
        shown_parts = unpack_audit(job.chunks)
    except ValueError as exc:
        return f"stage {a['stage']} answered the audit with {exc}"
    parts_of: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for mb in mbs:
        want = [p for p in ("in", "target", "gin", "out", "gout") if p in commit["mbs"][mb]]
        if sorted(listed.get(str(mb)) or []) != sorted(want):
            return f"stage {a['stage']} did not show micro-batch {mb}'s {want} (showed {listed.get(str(mb))})"
        parts_of[mb] = {}
        for part in want:
            tensors = shown_parts.get((mb, part), {})
            if digest_encoded(tensors) != commit["mbs"][mb][part]:
                return f"stage {a['stage']} showed a micro-batch {mb} {part!r} other than it committed to"
            parts_of[mb][part] = decode_shown(tensors, None, job.src)
            if part in ("out", "gout"):  # what it sent: compared in its encoded form (verify/lossy.py)
                parts_of[mb][SENT + part] = tensors
    shown: dict[str, torch.Tensor] | None = None
    if job.grads:
        grads_enc = shown_parts.get((-1, GRADS), {})
        trained = set(a["param_specs"]) - set(a.get("frozen") or [])
        if set(grads_enc) != trained:
            return f"stage {a['stage']} did not show its parameter gradients"
        shown = decode_shown(grads_enc, a["param_specs"], a["peer"])
        if "grads" in commit and digest_tensors(shown) != commit["grads"]:  # a round mode (verify/inner.py)
            return f"stage {a['stage']} showed gradients other than it committed to at step {job.step}"
        contributor = (a.get("offload") or {}).get("contributor")
        if job.pushed is not None and contributor is not None:
            mine_pushed = job.pushed.get(contributor, {})
            for name, g in shown.items():
                if mine_pushed.get(name) != digest_tensors({name: g}):
                    return (
                        f"stage {a['stage']} (peer {a['peer'][:12]}…) pushed a gradient of {name!r} other "
                        f"than the one it holds (or none with its commitment) at step {job.step}"
                    )
    return parts_of, shown


def judge_audit(job: AuditJob, mine: Mapping[str, torch.Tensor], module_for: Callable[..., Any]) -> str:
    """'' when the stage's audit matches its commitments and every checked micro-batch its
    recompute with parameters `mine`; else why not. `module_for(a, mine)`: the stage's module with
    `mine` loaded."""
    from fusionnode.errors import FusionNodeError
    from fusionnode.verify.lossy import LinkRules
    from fusionnode.verify.verifier import check_stage_work

    try:
        examined = examine_audit(job)
    except FusionNodeError as exc:  # undecodable or non-finite tensors shown
        return f"verification of stage {job.a['stage']}: {exc}"
    if isinstance(examined, str):
        return examined
    parts_of, shown = examined
    module = module_for(job.a, mine)
    link = job.link or {}
    rules = LinkRules.of(link.get("compress"), link.get("link_options"), link.get("job") or "")
    return check_stage_work(
        module, job.a, mine, parts_of, job.mbs, job.losses, job.m, job.rel_tol, shown, job.step, rules
    )


__all__ = [
    "SENT",
    "AuditJob",
    "examine_audit",
    "join_payloads",
    "judge_audit",
    "pack_tensors",
    "portable",
    "split_payloads",
    "unpack_tensors",
]
