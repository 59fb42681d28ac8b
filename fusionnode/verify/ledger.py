"""A worker's record of one step's micro-batches: the messages it received and sent, and their digests.

With verification on, a worker keeps its last two steps' messages (as encoded on the wire: the driver
checks a step while the next one runs), so that the driver can ask for a checked micro-batch's inputs and outputs; the digests
go into the step's report (its commitments). Parts of a micro-batch:

- ``in``: the stage's input (``input`` tokens from the driver or ``act`` from the previous stage),
- ``target``: the last stage's targets,
- ``gin``: the gradients of its outputs, back from the next stage,
- ``out``: the activations it sent on (non-last stages),
- ``gout``: the gradients of its inputs it sent back (non-first stages).
"""

from __future__ import annotations

from typing import Any

from fusionnode.verify.commitment import digest_encoded
from fusionnode.wire.codec_api import EncodedTensor
from fusionnode.wire.job import TensorKind
from fusionnode.wire.messages import TensorMessage

PARTS = ("in", "target", "gin", "out", "gout")
RECEIVED_PART = {
    TensorKind.INPUT: "in",
    TensorKind.ACT: "in",
    TensorKind.TARGET: "target",
    TensorKind.GRAD: "gin",
}
AUDIT_KIND = TensorKind.AUDIT  # the kind of the messages a worker sends back to be checked
AUDIT_MAX_TENSORS = 200  # tensors per audit message (the wire allows 256)
AUDIT_MAX_BYTES = 64 << 20  # payload bytes per audit message (the wire allows 256 MiB frames)
GRADS = "grads"  # the part naming the parameter gradients in an audit


class Ledger:
    """Messages and digests of one step of one stage."""

    def __init__(
        self, step: int, micro_batches: int, params_digest: str, device: str = "cpu", autocast: bool = False
    ) -> None:
        self.step = step
        self.micro_batches = micro_batches
        self.params_digest = params_digest
        self.device = device  # the kind of device the stage computes on (sets the check's tolerance)
        self.autocast = autocast  # whether it computes under bf16 autocast
        self.messages: dict[tuple[int, str], TensorMessage] = {}
        self.digests: dict[tuple[int, str], str] = {}
        # with offload, the parameter gradients pushed to the optimizer hosts (as sent): what a
        # gradient check is shown, even once the next step has begun accumulating new ones
        self.pushed: dict[str, EncodedTensor] = {}
        # offload off, several pipelines: the stage's own gradients before the ring all-reduce averaged
        # them with the other replicas' (runtime/allreduce.py); what `job.audit` shows with grads
        self.own_grads: dict[str, Any] | None = None
        # --sync diloco|sparseloco: the inner step's commitments, "opt" and "grads" (verify/inner.py)
        self.extra: dict[str, str] = {}

    def record(self, mb: int, part: str, msg: TensorMessage, digest: str | None = None) -> str:
        """Keeps `msg` as micro-batch `mb`'s `part`; returns its digest."""
        if part not in PARTS:
            raise ValueError(f"unknown ledger part {part!r}")
        d = digest if digest is not None else digest_encoded(msg.tensors)
        self.messages[(mb, part)] = msg
        self.digests[(mb, part)] = d
        return d

    def commitments(self) -> dict[str, Any]:
        """The report's ``verify`` field: the parameters' digest, each micro-batch's digests, and the
        device kind the stage computes on."""
        mbs: list[dict[str, str]] = [{} for _ in range(self.micro_batches)]
        for (mb, part), d in self.digests.items():
            if 0 <= mb < self.micro_batches:
                mbs[mb][part] = d
        return {
            "params": self.params_digest, "mbs": mbs, "device": self.device, "autocast": self.autocast,
            **self.extra,
        }  # fmt: skip

    def parts(self, mb: int) -> list[str]:
        return [p for p in PARTS if (mb, p) in self.messages]


def pack_audit(
    ledger: Ledger, mbs: list[int], grads: dict[str, EncodedTensor] | None = None
) -> list[dict[str, EncodedTensor]]:
    """The kept messages of `mbs` (and the parameter gradients) as chunks of tensors named
    ``"<mb>/<part>/<name>"`` (``"-1/grads/<name>"``), each chunk within the audit limits."""
    items: list[tuple[str, EncodedTensor]] = []
    for mb in mbs:
        for part in ledger.parts(mb):
            for name, enc in ledger.messages[(mb, part)].tensors.items():
                items.append((f"{mb}/{part}/{name}", enc))
    for name, enc in (grads or {}).items():
        items.append((f"-1/{GRADS}/{name}", enc))
    chunks: list[dict[str, EncodedTensor]] = [{}]
    size = 0
    for key, enc in items:
        if chunks[-1] and (len(chunks[-1]) >= AUDIT_MAX_TENSORS or size + len(enc.data) > AUDIT_MAX_BYTES):
            chunks.append({})
            size = 0
        chunks[-1][key] = enc
        size += len(enc.data)
    return chunks


def unpack_audit(chunks: list[dict[str, EncodedTensor]]) -> dict[tuple[int, str], dict[str, EncodedTensor]]:
    """(mb, part) -> the tensors of that part, from `pack_audit`'s chunks; ValueError on a bad name."""
    out: dict[tuple[int, str], dict[str, EncodedTensor]] = {}
    for chunk in chunks:
        for key, enc in chunk.items():
            mb_text, part, name = [*key.split("/", 2), "", ""][:3]
            if part not in (*PARTS, GRADS) or not name or not mb_text.lstrip("-").isdigit():
                raise ValueError(f"bad audit tensor name {key[:80]!r}")
            out.setdefault((int(mb_text), part), {})[name] = enc
    return out


__all__ = [
    "AUDIT_KIND",
    "AUDIT_MAX_BYTES",
    "AUDIT_MAX_TENSORS",
    "GRADS",
    "PARTS",
    "RECEIVED_PART",
    "Ledger",
    "pack_audit",
    "unpack_audit",
]
