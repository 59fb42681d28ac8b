"""Ring all-reduce of a stage's gradients among the replicas that hold the same parameters.

With the optimizer on the workers (``offload off``) and several pipelines, the stages that hold the
same parameters in each pipeline form a ring (`wire/job.py` `AllReduceRing`, protocol/SPEC.md 13.2).
After its backward pass each member scales its flattened gradients by its share of the batch, then:

- reduce-scatter, k - 1 hops: at hop s member i sends segment (i - s) mod k to member i + 1 and adds
  segment (i - s - 1) mod k from member i - 1 to its own; afterwards member i holds the finished sum
  of segment (i + 1) mod k;
- all-gather, k - 1 hops: at hop s member i sends segment (i + 1 - s) mod k and overwrites segment
  (i - s) mod k with what member i - 1 sends.

Each member sends 2 (k - 1) / k of the gradient bytes. Every segment is summed once, in ring order from
its first holder, then copied: all members end with the same bits. Segments travel in chunks of at most
CHUNK_ELEMENTS (large unary messages fail on the P2P streams). `ring_allreduce` takes the send and
receive as functions, so the schedule is tested without a network; `StageRing` binds it to the
transport and turns a lost member into `JobError(ring_broken, blame=member)`; `reduce_stage` runs a
stage's rings on the worker and `allreduce_rings` forms them on the driver.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import torch

from fusionnode.errors import FusionNodeError, PlanError
from fusionnode.wire.checked import decode_checked, tensor_message
from fusionnode.wire.job import AllReduceRing, ErrorCode, JobError, TensorKind, ring_mb

CHUNK_ELEMENTS = 1 << 20  # float32 elements per `allreduce` message (4 MiB)
REDUCE, GATHER = 0, 1  # the two phases

Send = Callable[[int, torch.Tensor], Awaitable[int]]  # (mb, chunk) -> bytes sent to the next member
Recv = Callable[[int, int], Awaitable[torch.Tensor]]  # (mb, numel) -> the chunk from the previous one


def segments(n: int, k: int) -> list[tuple[int, int]]:
    """k contiguous [lo, hi) ranges covering n elements, sizes differing by at most one."""
    base, extra = divmod(n, k)
    out, lo = [], 0
    for j in range(k):
        hi = lo + base + (1 if j < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def pieces(lo: int, hi: int, chunk: int = CHUNK_ELEMENTS) -> list[tuple[int, int]]:
    """[lo, hi) in ranges of at most `chunk` elements (one empty range for an empty segment)."""
    return [(a, min(hi, a + chunk)) for a in range(lo, hi, chunk)] or [(lo, lo)]


def hops(k: int, i: int) -> Iterator[tuple[int, int, int, int]]:
    """Member i's schedule: (phase, hop, segment sent, segment received) in order."""
    for s in range(k - 1):
        yield REDUCE, s, (i - s) % k, (i - s - 1) % k
    for s in range(k - 1):
        yield GATHER, s, (i + 1 - s) % k, (i - s) % k


async def ring_allreduce(
    flat: torch.Tensor, ring_id: int, k: int, i: int, send: Send, recv: Recv, chunk: int = CHUNK_ELEMENTS
) -> int:
    """Sums `flat` (1-D, this member's weighted gradients) over the ring's k members in place;
    returns the bytes this member sent."""
    if k < 2:
        return 0
    segs = segments(flat.numel(), k)
    sent = 0
    for phase, hop, out_seg, in_seg in hops(k, i):
        outgoing = [
            asyncio.ensure_future(send(ring_mb(ring_id, phase, hop, c), flat[a:b].clone()))
            for c, (a, b) in enumerate(pieces(*segs[out_seg], chunk))
        ]

        async def incoming(phase: int = phase, hop: int = hop, in_seg: int = in_seg) -> int:
            for c, (a, b) in enumerate(pieces(*segs[in_seg], chunk)):
                got = await recv(ring_mb(ring_id, phase, hop, c), b - a)
                if phase == REDUCE:
                    flat[a:b].add_(got)
                else:
                    flat[a:b].copy_(got)
            return 0

        tasks = [asyncio.ensure_future(incoming()), *outgoing]
        try:  # the first failure of a send or a receive ends the hop (a lost member is named at once)
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
            sent += sum(t.result() for t in tasks[1:])
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return sent


def flatten(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.detach().reshape(-1).float() for g in grads]) if grads else torch.zeros(0)


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for t in like:
        out.append(flat[at : at + t.numel()].view_as(t))
        at += t.numel()
    return out


