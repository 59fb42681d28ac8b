"""Mixed versions with checks on (issue 20; protocol/SPEC.md, section 13.4): an honest peer of an older
version of the checks is never blamed or banned. The driver asks the peers' check capabilities
(`job.ping` with `caps`) before it plans, leaves out those that lack what the job's checks need, or
refuses a job whose named peers lack it, before anything starts; with checks off they are used. A
digest of another algorithm is a `version_skew` (no ban), not a lie. Workers on an in-memory network
(tests/memnet.py: real frames and services, no daemons), as the component tests run them."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
import torch
from test_components import Swarm, small_spec

from fusionnode.compress.link import LinkCompressor, LinkOptions
from fusionnode.errors import ConfigError
from fusionnode.runtime.worker import WorkerService
from fusionnode.train.jobdefaults import job_defaults
from fusionnode.train.rebalance import blame
from fusionnode.verify import compat
from fusionnode.verify.commitment import DIGEST_KEY, check_claim, digest_alg, digest_encoded
from fusionnode.verify.ledger import Ledger
from fusionnode.verify.lossy import LinkRules
from fusionnode.wire.checked import tensor_message
from fusionnode.wire.job import ErrorCode, Failure, JobError, Rpc, TensorKind

OLD = "QmOldPeerxxxxxxxxxxxxxxxxxxxxxxx"


def blake2b_digest(tensors) -> str:
    """The commitment of the versions before the prefix: bare BLAKE2b-128 hex of the same layout."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        enc = tensors[name]
        head = (
            f"{name}\x00{enc.codec}\x00{enc.dtype}\x00{list(enc.shape)}\x00{sorted(enc.params.items())}\x00"
        )
        h.update(head.encode())
        h.update(len(enc.data).to_bytes(8, "little"))
        h.update(enc.data)
    return h.hexdigest()


def act_message(digest=None):
    msg = tensor_message(
        TensorKind.ACT, {"job": "j", "step": 0, "mb": 0, "stage": 1}, {"h": torch.ones(2, 3)}
    )
    if digest is not None:
        msg.meta[DIGEST_KEY] = digest(msg.tensors) if callable(digest) else digest
    return msg


def test_a_bare_blake2b_digest_is_a_version_skew_that_bans_nobody_and_a_b3_mismatch_a_lie():
    good = act_message(digest_encoded)
    assert digest_alg(good.meta[DIGEST_KEY]) == "b3" and good.meta[DIGEST_KEY].startswith("b3:")
    ledger = Ledger(0, [0], "b3:")
    WorkerService._record_received(ledger, TensorKind.ACT, 0, good, OLD)  # honest, same version
    assert ledger.digests[(0, "in")] == good.meta[DIGEST_KEY]

    old = act_message(blake2b_digest)  # an honest older sender
    assert digest_alg(old.meta[DIGEST_KEY]) == ""
    with pytest.raises(JobError, match="version skew") as e:
        WorkerService._record_received(Ledger(0, [0], "b3:"), TensorKind.ACT, 0, old, OLD)
    assert (e.value.code, e.value.blame) == (ErrorCode.VERSION_SKEW, OLD)
    assert "bare (unprefixed) digest" in str(e.value)
    # the driver's recovery: the peer it names leaves the plan, unbanned; the receiver is not failed
    receiver = "QmReceiverxxxxxxxxxxxxxxxxxxxxxx"
    assert blame({receiver: [Failure.of(e.value)]}, [receiver, OLD]) == {OLD: "leave"}

    # a b3 digest that does not match, no digest, or garbage: a lie as before (bad_tensor, blamed)
    for claimed in ("b3:" + "0" * 32, None, "not a digest", 7):
        with pytest.raises(JobError, match="do not match its commitment") as e:
            check_claim(claimed, good.meta[DIGEST_KEY], OLD, "act")
        assert (e.value.code, e.value.blame) == (ErrorCode.BAD_TENSOR, OLD)
    assert blame({receiver: [Failure.of(e.value)]}, [receiver, OLD]) == {OLD: "failure"}
    with pytest.raises(JobError) as e:  # a future algorithm: a skew too
        check_claim("b4:" + "ab" * 16, good.meta[DIGEST_KEY], OLD, "grad")
    assert e.value.code == ErrorCode.VERSION_SKEW and "'b4'" in str(e.value)


