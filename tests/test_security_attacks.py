"""The attacks of the adversarial review (issue 17, SECURITY.md "Attacks tried"), each mounted against
the real handlers (real Transports over real p2pd daemons on loopback where it is cheap, the real
stream handlers over socket pairs otherwise) and shown to do no harm, honest work going on."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import time
import tracemalloc

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.multiaddr import Multiaddr
from test_security_swarm import KEY, peers, wait_for

from fusionnode.errors import PeerError, ProtocolError
from fusionnode.optim.host import OptimizerHostService
from fusionnode.runtime.transport import PROTO_DATA, PROTO_RPC, Transport
from fusionnode.runtime.worker import WorkerService
from fusionnode.security import SwarmAuthorizer
from fusionnode.security.auth import NonceCache
from fusionnode.security.limits import MAX_STAGES_PER_DRIVER
from fusionnode.swarm.probe import PROBE_PROTOCOL, LinkProber, ProbeConfig
from fusionnode.train.spec import JobSpec
from fusionnode.wire.checked import tensor_message
from fusionnode.wire.frames import pack_header
from fusionnode.wire.job import MAX_LEASE_S, StageAssignment
from fusionnode.wire.limits import DEFAULT_MAX_ENVELOPE_BYTES
from fusionnode.wire.messages import Call, encode_message

torch.set_num_threads(1)
MiB = 1 << 20


# ------------------------------------------------------------------ 1. optimizer-host checkpoints


async def _shard(driver: Transport, host: str, job: str, init: torch.Tensor, **kw) -> tuple[dict, dict]:
    """opt.init, the parameters, opt.load: what a driver does (kw: secret, resume, resume_step, ...)."""
    spec = JobSpec(optimizer="sgd", lr=0.1, weight_decay=0.0, grad_clip=None, job_id=job)
    load_args = {"job": job, "resume_step": kw.pop("resume_step", None)}
    if load_args["resume_step"] is None:
        del load_args["resume_step"]
    save_dir = kw.pop("save_dir", None)
    if save_dir is not None:  # a driver cannot name where the host writes: the field does not exist
        with pytest.raises(PeerError, match=r"unknown field.*save_dir"):
            await driver.call(host, "opt.init", {"job": job, "driver": driver.peer_id, "save_dir": save_dir})
    res = await driver.call(
        host,
        "opt.init",
        {
            "job": job,
            "driver": driver.peer_id,
            "host_index": 0,
            "spec": spec.to_dict(),
            "param_specs": {"w": {"shape": list(init.shape), "dtype": "float32"}},
            "expected": {"w": {"r0/s0": {"replica": 0, "samples": 1, "peer": driver.peer_id}}},
            "save_every": 1,
            **kw,
        },
    )
    meta = {"job": job, "stage": 0, "step": -1, "mb": 0}
    await driver.send(host, tensor_message("opt_params", meta, {"w": init}))
    return res, await driver.call(host, "opt.load", load_args)


async def _train(driver: Transport, host: str, svc: OptimizerHostService, job: str, steps: range) -> None:
    for step in steps:
        meta = {"job": job, "step": step, "mb": -1, "stage": 0, "contributor": "r0/s0", "samples": 1}
        await driver.send(host, tensor_message("push", meta, {"w": torch.ones(3)}))
        await wait_for(lambda s=step: svc.shards[job].store.ready(s), 5, "a push")
        await driver.call(host, "opt.apply", {"job": job, "step": step, "lr": 0.1})


def _tree(root) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                out[path] = hashlib.sha256(fh.read()).hexdigest()
    return out


def test_another_peer_cannot_take_over_or_push_out_a_finished_jobs_checkpoints(tmp_path):
    """Attack 1: after the owner released its job, a thief claims the same job id with resume (it used
    to get every trained tensor), trains it with `save_dir` outside the host's state directory (it used
    to be written there) and pushes the owner's checkpoints out of the kept three. Now the resume is
    refused, the thief's shards go elsewhere under the state directory, the owner's files are untouched,
    and the owner resumes, from another peer too, with the secret kept in its checkpoint."""
    job, secret = "j-own", "s" * 32
    state, outside = tmp_path / "host-state", tmp_path / "outside"

    async def main():
        async with peers(None, None, None, None) as (h, owner, thief, owner_elsewhere):
            svc = OptimizerHostService(h, state_dir=state, step_deadline_s=5.0)
            await _shard(owner, h.peer_id, job, torch.zeros(3), secret=secret, save_dir=str(outside))
            await _train(owner, h.peer_id, svc, job, range(1, 5))
            trained = svc.shards[job].store.get_params(["w"])[1]["w"].clone()
            await owner.call(h.peer_id, "opt.release", {"job": job})
            before = _tree(state)
            assert len(before) == 2 * 3  # the kept three checkpoints (manifest + tensors each)

            with pytest.raises(PeerError, match="another driver"):  # no secret, or a wrong one
                await _shard(thief, h.peer_id, job, torch.zeros(3), resume=True, save_dir=str(outside))
            with pytest.raises(PeerError, match="another driver"):
                await _shard(thief, h.peer_id, job, torch.zeros(3), resume=True, secret="x" * 32)
            assert job not in svc.shards and job not in svc._pending  # a refused init holds nothing
            res, load = await _shard(
                thief, h.peer_id, job, torch.full((3,), 9.0), save_dir=str(outside), save_every=1
            )
            assert res["steps"] == [] and load["resumed"] == 0
            assert torch.equal(svc.shards[job].store.get_params(["w"])[1]["w"], torch.full((3,), 9.0))
            await _train(thief, h.peer_id, svc, job, range(1, 6))  # five saves of its own
            await thief.call(h.peer_id, "opt.release", {"job": job})
            after = _tree(state)
            assert {p: d for p, d in after.items() if p in before} == before  # owner's files untouched
            assert not outside.exists()  # nothing written outside the host's state directory

            # the owner's identity, or its secret from another peer, resumes the trained shard
            for who in (owner, owner_elsewhere):
                res, load = await _shard(
                    who, h.peer_id, job, torch.zeros(3), secret=secret, resume=True, resume_step=4
                )
                assert res["steps"] == [2, 3, 4] and load["resumed"] == 4
                torch.testing.assert_close(svc.shards[job].store.get_params(["w"])[1]["w"], trained)
                await who.call(h.peer_id, "opt.release", {"job": job})
            manifest = next(p for p in before if p.endswith("manifest.json"))
            with open(manifest, encoding="utf-8") as f:
                assert owner.peer_id in f.read()  # the manifest names the owning driver

    asyncio.run(main())


# ------------------------------------------------------------------ 2. sender-bound data


def test_a_planned_neighbour_cannot_overwrite_a_shards_initial_parameters(tmp_path):
    """Attack 2 over real p2pd: the host accepted a shard's initial parameters from anyone (a later
    message overwrote an earlier one). A worker of the job sends its own "opt_params" for the key
    before and after the driver's: the shard holds the driver's values."""
    job = "j-init"

    async def main():
        async with peers(None, None, None) as (h, driver, worker):
            svc = OptimizerHostService(h, state_dir=tmp_path, step_deadline_s=5.0)
            spec = JobSpec(optimizer="sgd", job_id=job)
            await driver.call(
                h.peer_id,
                "opt.init",
                {
                    "job": job,
                    "driver": driver.peer_id,
                    "host_index": 0,
                    "spec": spec.to_dict(),
                    "param_specs": {"w": {"shape": [3], "dtype": "float32"}},
                    "expected": {"w": {"r0/s0": {"replica": 0, "samples": 1, "peer": worker.peer_id}}},
                },
            )
            meta = {"job": job, "stage": 0, "step": -1, "mb": 0}
            await worker.send(h.peer_id, tensor_message("opt_params", meta, {"w": torch.full((3,), 6.0)}))
            await driver.send(h.peer_id, tensor_message("opt_params", meta, {"w": torch.ones(3)}))
            await worker.send(h.peer_id, tensor_message("opt_params", meta, {"w": torch.full((3,), 6.0)}))
            await wait_for(lambda: h.mailbox.dropped.get(worker.peer_id, 0) >= 1, 5, "a drop")
            await driver.call(h.peer_id, "opt.load", {"job": job})
            assert torch.equal(svc.shards[job].store.get_params(["w"])[1]["w"], torch.ones(3))
            await wait_for(lambda: h.mailbox.dropped[worker.peer_id] == 2, 5, "both counted")
            assert h.security_status()["mailbox"]["dropped"][worker.peer_id] == 2

    asyncio.run(main())


# ------------------------------------------------------------------ 3. headers before the budget


def _info(peer: str, proto: str) -> StreamInfo:
    return StreamInfo(PeerID.from_base58(peer), Multiaddr("/ip4/127.0.0.1/tcp/1"), proto)


async def _feed(handler, info, data: bytes) -> tuple[int, float, int]:
    """Runs a real stream handler on `data` (then EOF); returns (bytes it consumed, seconds, peak bytes
    allocated while it ran)."""
    reader = asyncio.StreamReader(limit=1 << 30)
    reader.feed_data(data)
    reader.feed_eof()
    s1, s2 = socket.socketpair()
    _r, writer = await asyncio.open_connection(sock=s1)
    tracemalloc.start()
    t0 = time.perf_counter()
    await asyncio.wait_for(handler(info, reader, writer), 30)
    dt = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    s2.close()
    return len(data) - len(reader._buffer), dt, peak


def test_an_oversized_header_is_refused_after_the_cap_and_a_dense_one_is_bounded(capsys):
    """Attack 3: an 8 MiB envelope used to be read and decoded (twice, on the event loop) before the
    peer's byte budget was charged: +578 MiB and an 8.4 s stall. Now the header alone refuses it; an
    envelope at the cap made of empty maps stops at max_containers, the budget charged first."""

    async def main():
        async with peers(None, None) as (victim, attacker):
            calls = []

            async def echo(args, sender):
                calls.append(sender)
                return {"ok": True}

            victim.add_rpc("echo", echo)
            info = _info(attacker.peer_id, PROTO_RPC)
            big = 8 * MiB
            frame = pack_header(Call.TYPE, 0, big, big, 0) + b"\x80" * big
            consumed, dt, peak = await _feed(victim._on_rpc_stream, info, frame)
            print(
                f"\n8 MiB header: refused after reading {consumed} bytes, {dt * 1e3:.1f} ms, peak {peak >> 10} KiB"
            )
            assert consumed <= 24 + DEFAULT_MAX_ENVELOPE_BYTES and peak < 4 * MiB

            # under the cap: 15 arrays of 65,535 empty maps each (~70x bigger once decoded)
            inner = b"\xdc\xff\xff" + b"\x80" * 65535
            body = b"\x82\xa6method\xa4echo\xa4args\x81\xa1x\x9f" + inner * 15
            assert len(body) <= DEFAULT_MAX_ENVELOPE_BYTES
            frame = pack_header(Call.TYPE, 0, len(body), len(body), 0) + body
            consumed, dt, peak = await _feed(victim._on_rpc_stream, info, frame)
            assert consumed == len(frame)
            print(f"{len(body) >> 10} KiB of empty maps: refused in {dt * 1e3:.1f} ms, peak {peak >> 20} MiB")
            assert peak < 32 * MiB and calls == []
            assert not victim.peer_limiter.inflight  # the budget was charged and given back

            # over p2pd: the 8 MiB header costs the victim next to nothing and it keeps serving
            _i, reader, writer = await attacker.p2p.call_binary_stream_handler(
                PeerID.from_base58(victim.peer_id), PROTO_RPC
            )
            with contextlib.suppress(ConnectionError):
                writer.write(pack_header(Call.TYPE, 0, big, big, 0))
                writer.write(b"\x80" * big)
                await asyncio.wait_for(reader.read(), 10)  # closed (an error reply, then EOF)
            writer.close()
            t0 = time.monotonic()
            assert (await attacker.call(victim.peer_id, "echo", {}))["ok"]
            print(f"honest call after the attack: {(time.monotonic() - t0) * 1e3:.0f} ms")
            # an honest envelope just under the cap still passes
            blob = "y" * 60_000
            assert (await attacker.call(victim.peer_id, "echo", {f"k{i}": blob for i in range(16)}))["ok"]

    asyncio.run(main())
    print(capsys.readouterr().out)


# ------------------------------------------------------------------ 4. mailbox over p2pd


def test_messages_for_invented_jobs_hold_no_memory():
    """Attack 4 over real p2pd: 100 messages of 4 MiB for invented jobs left 404 MiB held."""

    async def main():
        async with peers(None, None, None) as (victim, flooder, member):
            victim.mailbox.accept("real", "stage", {member.peer_id}, 64 * MiB)
            x = torch.zeros(MiB)  # 4 MiB
            for i in range(100):
                meta = {"job": f"invented-{i}", "step": 0, "mb": 0, "stage": 0}
                await flooder.send(victim.peer_id, tensor_message("act", meta, {"x": x}))
            meta = {"job": "real", "step": 0, "mb": 0, "stage": 0}
            await member.send(victim.peer_id, tensor_message("act", meta, {"x": torch.ones(4)}))
            await wait_for(lambda: victim.mailbox.dropped.get(flooder.peer_id, 0) == 100, 30, "drops")
            msg, _ = await victim.mailbox.get(("act", "real", 0, 0, 0), 5, sender=member.peer_id)
            assert torch.equal(msg.decode_tensors()["x"], torch.ones(4))
            assert victim.mailbox.held_bytes() == 0

    asyncio.run(main())


# ------------------------------------------------------------------ 5. job.assign


def _description(buffer_shape: list[int]) -> dict:
    from fusionnode.graph import portable

    return {
        "format": portable.FORMAT,
        "version": portable.VERSION,
        "inputs": ["x"],
        "outputs": ["y"],
        "params": {},
        "buffers": {"b": {"shape": buffer_shape, "dtype": "float32"}},
        "nodes": [
            {
                "name": "y",
                "op": "call_function",
                "target": "operator.pow",
                "args": [3, 4_000_000],
                "kwargs": {},
            }
        ],
    }


def test_job_assign_checks_need_lease_and_stages_per_driver(tmp_path):
    """Attack 5: a negative need, a 1e12 s lease and 1,001 stages from one stranger were accepted; a
    declared 512 MiB buffer was allocated before the state check; operator.pow(3, 4_000_000) stalled."""
    from types import SimpleNamespace

    from fusionnode.runtime.stage import StageModule

    async def main():
        async with peers(None, None) as (w, stranger):
            svc = WorkerService(
                w, capacity_bytes=256 * MiB, config=SimpleNamespace(lease_s=60.0, step_timeout_s=5.0)
            )
            base = {
                "job": "j",
                "driver": stranger.peer_id,
                "num_stages": 1,
                "description": _description([4]),
                "param_specs": {},
                "spec": JobSpec().to_dict(),
            }
            for bad, why in (
                ({"need_bytes": -(1 << 40)}, "non-negative"),
                ({"lease_s": 1e12}, "lease_s"),
                ({"lease_s": float("nan")}, "lease_s"),
                ({"description": _description([128, MiB])}, "offers"),  # 512 MiB declared, need 0
            ):
                with pytest.raises(PeerError, match=why):
                    await stranger.call(w.peer_id, "job.assign", {**base, "stage": 0, **bad})
            t0 = time.monotonic()
            for i in range(MAX_STAGES_PER_DRIVER):
                await stranger.call(w.peer_id, "job.assign", {**base, "stage": i, "lease_s": MAX_LEASE_S})
            with pytest.raises(PeerError, match="limit"):
                await stranger.call(w.peer_id, "job.assign", {**base, "stage": 1001})
            assert len(svc.jobs) == MAX_STAGES_PER_DRIVER
            print(f"\n{MAX_STAGES_PER_DRIVER} assignments in {time.monotonic() - t0:.2f} s, then refused")
        # a declared buffer is not allocated before the state is checked; big-int arithmetic is refused
        tracemalloc.start()
        with pytest.raises(ProtocolError, match="missing"):
            StageModule.from_description(_description([128, MiB]), {})
        assert tracemalloc.get_traced_memory()[1] < 16 * MiB
        tracemalloc.stop()
        stage = StageModule.from_description(_description([4]), {"b": torch.zeros(4)})
        t0 = time.perf_counter()
        with pytest.raises(Exception, match="bits"):
            stage({"x": torch.zeros(1)})
        assert time.perf_counter() - t0 < 1.0

    asyncio.run(main())


# ------------------------------------------------------------------ 7. probe slots


def test_silent_outsiders_do_not_block_member_probes():
    """Attack 7: two silent outsiders took both probe slots (before the preamble was checked) and
    stopped every member's probe for 30 s."""

    async def main():
        async with peers(SwarmAuthorizer(KEY), SwarmAuthorizer(KEY), None, None) as (v, m, o1, o2):
            server = LinkProber(v.p2p)
            server.auth = v.preamble_hooks()
            await server.start()
            client = LinkProber(m.p2p, ProbeConfig(probe_bytes=64 << 10, pings=2, timeout_s=5.0))
            client.auth = m.preamble_hooks()
            held = []
            for o in (o1, o2, o1, o2):
                _i, _r, w = await o.p2p.call_binary_stream_handler(
                    PeerID.from_base58(v.peer_id), PROBE_PROTOCOL
                )
                held.append(w)  # and never write a byte
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            result = await client.probe(v.peer_id)
            print(f"\nmember probe with 4 silent outsider streams open: {time.monotonic() - t0:.2f} s")
            assert result.bandwidth_bps > 0
            for w in held:
                w.close()
            await server.stop()

    asyncio.run(main())