class StageRing:
    """One ring as a stage of the job sees it: its position, neighbours, the transport's send and
    the mailbox's receive (bound to the previous member)."""

    def __init__(self, ring: AllReduceRing, stage: int, transport, job: str, timeout_s: float):
        self.ring = ring
        self.k = len(ring.members)
        self.i = ring.member_stages.index(stage)
        self.next_peer = ring.members[(self.i + 1) % self.k]
        self.next_stage = ring.member_stages[(self.i + 1) % self.k]
        self.prev_peer = ring.members[(self.i - 1) % self.k]
        self.prev_stage = ring.member_stages[(self.i - 1) % self.k]
        self.weight = ring.weights[self.i]
        self.stage = stage
        self.t = transport
        self.job = job
        self.timeout_s = timeout_s

    def where(self) -> str:
        return f"all-reduce ring {self.ring.id} (stage {self.stage}, member {self.i} of {self.k})"

    async def run(self, params: dict[str, torch.Tensor], step: int) -> int:
        """Averages the gradients of the ring's parameters with the other members (weighted by their
        batch shares) and writes the result into each parameter's .grad; returns the bytes sent."""
        ps = [params[n] for n in self.ring.names]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
        # off the event loop: a stage's gradients can be hundreds of MB
        flat = await asyncio.to_thread(lambda: flatten(grads).mul_(self.weight))

        async def send(mb: int, chunk: torch.Tensor) -> int:
            meta = {"job": self.job, "step": step, "mb": mb, "stage": self.next_stage}
            try:
                return await self.t.send(
                    self.next_peer, tensor_message(TensorKind.ALLREDUCE, meta, {"g": chunk})
                )
            except (FusionNodeError, OSError, TimeoutError) as exc:
                raise JobError(
                    ErrorCode.RING_BROKEN,
                    f"{self.where()}: sending to {self.next_peer[:12]}… (stage {self.next_stage}) failed: {exc}",
                    self.next_peer,
                ) from None

        async def recv(mb: int, numel: int) -> torch.Tensor:
            key = (TensorKind.ALLREDUCE, self.job, step, mb, self.stage)
            try:
                msg, src = await self.t.mailbox.get(key, self.timeout_s, sender=self.prev_peer)
            except (FusionNodeError, TimeoutError) as exc:
                if isinstance(exc, JobError):
                    raise
                raise JobError(
                    ErrorCode.RING_BROKEN,
                    f"{self.where()}: nothing from {self.prev_peer[:12]}… (stage {self.prev_stage}): {exc}",
                    self.prev_peer,
                ) from None
            got = decode_checked(msg, {"g": {"shape": [numel], "dtype": "float32"}}, None, src)
            if "g" not in got:
                raise JobError(ErrorCode.BAD_TENSOR, f"{self.where()}: an empty chunk from {src[:12]}…", src)
            return got["g"]

        sent = await ring_allreduce(flat, self.ring.id, self.k, self.i, send, recv)

        def write_back() -> None:
            with torch.no_grad():
                for p, g in zip(ps, unflatten(flat, grads), strict=True):
                    if p.grad is not None:  # in place: no second copy of the gradients
                        p.grad.copy_(g)
                    else:
                        p.grad = g.to(device=p.device, dtype=p.dtype).clone()

        await asyncio.to_thread(write_back)
        return sent


async def reduce_stage(sj: Any, step: int, transport: Any, timeout_s: float) -> int:
    """The worker's side: averages stage job `sj`'s gradients over its rings (concurrently); a lost
    member fails the step with `ring_broken` naming it. Returns the bytes sent."""
    if sj.ledger is not None:  # spot-checked: the driver checks the gradients this stage computed
        sj.ledger.own_grads = {
            n: p.grad.detach().clone()
            for r in sj.rings
            for n in r.names
            if (p := sj.params[n]).grad is not None
        }
    rings = [StageRing(r, sj.stage, transport, sj.job, timeout_s) for r in sj.rings]
    tasks = [asyncio.ensure_future(r.run(sj.params, step)) for r in rings]
    try:
        sent = await asyncio.gather(*tasks)
    except BaseException as exc:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(exc, JobError):  # wake this job's other waits: the step cannot finish
            transport.mailbox.fail_job(sj.job, exc)
        raise
    return sum(sent)


def reweigh(sj: Any, weights: list[float] | None) -> list[AllReduceRing]:
    """`job.resize` of a stage: its rings with the pipelines' new batch shares as weights (offload off;
    with hosts there are none to give); a stage of several pipelines without them refuses."""
    if sj.offload is not None:
        if weights is not None:
            raise JobError(ErrorCode.BAD_REQUEST, "ring weights for a stage whose hosts weigh the replicas")
        return sj.rings
    if not sj.rings or weights is None:
        raise JobError(
            ErrorCode.BAD_REQUEST, "a share move of a stage without hosts needs its rings' weights"
        )
    return [dataclasses.replace(r, weights=[float(w) for w in weights]) for r in sj.rings]


def allreduce_rings(
    pipelines: Sequence[Any], params_of: list[list[list[str]]], excluded: set[str]
) -> dict[int, list[dict[str, Any]]]:
    """The driver's side: global stage id -> the all-reduce rings (AllReduceRing.to_wire()) it is a member of: one ring
    per set of stages (one per pipeline) holding the same parameters, members in pipeline order,
    each weighted by its pipeline's share of the batch (`pipelines`: train/state.py Pipeline). Names in `excluded` are not reduced."""
    holders: dict[str, list[tuple[int, str]]] = {}
    for pipe, stage_params in zip(pipelines, params_of, strict=True):
        for i, names in enumerate(stage_params):
            for name in names:
                if name not in excluded:
                    holders.setdefault(name, []).append((pipe.first_stage + i, pipe.peers[i]))
    groups: dict[tuple[tuple[int, str], ...], list[str]] = {}
    for name, hs in holders.items():
        if len(hs) != len(pipelines):
            raise PlanError(f"parameter {name!r} is not held once by every pipeline: {len(hs)} holders")
        groups.setdefault(tuple(hs), []).append(name)
    total = sum(p.samples for p in pipelines)
    weights = [p.samples / total for p in pipelines]
    out: dict[int, list[dict[str, Any]]] = {}
    for rid, (hs, names) in enumerate(sorted(groups.items())):
        ring = AllReduceRing(
            id=rid,
            members=[peer for _, peer in hs],
            member_stages=[stage for stage, _ in hs],
            weights=weights,
            names=sorted(names),
        ).to_wire()
        for stage, _ in hs:
            out.setdefault(stage, []).append(ring)
    return out
