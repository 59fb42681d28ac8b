"""The checks' recompute on a verifier peer (`train --verifier PEER_ID`, train/verifier_peer.py), in
memory (tests/memnet.py: real frames and mailboxes): a 1% liar is caught through the verifier, whose
check process judged the audits; a verifier that is down, or that does not serve checks, is replaced by
the driver's own check process with a `verifier_down` notice, and the liar is caught all the same."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from test_components import Swarm, small_spec

from fusionnode.errors import ConfigError
from fusionnode.runtime.hooks import PacingHook
from fusionnode.train.verifier_peer import VerifierService, check_verifier, param_messages
from fusionnode.verify.liar import DEBUG_LIE_FILE
from fusionnode.wire import job as jp
from fusionnode.wire.job import ErrorCode, JobError, TensorKind

VERIFIER = "QmVerifier0xxxxxxxxxxxxxxxx"


def _swarm(tmp_path, serve: bool = True) -> tuple[Swarm, VerifierService]:
    s = Swarm(tmp_path, workers=3, hosts=1)
    service = VerifierService(s.net.join(VERIFIER), serve=serve, allow=s.ids[:1])  # the driver only
    return s, service


def _lie(s: Swarm, tmp_path, peer: str) -> None:
    """`peer` scales what it sends by 1% from its first step (the debug hook's liar)."""
    d = tmp_path / f"hook-{peer[:10]}"
    d.mkdir()
    (d / DEBUG_LIE_FILE).write_text(json.dumps({"kind": "scale", "factor": 1.01}))
    s.workers[peer].hook = PacingHook(d)


def _params(s: Swarm, verifier: str | None, steps: int = 4) -> dict:
    spec = small_spec(steps=steps, grad_clip=1.0, micro_batches=2)
    return {
        "spec": spec.to_dict(),
        "stages": 2,
        "offload": "on",
        "peers": s.ids[:3],
        "verify_policy": "all",
        "rebalance_every": 0,
        "verifier": verifier,
    }


def _check_fields(**over) -> dict:
    """The fields of a `verify.check` for one chunk and one parameter message (`over` replaces some)."""
    base = dict(
        job="j", stage=0, step=0, ticket=0, chunks=1, params=1, assignment={}, commit={}, listed={},
        src="x", mbs=[0], grads=False, losses=[], micro_batches=2, rel_tol=1e-3, wait_s=0.2,
    )  # fmt: skip
    return {**base, **over}


def _caught(s: Swarm) -> list[str]:
    return [e["peer"] for e in s.events if e["type"] == "event" and e["kind"] == "caught"]


def _notices(s: Swarm) -> list[dict]:
    return [e for e in s.events if e["type"] == "event" and e.get("what") == "verifier_down"]


def test_a_liar_is_caught_through_the_verifier_peer(tmp_path):
    s, service = _swarm(tmp_path)
    liar = s.ids[1]  # not the driver's own peer (ids[0]): it holds a stage of the first plan
    _lie(s, tmp_path, liar)
    result = asyncio.run(s.driver.run_job(_params(s, VERIFIER), s.emit))
    assert _caught(s) == [liar]
    totals = result["verify"]["verifier"]
    assert totals["peer"] == VERIFIER and totals["remote"] > 0
    assert totals["fallback"] == 0 and totals["failures"] == 0 and not _notices(s)
    # the verifier judged them: its service answered every check the driver sent it
    assert service.checked == totals["remote"] and service.held_bytes == 0 and not service.held
    assert result["steps"] == 4 and liar not in [st["peer"] for st in result["stages"]]


def test_an_honest_run_through_the_verifier_bans_nobody(tmp_path):
    s, service = _swarm(tmp_path)
    result = asyncio.run(s.driver.run_job(_params(s, VERIFIER, steps=3), s.emit))
    assert _caught(s) == [] and result["verify"]["caught"] == 0
    assert result["verify"]["checked"] == 3 * 2 * 2  # every micro-batch of both stages
    assert service.checked == result["verify"]["verifier"]["remote"] == 3 * 2  # a check per stage-step


@pytest.mark.parametrize("how", ["down", "refuses"])
def test_a_verifier_that_is_down_or_refuses_falls_back_to_the_check_process(tmp_path, how):
    s, service = _swarm(tmp_path, serve=how != "down")
    if how == "down":
        s.net.down.add(VERIFIER)
    else:
        service.serve = False
    liar = s.ids[1]
    _lie(s, tmp_path, liar)
    result = asyncio.run(s.driver.run_job(_params(s, VERIFIER), s.emit))
    assert _caught(s) == [liar]  # by the driver's own check process
    totals = result["verify"]["verifier"]
    assert totals["remote"] == 0 and totals["fallback"] > 0 and totals["failures"] >= 1
    notices = _notices(s)
    assert len(notices) == 1 and VERIFIER[:12] in notices[0]["reason"]  # warned once per outage
    if how == "refuses":
        assert "serve checks" in notices[0]["reason"] and service.dropped > 0
    assert result["steps"] == 4


def test_a_hung_verifier_does_not_hold_the_job(tmp_path, monkeypatch):
    """A verifier that takes every check and never answers: once a step waits for its checks (past
    MAX_LAG steps, or at the job's end) each call in flight gets HURRY_S more, then the driver's check
    process judges it; the verifier's own deadline (600 s here) never comes into it."""
    from fusionnode.train import verifier_peer

    monkeypatch.setattr(verifier_peer, "REMOTE_DEADLINE_S", 600.0)
    s, _service = _swarm(tmp_path)
    hung: list[int] = []

    async def never(args, sender):
        hung.append(args["ticket"])
        await asyncio.sleep(3600)

    s.net.peers[VERIFIER]._rpc[jp.Rpc.VERIFY_CHECK] = never
    liar = s.ids[1]
    _lie(s, tmp_path, liar)
    result = asyncio.run(s.driver.run_job(_params(s, VERIFIER, steps=3), s.emit))
    assert _caught(s) == [liar] and hung  # the fallback caught it
    totals = result["verify"]["verifier"]
    assert totals["remote"] == 0 and totals["fallback"] > 0 and totals["failures"] >= 1
    assert "once a step waited" in _notices(s)[0]["reason"]


def test_verify_check_refuses_bad_requests_and_missing_messages(tmp_path):
    s, service = _swarm(tmp_path)
    driver = s.net.peers[s.ids[0]]
    base = _check_fields(ticket=7, wait_s=0.2)
    for bad in ({"chunks": 0}, {"params": -1}, {"mbs": [2]}, {"rel_tol": 0.0}, {"wait_s": 601.0}):
        with pytest.raises(JobError) as e:
            jp.VerifyCheck(**{**base, **bad})
        assert e.value.code == ErrorCode.BAD_REQUEST

    async def main():
        # the parameters arrived, the audit's chunk did not: deadline, and nothing is kept
        for msg in param_messages("j", 7, 0, 1, {"w": torch.ones(3)}):
            await driver.send(VERIFIER, msg)
        with pytest.raises(JobError) as e:
            await jp.call(driver, VERIFIER, jp.Rpc.VERIFY_CHECK, jp.VerifyCheck(**base))
        assert e.value.code == ErrorCode.DEADLINE and "1 of its 2 messages" in str(e.value)
        assert service.held_bytes == 0 and not service.held
        # the chunks come first: a parameter message where a chunk belongs is refused
        for first in (0, 1):
            (msg,) = param_messages("j", 8, 0, first, {"w": torch.ones(3), "v": torch.ones(2)})
            assert msg.kind == TensorKind.VERIFY_PARAMS and msg.meta["mb"] == first
            await driver.send(VERIFIER, msg)
        with pytest.raises(JobError) as e:
            await jp.call(driver, VERIFIER, jp.Rpc.VERIFY_CHECK, jp.VerifyCheck(**{**base, "ticket": 8}))
        assert e.value.code == ErrorCode.BAD_REQUEST and "chunks come first" in str(e.value)
        assert service.held_bytes == 0 and not service.held

    asyncio.run(main())


def test_a_verifier_over_its_byte_budget_answers_no_room_at_once(tmp_path, monkeypatch):
    from fusionnode.train import verifier_peer

    monkeypatch.setattr(verifier_peer, "HELD_BYTES", 100)  # bytes of unjudged checks' messages
    s, service = _swarm(tmp_path)
    driver = s.net.peers[s.ids[0]]
    base = _check_fields(ticket=9, wait_s=600.0)

    async def main():
        (msg,) = param_messages("j", 9, 0, 1, {"w": torch.ones(64)})  # 256 bytes
        await driver.send(VERIFIER, msg)
        assert service.dropped == 1 and service.held_bytes == 0
        with pytest.raises(JobError) as e:  # not after wait_s (600 s): the test would time out
            await jp.call(driver, VERIFIER, jp.Rpc.VERIFY_CHECK, jp.VerifyCheck(**base))
        assert e.value.code == ErrorCode.NO_ROOM

    asyncio.run(main())


def test_verifier_option_words():
    assert check_verifier(None) is None and check_verifier("local") == "local"
    assert check_verifier(VERIFIER) == VERIFIER
    for bad in ("", "peer one", "x" * 8, "Qm/../x" * 4):
        with pytest.raises(ConfigError):
            check_verifier(bad)