def test_link_options_unknown_refused_absent_dither_is_counter_and_the_driver_writes_it():
    with pytest.raises(ConfigError, match=r"unknown link option.*'future_knob'"):
        LinkOptions.from_dict({"future_knob": 1})
    assert LinkOptions.from_wire({}).dither == "counter"  # an older driver's assignment
    assert LinkOptions.from_wire({"dither": "keyed"}).dither == "keyed"
    spec = small_spec(compress="adatopk")
    _spec, params = job_defaults(spec, {"spec": spec.to_dict()}, None, None)
    assert params["link_options"]["dither"] == "keyed"  # written out, for every job
    _spec, params = job_defaults(
        small_spec(compress="none"), {"link_options": {"dither": "counter"}}, None, None
    )
    assert params["link_options"] == {"dither": "counter"}  # the job's own choice stays
    with pytest.raises(ConfigError, match="future_knob"):
        job_defaults(spec, {"link_options": {"future_knob": 1}}, None, None)

    # the reviewer's case: what a link reads from an assignment is what the checker judges by
    x = torch.randn(16, 4096)
    rules = LinkRules.of("topk:0.2", {"dither": "keyed"}, job="j")
    keyed = LinkCompressor("topk:0.2", LinkOptions.from_wire({"dither": "keyed"}), dither_key=("j", 1))
    counted = LinkCompressor("topk:0.2", LinkOptions.from_wire({}), dither_key=("j", 1))
    assert counted.options.dither == "counter"
    a = keyed.encode({"g": x}, 0, "grad", mb=0)["g"]
    b = counted.encode({"g": x}, 0, "grad", mb=0)["g"]
    assert rules.seed((1, 0, 0), "grad", "g") is not None and a.data != b.data


def test_needs_and_lacks():
    assert compat.needs(False, "adatopk", {"dither": "keyed"}) == {}
    assert compat.needs(True, "none", {"dither": "keyed"}) == {"commit": "b3"}
    assert compat.needs(True, "adatopk", {"dither": "keyed"}) == {"commit": "b3", "dither": "keyed"}
    assert compat.needs(True, "adatopk", {"dither": "keyed", "stochastic": False}) == {"commit": "b3"}
    assert compat.host_needs({"commit": "b3", "dither": "keyed"}) == {"commit": "b3"}
    assert compat.lacks(compat.CAPS, {"commit": "b3", "dither": "keyed"}) == []
    assert compat.lacks(compat.LEGACY, {"commit": "b3"}) == ["the commitment hash 'b3' (it has ['b2'])"]
    assert compat.lacks({"commit": ["b3"], "dither": ["counter"]}, {"dither": "keyed"}) == [
        "the q8/q4 dither 'keyed' (it has ['counter'])"
    ]


def older(s: Swarm, pid: str, caps=None) -> None:
    """Makes `pid` advertise the capabilities of an older version: None answers `caps` as a peer from
    before them does (the unknown field refused with bad_request)."""
    s.workers[pid].caps = caps


def test_job_ping_caps_read_an_older_peers_refusal_as_the_old_capabilities(tmp_path):
    s = Swarm(tmp_path, workers=3)
    older(s, s.ids[2])
    older(s, s.ids[1], {"commit": ["b3"], "dither": ["counter"]})
    caps = asyncio.run(compat.peer_caps(s.net.peers[s.ids[0]], s.ids))
    assert caps == {
        s.ids[0]: compat.CAPS,
        s.ids[1]: {"commit": ["b3"], "dither": ["counter"]},
        s.ids[2]: compat.LEGACY,
    }


def events_of(s: Swarm, kind: str) -> list[dict]:
    return [e for e in s.events if e["type"] == "event" and e.get("kind") == kind]


