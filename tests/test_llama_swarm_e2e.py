"""Real loopback peers train Llama-family models: full training and LoRA follow `--local` step by step."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from fusionnode import control
from fusionnode.graph.portable import describe_stage
from fusionnode.graph.trace import trace_model
from fusionnode.localswarm import LocalSwarm
from fusionnode.train.checkpoint import load_checkpoint
from fusionnode.train.local import build_job_model, train_local
from fusionnode.train.spec import JobSpec

pytestmark = pytest.mark.e2e

N_PEERS = 3
TOL = 1e-5  # fp32, full training
LORA_TOL = 1e-3


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = LocalSwarm(tmp_path_factory.mktemp("peers"), N_PEERS, log=sys.stderr)
    try:
        s.start()
        asyncio.run(s.wait_connected())
        yield s
    finally:
        s.stop()


def run_job(swarm: LocalSwarm, spec: JobSpec, **extra) -> list[dict]:
    async def go():
        events = []
        params = {"spec": spec.to_dict(), "stages": N_PEERS, **extra}
        async for obj in control.call_stream(swarm.control(0), "train", params, timeout=300):
            if "event" in obj:
                events.append(obj["event"])
            else:
                return events
        raise AssertionError("no result")

    return asyncio.run(go())


def _spec(tmp_path, **kw) -> JobSpec:
    base = dict(
        model="llama-tiny",
        steps=6,
        batch_size=8,
        micro_batches=2,
        seq_len=32,
        seed=5,
        lr=3e-3,
        warmup_steps=2,
        compress="none",
        save_dir=str(tmp_path / "swarm"),
        save_every=0,
    )
    base.update(kw)
    return JobSpec(**base)


def _follows_local(tmp_path, spec: JobSpec, events: list[dict], tol: float) -> dict:
    plan = next(e for e in events if e["type"] == "plan")
    assert len({s["peer"] for s in plan["stages"]}) == N_PEERS
    dist = [e["loss"] for e in events if e["type"] == "step"]
    local = train_local(spec.replace(save_dir=str(tmp_path / "local")))
    assert len(dist) == len(local.losses) == spec.steps
    for i, (a, b) in enumerate(zip(dist, local.losses, strict=True)):
        assert abs(a - b) < tol, f"step {i}: swarm {a:.7f} vs local {b:.7f}"
    got = load_checkpoint(str(tmp_path / "swarm")).params
    for name, want in local.params.items():
        err = ((got[name] - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err < tol, f"{name}: relative difference {err:.2e}"
    return got


def test_tiny_llama_over_three_peers_follows_local(swarm, tmp_path):
    spec = _spec(tmp_path)
    _follows_local(tmp_path, spec, run_job(swarm, spec, offload="on"), TOL)


def test_lora_over_three_peers_sends_only_adapter_gradients(swarm, tmp_path):
    spec = _spec(tmp_path, lora_rank=4, lr=1e-2, lora_targets="q_proj,v_proj,down_proj")
    events = run_job(swarm, spec, offload="on")
    got = _follows_local(tmp_path, spec, events, LORA_TOL)
    model = build_job_model(spec)
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in adapters)
    all_bytes = sum(p.numel() * 4 for p in model.parameters())
    # the adapter bytes each stage owes a host on another peer (a push to its own peer is not on the wire)
    plan = next(e for e in events if e["type"] == "plan")
    traced = trace_model(model, torch.zeros(1, spec.seq_len, dtype=torch.long))
    remote = 0
    for st in plan["stages"]:
        if st["peer"] not in plan["optimizer_hosts"]:
            names = set(describe_stage(traced, st["lo"], st["hi"])["params"])
            remote += sum(adapters[n].numel() * 4 for n in names if n in adapters)
    assert remote > 0
    for e in (e for e in events if e["type"] == "step"):
        pushed = sum(s["optimizer_bytes"] for s in e["stages"])
        # every remote adapter gradient crosses once (plus message framing), nothing of the frozen base
        assert remote <= pushed < remote + 16 * 1024, (pushed, remote)
        assert pushed < all_bytes / 20
    base = build_job_model(spec.replace(lora_rank=0))
    for name, p in base.named_parameters():  # the base stayed frozen
        assert (got[name] - p).abs().max().item() == 0.0, name
