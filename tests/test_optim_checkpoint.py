"""Shard checkpoints: round trip, fallback past corrupt or incomplete ones, disk full mid-write."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from fusionnode.errors import ConfigError
from fusionnode.optim import (
    CheckpointError,
    Contributor,
    ExpectedContributions,
    OptimizerConfig,
    ParameterStore,
    StepOrderError,
    load_latest_shard,
    save_shard,
)
from fusionnode.optim import checkpoint as ckpt

torch.set_num_threads(1)

CFG = OptimizerConfig("adamw", lr=1e-2, weight_decay=0.1, grad_clip=1.0)
SHAPES = {"h.0.w": (16, 8), "h.0.b": (16,), "wte": (32, 8)}
CONTRIB = {"r0/s0": Contributor("r0", 4)}


def _store() -> ParameterStore:
    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    return ParameterStore("job1", params, CFG, ExpectedContributions.same_for_all(params, CONTRIB))


def _train(store: ParameterStore, steps: int, seed: int = 1, skip: str | None = None) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        step = store.applied_step + 1
        for n, s in SHAPES.items():
            if n != skip:
                store.push(step, "r0/s0", n, torch.randn(s, generator=g), 4)
        assert store.apply(step, force=skip is not None).applied


def _assert_same_state(a: dict, b: dict) -> None:
    assert a["applied_step"] == b["applied_step"] and a["steps"] == b["steps"]
    assert a["optimizer_config"] == b["optimizer_config"]
    for n in SHAPES:
        assert torch.equal(a["params"][n], b["params"][n])
    assert set(a["state"]) == set(b["state"])
    for kind in a["state"]:
        for n in SHAPES:
            assert torch.equal(a["state"][kind][n], b["state"][kind][n])


def test_round_trip_restores_state_and_continues_identically(tmp_path: Path) -> None:
    store = _store()
    _train(store, 2)
    _train(store, 1, seed=2, skip="h.0.b")  # per-name step counts differ now
    path = save_shard(tmp_path, "job1", "hostA", 3, store)
    assert path.name == "step-0000000003" and sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "tensors.safetensors",
    ]
    loaded = load_latest_shard(tmp_path, "job1", "hostA")
    assert loaded is not None and loaded[0] == 3
    restored = _store()
    restored.load_state_dict(loaded[1])
    _assert_same_state(restored.state_dict(), store.state_dict())
    assert restored.state_dict()["steps"]["h.0.b"] == 2
    _train(store, 2, seed=9)
    _train(restored, 2, seed=9)
    _assert_same_state(restored.state_dict(), store.state_dict())
    # the tensor file is plain safetensors, readable by the reference implementation
    flat = safetensors.torch.load_file(str(path / "tensors.safetensors"))
    assert set(flat) == {f"{k}/{n}" for k in ("param", "exp_avg", "exp_avg_sq") for n in SHAPES}


def test_newest_corrupt_or_incomplete_falls_back(tmp_path: Path) -> None:
    store = _store()
    _train(store, 1)
    save_shard(tmp_path, "job1", "h", 1, store)
    expected = store.state_dict()
    _train(store, 1)
    p2 = save_shard(tmp_path, "job1", "h", 2, store)
    assert load_latest_shard(tmp_path, "job1", "h")[0] == 2

    data = bytearray((p2 / "tensors.safetensors").read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the tensor data
    (p2 / "tensors.safetensors").write_bytes(bytes(data))
    step, state = load_latest_shard(tmp_path, "job1", "h")
    assert step == 1
    restored = _store()
    restored.load_state_dict(state)
    _assert_same_state(restored.state_dict(), expected)

    _train(store, 1)
    p3 = save_shard(tmp_path, "job1", "h", 3, store)
    (p3 / "manifest.json").unlink()  # incomplete
    assert load_latest_shard(tmp_path, "job1", "h")[0] == 1
    (p3 / "manifest.json").write_text("{not json")
    assert load_latest_shard(tmp_path, "job1", "h")[0] == 1
    (tmp_path / "job1" / "h" / ".tmp-step-0000000009-1-abcd").mkdir()  # a crashed writer's leftover
    assert load_latest_shard(tmp_path, "job1", "h")[0] == 1
    assert load_latest_shard(tmp_path, "job1", "other") is None


def test_disk_full_mid_write_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store()
    _train(store, 1)
    good = save_shard(tmp_path, "job1", "h", 1, store)
    _train(store, 1)
    written = {"n": 0}
    real_write = ckpt._write_chunk

    def full_disk(f, data) -> None:
        if written["n"] >= 4000:  # header and two tensors written, then the disk fills
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(f, data)
        written["n"] += 1000

    monkeypatch.setattr(ckpt, "_write_chunk", full_disk)
    with pytest.raises(CheckpointError) as info:
        save_shard(tmp_path, "job1", "h", 2, store)
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert "earlier checkpoints kept" in str(info.value)
    shard = tmp_path / "job1" / "h"
    assert sorted(p.name for p in shard.iterdir()) == [good.name]  # no partial directory left
    assert load_latest_shard(tmp_path, "job1", "h")[0] == 1

    monkeypatch.setattr(ckpt, "_write_chunk", real_write)
    assert save_shard(tmp_path, "job1", "h", 2, store).name == "step-0000000002"
    assert load_latest_shard(tmp_path, "job1", "h")[0] == 2


def test_keeps_last_k_and_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    store = _store()
    for step in range(1, 6):
        _train(store, 1)
        save_shard(tmp_path, "job1", "h", step, store, keep=2)
    shard = tmp_path / "job1" / "h"
    assert sorted(p.name for p in shard.iterdir()) == ["step-0000000004", "step-0000000005"]
    save_shard(tmp_path, "job1", "h", 5, store, keep=2)
    assert sorted(p.name for p in shard.iterdir()) == ["step-0000000004", "step-0000000005"]
    manifest = json.loads((shard / "step-0000000005" / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["names"] == sorted(SHAPES)


def test_bad_arguments(tmp_path: Path) -> None:
    store = _store()
    with pytest.raises(StepOrderError):
        save_shard(tmp_path, "job1", "h", 4, store)
    with pytest.raises(ConfigError):
        save_shard(tmp_path, "../x", "h", 0, store)
    with pytest.raises(ConfigError):
        load_latest_shard(tmp_path, "job1", "a/b")
    other = ParameterStore(
        "job2",
        {n: torch.zeros(s) for n, s in SHAPES.items()},
        CFG,
        ExpectedContributions.same_for_all(SHAPES, CONTRIB),
    )
    save_shard(tmp_path, "job1", "h", 0, store)
    with pytest.raises(ConfigError):
        other.load_state_dict(load_latest_shard(tmp_path, "job1", "h")[1])


def test_a_round_modes_shard_checkpoint_keeps_the_outer_state_and_the_ledger(tmp_path: Path) -> None:
    """--sync diloco (issue 19): the store's applied step is the round ledger (a round is applied
    once: a second close ending at the same step is refused before the masters change); the shard
    checkpoint carries the open round, the ledger and the Nesterov buffer, and a combiner restored
    from it closes the next round exactly as the one that wrote it."""
    from fusionnode.optim.rounds import RoundCombiner, RoundError
    from fusionnode.sync import SyncConfig
    from fusionnode.wire.tensors import encode_tensor

    cfg = SyncConfig("diloco", inner_steps=4, outer_lr=0.7, outer_momentum=0.9)
    store = _store()
    names = set(SHAPES)
    rounds = RoundCombiner(cfg, 1, names)
    g = torch.Generator().manual_seed(3)

    def contribution() -> dict:
        return {n: encode_tensor(torch.randn(s, generator=g)) for n, s in SHAPES.items()}

    for r in range(2):
        rounds.add(r, 0, 64.0, contribution())
        store.update_masters(rounds.close, applied_step=(r + 1) * 4)
    before = store.get_params(sorted(names))[1]
    with pytest.raises(StepOrderError, match="applied already"):
        store.update_masters(lambda _p: pytest.fail("the masters were touched"), applied_step=8)
    after = store.get_params(sorted(names))[1]
    assert store.applied_step == 8 and all(torch.equal(after[n], before[n]) for n in names)
    save_shard(tmp_path, "job1", "h0", 8, store, rounds=rounds.state())
    state = ckpt.load_shard(tmp_path, "job1", "h0", 8)
    meta, bufs = state["rounds"]
    assert meta["round"] == 2 and meta["applied"] == [0, 1] and set(bufs) == names
    restored, again = _store(), RoundCombiner(cfg, 1, names)
    restored.load_state_dict(state)
    again.load_state(meta, bufs)
    assert restored.applied_step == 8
    with pytest.raises(RoundError, match="already applied"):
        again.add(1, 0, 64.0, contribution())
    nxt = contribution()
    for comb, st in ((rounds, store), (again, restored)):
        comb.add(2, 0, 64.0, dict(nxt))
        st.update_masters(comb.close, applied_step=12)
    a, b = store.get_params(sorted(names))[1], restored.get_params(sorted(names))[1]
    assert all(torch.equal(a[n], b[n]) for n in names)
    assert again.applied == [0, 1, 2]
