"""SparseLoCo's download without the receiver's own message (optim/rounds.py `own_message`,
`RoundUpdate.nbytes_to`; ROUNDS.md step 4): a replica puts back the message it sent, so it applies
the same bits as a receiver of every message, and the hosts send R·(R − 1) messages, not R·R."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_components import Swarm, round_job, small_spec

from fusionnode.optim.rounds import (
    ReplicaSync,
    RoundCombiner,
    RoundError,
    RoundUpdate,
    encoded_bytes,
    own_message,
    update_tensors,
)
from fusionnode.sync import SyncConfig
from fusionnode.train.replicas import train_local_replicas

torch.set_num_threads(1)
CFG = SyncConfig("sparseloco", inner_steps=1, topk_density=1 / 16, chunk=256)
NAMES = ["a", "b"]


def _round(replicas: int, verdict: list[float] | None = None):
    """A closed round of `replicas` random pseudo-gradients: (the update, each replica's message)."""
    gen = torch.Generator().manual_seed(7)
    host = RoundCombiner(CFG, replicas)
    sent = []
    for r in range(replicas):
        delta = {"a": torch.randn(600, generator=gen), "b": torch.randn(40, 8, generator=gen)}
        sent.append(ReplicaSync(CFG).encode(delta))
        host.add(0, r, 100.0 * (r + 1), sent[r])
    return host, host.close(verdict=verdict), sent


def _without_own(update: RoundUpdate, replica: int, kept: list[str]) -> RoundUpdate:
    """What a host sends `replica` that kept `kept` (ROUNDS.md): its own message without them."""
    out = RoundUpdate(update.round, update.mode, update.outer_lr)
    for (w, encs), r in zip(update.relayed, update.relayed_replicas, strict=True):
        out.relayed.append((w, {n: e for n, e in encs.items() if r != replica or n not in kept}))
    return out


def test_a_replica_rebuilding_its_own_message_applies_the_same_bits() -> None:
    host, update, sent = _round(4)
    full = update_tensors(update, NAMES)
    for r in range(4):
        for kept in (NAMES, ["a"], []):
            got = _without_own(update, r, kept)
            own = got.relayed[r][1]
            got.relayed[r] = (got.relayed[r][0], own_message({n: sent[r][n] for n in kept}, own, NAMES))
            mine = update_tensors(got, NAMES)
            assert all(torch.equal(mine[n], full[n]) for n in NAMES)
    # the hosts' count: every replica gets the other three messages, not its own
    each = [encoded_bytes(m) for m in sent]
    assert host.sent_bytes == sum(update.nbytes() - each[r] for r in range(4))
    assert host.sent_bytes == 3 * sum(each)


def test_a_replica_left_out_of_the_round_gets_every_message() -> None:
    host, update, sent = _round(3, verdict=[1.0, 0.0, 1.0])
    assert update.relayed_replicas == [0, 2]
    each = [encoded_bytes(m) for m in sent]
    assert update.nbytes_to(1) == each[0] + each[2]
    assert update.nbytes_to(0) == each[2]
    assert host.sent_bytes == each[2] + (each[0] + each[2]) + each[0]


def test_an_own_message_that_lacks_or_adds_a_name_is_refused() -> None:
    _host, _update, sent = _round(2)
    with pytest.raises(RoundError, match="lacks or adds"):
        own_message({"a": sent[0]["a"]}, {}, NAMES)  # "b" neither kept nor received
    with pytest.raises(RoundError, match="lacks or adds"):
        own_message(sent[0], {"c": sent[0]["a"]}, NAMES)


def test_the_swarm_sends_no_replica_its_own_message(tmp_path) -> None:
    """2 replicas x 2 stages on the in-memory network: the workers apply the reference's bits, and the
    hosts send each replica only the other replica's message (the reference's count)."""
    sync = SyncConfig("sparseloco", inner_steps=2, topk_density=1 / 16, chunk=256)
    spec = small_spec(steps=4, micro_batches=2)
    s = Swarm(tmp_path, workers=4, hosts=2)
    asyncio.run(s.driver.run_job(round_job(spec, sync), s.emit))
    got = [e["loss"] for e in s.steps()]
    ref = train_local_replicas(spec, sync, replicas=2)
    assert all(abs(a - b) < 1e-3 for a, b in zip(got, ref.losses, strict=True))
    sent = sum(h["sent_bytes"] for h in s.steps()[-1]["optimizer_hosts"])  # the encoded tensors
    # two replicas: each gets the other's message only (every message sent down once, as the
    # reference counts), where relaying every message sent twice that; the one exception is the
    # tied embedding, which the second stage holds but the first sends: that stage gets its
    # replica's message of it (about 4% of the bytes here)
    assert ref.bytes_down == ref.bytes_up
    assert ref.bytes_down < sent < 1.1 * ref.bytes_down