# ------------------------------------------------------------------ 9. unhandled input


def test_bad_data_open_and_meta_are_protocol_errors_and_nan_timestamps_refused():
    """Attack 9: data.open with first=inf and a data message with step "x" raised out of the stream
    handler; the nonce cache accepted a NaN timestamp and then the same nonce again."""

    async def main():
        async with peers(None, None) as (victim, attacker):
            victim.mailbox.accept("j", "stage", {attacker.peer_id}, MiB)
            info = _info(attacker.peer_id, PROTO_DATA)
            for first, meta in (
                (float("inf"), {"job": "j", "step": 0, "mb": 0, "stage": 0}),
                (0, {"job": "j", "step": "x", "mb": 0, "stage": 0}),
                (0, {"job": "j", "step": float("inf"), "mb": 0, "stage": 0}),
            ):
                frames = encode_message(Call("data.open", {"session": "ab", "first": first}))
                frames += encode_message(tensor_message("act", meta, {}))
                await _feed(victim._on_data_stream, info, frames)  # returns: no exception escapes
            assert victim.mailbox.status()["held_messages"] == 0

    asyncio.run(main())
    cache = NonceCache(capacity=4, window_s=30.0)
    now = time.time()
    assert cache.check_and_add(b"n" * 16, float("nan"), now) is not None
    assert cache.check_and_add(b"n" * 16, float("nan"), now) is not None
    assert cache.check_and_add(b"m" * 16, now, now) is None
    assert cache.check_and_add(b"m" * 16, now, now) == "replayed nonce"


