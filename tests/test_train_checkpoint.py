"""Checkpoints: round trips (tied weights, optimizer state), atomicity, corruption fallback, export."""

from __future__ import annotations

import json

import pytest
import torch

from fusionnode.train.checkpoint import (
    LATEST_FILE,
    MODEL_FILE,
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
    step_dir_name,
)
from fusionnode.train.data import encode
from fusionnode.train.export import export_checkpoint, load_model_from_checkpoint
from fusionnode.train.local import build_job_model, lm_loss, make_optimizer
from fusionnode.train.spec import JobSpec

SPEC = JobSpec(model="gpt2-tiny", steps=4, batch_size=2, seq_len=16, seed=3)
DATA_STATE = {"next_step": 1, "seed": 3}


def _trained_one_step():
    model = build_job_model(SPEC)
    opt = make_optimizer(model, SPEC)
    x = encode(b"def f(x):\n    return x + 1\n" * 2)[:33]
    lm_loss(model(x[None, :-1]), x[None, 1:]).backward()
    opt.step()
    return model, opt


def _small_params(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 2), value), "b": torch.zeros(2)}


def test_round_trip_keeps_tied_weights_and_optimizer_state(tmp_path) -> None:
    model, opt = _trained_one_step()
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    path = save_checkpoint(tmp_path, 1, state, opt.state_dict(), DATA_STATE, SPEC)
    assert path.name == step_dir_name(1) and (tmp_path / LATEST_FILE).read_text().strip() == path.name

    ckpt = load_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.step == 1 and ckpt.spec == SPEC and ckpt.data_state == DATA_STATE
    assert ckpt.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert ckpt.params["lm_head.weight"] is ckpt.params["transformer.wte.weight"]
    assert list(ckpt.params) == list(state)
    for name, t in state.items():
        assert torch.equal(ckpt.params[name], t), name

    fresh = build_job_model(SPEC.replace(seed=99))
    fresh.load_state_dict(ckpt.params, strict=True)
    assert fresh.lm_head.weight is fresh.transformer["wte"].weight  # still tied after loading
    fresh_opt = make_optimizer(fresh, SPEC)
    fresh_opt.load_state_dict(ckpt.optimizer_state)
    a, b = opt.state_dict(), fresh_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for idx, st in a["state"].items():
        for key, value in st.items():
            assert torch.equal(value, b["state"][idx][key]), (idx, key)


def test_nested_optimizer_state_and_shared_storage_views(tmp_path) -> None:
    base = torch.arange(6.0)
    params = {"full": base, "head": base[:2], "same": base}  # a partial view must be cloned, not refused
    opt_state = {"step": 7, "betas": (0.9, 0.95), "per_name": {0: {"m": torch.ones(2)}, 5: None}, "name": "x"}
    save_checkpoint(tmp_path, 7, params, opt_state, {}, SPEC)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.aliases == {"same": "full"}
    assert torch.equal(ckpt.params["head"], torch.tensor([0.0, 1.0]))
    assert ckpt.optimizer_state["betas"] == (0.9, 0.95)
    assert ckpt.optimizer_state["per_name"][5] is None
    assert torch.equal(ckpt.optimizer_state["per_name"][0]["m"], torch.ones(2))
    with pytest.raises(CheckpointError, match="cannot be saved"):
        save_checkpoint(tmp_path, 8, params, {"fn": print}, {}, SPEC)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [7]
    assert not list(tmp_path.glob(".tmp-*"))  # the failed save left nothing behind


def test_half_written_and_incomplete_checkpoints_are_ignored(tmp_path) -> None:
    save_checkpoint(tmp_path, 5, _small_params(5.0), {}, {}, SPEC)
    # A writer that died before the rename leaves a temp dir; one that was copied by hand lacks files.
    half = tmp_path / f".tmp-{step_dir_name(9)}-deadbeef"
    half.mkdir()
    (half / MODEL_FILE).write_bytes(b"partial")
    incomplete = tmp_path / step_dir_name(8)
    incomplete.mkdir()
    (incomplete / MODEL_FILE).write_bytes(b"partial")
    ckpt = load_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.step == 5
    save_checkpoint(tmp_path, 6, _small_params(6.0), {}, {}, SPEC)
    assert not half.exists()  # the next save removes a dead writer's temp dir


def test_corrupt_newest_falls_back_to_previous(tmp_path) -> None:
    save_checkpoint(tmp_path, 1, _small_params(1.0), {}, {}, SPEC)
    newest = save_checkpoint(tmp_path, 2, _small_params(2.0), {}, {}, SPEC)
    blob = bytearray((newest / MODEL_FILE).read_bytes())
    blob[-1] ^= 0xFF
    (newest / MODEL_FILE).write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="sha256"):
        read_checkpoint(newest)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.step == 1 and float(ckpt.params["w"][0, 0]) == 1.0

    manifest = json.loads((ckpt.path / "manifest.json").read_text())
    manifest["version"] = 99
    (ckpt.path / "manifest.json").write_text(json.dumps(manifest))
    assert load_checkpoint(tmp_path) is None  # nothing verifies any more


def test_keeps_last_k_and_resaves_a_step(tmp_path) -> None:
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, _small_params(float(step)), {}, {}, SPEC, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5, 4]
    save_checkpoint(tmp_path, 5, _small_params(50.0), {}, {}, SPEC, keep=2)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt is not None and float(ckpt.params["w"][0, 0]) == 50.0
    assert load_checkpoint(tmp_path / "nothing-here") is None


def test_export_and_load_model(tmp_path) -> None:
    model, opt = _trained_one_step()
    save_checkpoint(tmp_path / "ck", 1, model.state_dict(), opt.state_dict(), DATA_STATE, SPEC)
    out = export_checkpoint(tmp_path / "ck", tmp_path / "export" / "model.safetensors")
    x = encode(b"import os\n")[None]
    model.eval()
    with torch.no_grad():
        want = model(x)
        for source in (out, tmp_path / "ck"):
            loaded = load_model_from_checkpoint(source)
            assert torch.equal(loaded(x), want)
            assert loaded.lm_head.weight is loaded.transformer["wte"].weight