def test_checks_on_leave_an_older_peer_out_unbanned_named_peers_refuse_the_job_checks_off_use_it(tmp_path):
    spec = small_spec(steps=2, grad_clip=1.0, compress="none")
    s = Swarm(tmp_path, workers=3)
    old = s.ids[2]
    older(s, old)
    base = {"spec": spec.to_dict(), "offload": "off", "rebalance_every": 0}

    # checks on, peers from the swarm: the older one is left out before planning, with a notice
    result = asyncio.run(s.driver.run_job({**base, "stages": 2, "verify_policy": "all"}, s.emit))
    assert result["steps"] == spec.steps and old not in [st["peer"] for st in result["stages"]]
    notices = [e for e in events_of(s, "notice") if e.get("what") == "version_skew"]
    assert len(notices) == 1 and old in notices[0]["reason"] and "'b3'" in notices[0]["reason"], notices
    assert not events_of(s, "failure") and not events_of(s, "caught")
    assert not s.driver.book.bans.banned(old, time.monotonic())

    # checks on, the older peer named: refused before anything starts, naming it and what it lacks
    s.events.clear()
    with pytest.raises(ConfigError, match=f"worker peer {old} cannot take part.*commitment hash 'b3'"):
        asyncio.run(s.driver.run_job({**base, "stages": 3, "verify_policy": "all", "peers": s.ids}, s.emit))
    assert not s.workers[old].jobs and not [e for e in s.events if e["type"] == "plan"]

    # checks off: mixed versions work as before, the older peer takes a stage
    s.events.clear()
    result = asyncio.run(s.driver.run_job({**base, "stages": 3, "verify_policy": "off"}, s.emit))
    assert result["steps"] == spec.steps and old in [st["peer"] for st in result["stages"]]
    assert not events_of(s, "failure")


def test_a_peer_sending_bare_blake2b_digests_mid_job_leaves_the_plan_unbanned(tmp_path):
    """A sender of older digests that got into a checked job (its capabilities said otherwise): the
    receiver answers version_skew naming it; the driver re-plans without it, bans nobody, and the
    job finishes on the others."""
    spec = small_spec(steps=3, grad_clip=1.0, compress="none")
    s = Swarm(tmp_path, workers=3, hosts=1)
    old = s.ids[1]
    t = s.net.peers[old]
    send = t.send

    async def old_send(peer, msg, observe=None):
        if msg.kind in (TensorKind.ACT, TensorKind.GRAD) and DIGEST_KEY in msg.meta:
            msg.meta[DIGEST_KEY] = blake2b_digest(msg.tensors)
        return await send(peer, msg, observe=observe)

    t.send = old_send
    params = {"spec": spec.to_dict(), "offload": "on", "rebalance_every": 0, "verify_policy": "all"}
    result = asyncio.run(s.driver.run_job({**params, "stages": 2, "peers": s.ids[:3]}, s.emit))
    assert result["steps"] == spec.steps and old not in [st["peer"] for st in result["stages"]]
    leaves = events_of(s, "leave")
    assert [e["peer"] for e in leaves] == [old] and "version skew" in leaves[0]["reason"], leaves
    assert not events_of(s, "failure") and not events_of(s, "caught")
    assert not s.driver.book.bans.banned(old, time.monotonic())


def test_job_fetch_sends_only_the_fields_an_older_worker_knows_unless_it_asks_for_a_round():
    """An 8b5373f worker refuses a `job.fetch` field it does not know: the new `round` (a time-closed
    checkpoint's error feedback) must be left out of every other fetch, or a new driver's final
    parameter fetch, its checkpoints and its ring moves fail on older workers."""
    from fusionnode.wire.job import FetchRequest

    older = {"job", "stage", "what", "tag"}
    for what in ("params", "grads", "optim", "inner", "feedback"):
        assert set(FetchRequest(job="j", stage=0, what=what).to_wire()) <= older, what
    asked = FetchRequest(job="j", stage=0, what="feedback", round=3).to_wire()
    assert asked["round"] == 3
    assert FetchRequest.from_wire(FetchRequest(job="j", stage=1).to_wire()).round is None