# ------------------------------------------------------------------ 6. a host's failed save


def test_one_hosts_failed_save_resumes_from_the_newest_step_all_hosts_have(tmp_path, monkeypatch):
    """Attack/fault 6: host 2's disk is full at step 4; each host used to load its own newest shard
    (4 and 3) and the driver stopped. The driver's real `_init_hosts` now restores both at step 3."""
    import errno
    from types import SimpleNamespace

    from fusionnode.optim import checkpoint as ck
    from fusionnode.optim.contributions import contributor_key
    from fusionnode.train.checkpoint import job_secret
    from fusionnode.train.driver import Driver, Job, Pipeline

    real_write = ck._write_chunk

    def disk_full_on_h2(f, data):
        if "h2-state" in f.name and "step-0000000004" in f.name:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(f, data)

    monkeypatch.setattr(ck, "_write_chunk", disk_full_on_h2)
    key = contributor_key(0, 0)

    async def main():
        async with peers(None, None, None) as (h1, h2, d):
            svcs = [
                OptimizerHostService(t, state_dir=tmp_path / f"{n}-state", step_deadline_s=5.0)
                for n, t in (("h1", h1), ("h2", h2))
            ]
            drv = Driver(d, None, config=SimpleNamespace(step_timeout_s=10.0), state_dir=tmp_path / "drv")
            spec = JobSpec(
                optimizer="sgd", lr=0.1, weight_decay=0.0, grad_clip=None, job_id="j6", save_every=1
            )
            job = Job(spec, d.peer_id)
            job.pipelines = [Pipeline(0, [d.peer_id], [0, 1], 1, 1)]
            job.hosts, job.secret, job.model_bytes = (
                [h1.peer_id, h2.peer_id],
                job_secret(drv.state_dir, "j6"),
                24,
            )
            stage_args = [
                StageAssignment(
                    job="j6",
                    stage=0,
                    num_stages=1,
                    driver=d.peer_id,
                    description={},
                    param_specs={"a": {}, "b": {}},
                    spec={},
                    peer=d.peer_id,
                )
            ]
            full = {"a": torch.zeros(3), "b": torch.zeros(3)}
            host_of = {"a": h1.peer_id, "b": h2.peer_id}
            drv.placement.accept(job, stage_args)
            assert await drv.placement.start_hosts(
                job, stage_args, full, host_of, resume=False, start_step=0
            ) == [0, 0]
            at: dict[int, torch.Tensor] = {}
            for step in range(1, 5):
                for name, host, svc in (("a", h1, svcs[0]), ("b", h2, svcs[1])):
                    meta = {"job": "j6", "step": step, "mb": -1, "stage": 0, "contributor": key, "samples": 1}
                    await d.send(
                        host.peer_id, tensor_message("push", meta, {name: torch.full((3,), float(step))})
                    )
                    await wait_for(lambda s=step, v=svc: v.shards["j6"].store.ready(s), 5, "a push")
                    await d.call(host.peer_id, "opt.apply", {"job": "j6", "step": step, "lr": 0.1})
                at[step] = svcs[1].shards["j6"].store.get_params(["b"])[1]["b"].clone()
            for h in job.hosts:
                await d.call(h, "opt.release", {"job": "j6"})
            applied = await drv.placement.start_hosts(
                job, stage_args, full, host_of, resume=True, start_step=4
            )
            assert applied == [3, 3]  # the newest step both hosts have
            torch.testing.assert_close(svcs[1].shards["j6"].store.get_params(["b"])[1]["b"], at[3])

    asyncio.run(main())


# ------------------------------------------------------------------ 8. advertised link speeds


def test_a_peer_cannot_advertise_a_link_faster_than_the_other_end_measured():
    """Attack 8 (links): a liar advertises 10 Tbit/s to an honest peer that measured 8 Mbit/s the
    other way; the cluster the planner gets has 8 Mbit/s. A link only the liar reports is at most the
    fastest link measured from both ends (8 Mbit/s here; 1 Gbit/s when none is)."""
    from types import SimpleNamespace

    from fusionnode.train.driver import cluster_from_records

    def rec(pid: str, links: dict) -> SimpleNamespace:
        return SimpleNamespace(
            peer_id=pid,
            links={o: SimpleNamespace(bandwidth_bps=b, rtt_s=r) for o, (b, r) in links.items()},
            device=SimpleNamespace(tflops_fp32=1.0),
            capacity_bytes=1 << 30,
        )

    records = [
        rec("liar", {"honest": (1e13, 1e-6), "other": (1e9, 1e-3)}),
        rec("honest", {"liar": (8e6, 0.02)}),
        rec("other", {}),
    ]
    doc = cluster_from_records(records, ["liar", "honest", "other"], [])
    pairs = {(p["a"], p["b"]): p for p in doc["links"]["pairs"]}
    assert pairs[("honest", "liar")]["bandwidth_gbps"] == pytest.approx(8e-3)
    assert pairs[("honest", "liar")]["latency_ms"] == pytest.approx(10.0)
    assert pairs[("liar", "other")]["bandwidth_gbps"] == pytest.approx(8e-3)  # it claimed 1 Gbit/s
    # nothing measured from both ends: a one-sided 10 Tbit/s claim is planned at the 1 Gbit/s default
    alone = cluster_from_records(
        [rec("liar", {"other": (1e13, 1e-6)}), rec("other", {})], ["liar", "other"], []
    )
    assert alone["links"]["pairs"][0]["bandwidth_gbps"] == pytest.approx(1.0)