def test_every_worker_older_says_why_and_the_next_job_does_not_inherit_the_notices(tmp_path):
    spec = small_spec(steps=1, grad_clip=1.0, compress="none")
    s = Swarm(tmp_path, workers=2)
    for pid in s.ids:
        older(s, pid)
    base = {"spec": spec.to_dict(), "offload": "off", "rebalance_every": 0, "stages": 2}
    from fusionnode.errors import PlanError

    with pytest.raises(PlanError, match="older check versions"):
        asyncio.run(s.driver.run_job({**base, "verify_policy": "all"}, s.emit))
    s.events.clear()
    result = asyncio.run(s.driver.run_job({**base, "verify_policy": "off"}, s.emit))
    assert result["steps"] == spec.steps
    assert not [e for e in events_of(s, "notice") if e.get("what") == "version_skew"]


def count_pings(s: Swarm) -> dict[str, list[bool]]:
    """peer -> for each `job.ping` it answered without a job (liveness and capabilities, not the
    keep-alive), whether it asked the capabilities; counted at the receiving end of the memnet."""
    seen: dict[str, list[bool]] = {pid: [] for pid in s.ids}
    for pid in s.ids:
        t = s.net.peers[pid]
        served = t._rpc[Rpc.JOB_PING]

        async def counted(args, sender, pid=pid, served=served):
            if "job" not in args:
                seen[pid].append(bool(args.get("caps")))
            return await served(args, sender)

        t._rpc[Rpc.JOB_PING] = counted
    return seen


def test_a_plan_asks_each_peer_its_capabilities_once_in_its_liveness_ping(tmp_path):
    """With checks on a plan looks for optimizer hosts twice (are there any, then which) and for
    workers once, each after a liveness ping: every peer is asked its capabilities once, in that
    ping, so a checked job pings no more than one with checks off. An older peer's refusal of the
    field reads as alive and older: left out with its notice."""
    spec = small_spec(steps=1, grad_clip=1.0, compress="none")
    base = {"spec": spec.to_dict(), "offload": "on", "rebalance_every": 0, "stages": 2}
    pings = {}
    for policy in ("off", "all"):
        s = Swarm(tmp_path / policy, workers=3, hosts=1)
        older(s, s.ids[2])
        seen = count_pings(s)
        result = asyncio.run(s.driver.run_job({**base, "verify_policy": policy}, s.emit))
        assert result["steps"] == spec.steps
        pings[policy] = seen
        skew = [e for e in events_of(s, "notice") if e.get("what") == "version_skew"]
        assert [s.ids[2] in e["reason"] for e in skew] == ([True] if policy == "all" else []), skew
    on, off = pings["all"], pings["off"]
    assert all(v.count(True) == 1 for v in on.values()), on  # asked once each, hosts included
    assert {p: len(v) for p, v in on.items()} == {p: len(v) for p, v in off.items()}, (on, off)
    assert not any(True in v for v in off.values()), off  # checks off: nothing asked


def test_the_capabilities_are_kept_for_one_plan_only(tmp_path):
    """Outside a plan every screen asks; inside one each peer once; a new plan asks afresh (a peer
    may have been upgraded in between)."""
    s = Swarm(tmp_path, workers=2)
    seen = count_pings(s)
    t = s.net.peers[s.ids[0]]

    async def go():
        await compat.peer_caps(t, s.ids)
        await compat.peer_caps(t, s.ids)
        with compat.one_ask_per_plan():
            await compat.peer_caps(t, s.ids)
            with compat.one_ask_per_plan():  # an inner scope is the plan's own
                await compat.ping(t, s.ids[0], ask=True)
            assert await compat.peer_caps(t, s.ids) == dict.fromkeys(s.ids, compat.CAPS)
        with compat.one_ask_per_plan():
            older(s, s.ids[1])
            reply = await compat.ping(t, s.ids[1], ask=True)  # refused: alive, older
            assert reply.alive and reply.caps == compat.LEGACY
            assert (await compat.peer_caps(t, s.ids))[s.ids[1]] == compat.LEGACY

    asyncio.run(go())
    # 2 screens outside a plan, 1 in the first (the inner ping only checks liveness), 1 in the second
    assert seen == {s.ids[0]: [True, True, True, False, True], s.ids[1]: [True] * 4}, seen