def test_advertised_tflops_are_capped_and_replaced_by_measured_stage_speeds():
    """Attack 8 (compute): a liar advertises 1e5 TFLOPS among peers of 2. Before any job it is planned
    at most ADVERTISED_CAP x the median advertisement; once the driver measured its stage times
    (as slow as the others here), the measurement replaces the advertisement."""
    from types import SimpleNamespace

    from fusionnode.train.placement import cluster_from_records
    from fusionnode.train.rebalance import ADVERTISED_CAP

    def rec(pid: str, tflops: float) -> SimpleNamespace:
        return SimpleNamespace(
            peer_id=pid, links={}, device=SimpleNamespace(tflops_fp32=tflops), capacity_bytes=1 << 30
        )

    records = [rec("liar", 1e5), rec("a", 2.0), rec("b", 2.0)]
    ids = ["liar", "a", "b"]
    tf = {d["id"]: d["tflops"] for d in cluster_from_records(records, ids, [])["devices"]}
    assert tf == {"liar": ADVERTISED_CAP * 2.0, "a": 2.0, "b": 2.0}
    # measured (work per second, any unit): the liar as fast as the others, then 10x slower
    tf = {
        d["id"]: d["tflops"]
        for d in cluster_from_records(records, ids, [], {"liar": 5.0, "a": 5.0, "b": 5.0})["devices"]
    }
    assert tf["liar"] == pytest.approx(2.0)
    tf = {
        d["id"]: d["tflops"]
        for d in cluster_from_records(records, ids, [], {"liar": 0.5, "a": 5.0, "b": 5.0})["devices"]
    }
    assert tf["liar"] == pytest.approx(0.2) and tf["a"] == pytest.approx(2.0)
    # measured honest peers, an unmeasured liar: at most ADVERTISED_CAP x the fastest measured figure
    tf = {
        d["id"]: d["tflops"] for d in cluster_from_records(records, ids, [], {"a": 5.0, "b": 2.5})["devices"]
    }
    assert tf["liar"] == pytest.approx(ADVERTISED_CAP * 2.0)
