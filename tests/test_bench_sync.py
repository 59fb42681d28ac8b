"""`fusionnode bench sync` on a tiny setting: every mode runs, bytes and targets are consistent."""

from __future__ import annotations

import json

from fusionnode.bench import sync as bench


def test_bench_sync_tiny(capsys) -> None:
    args = ["--steps", "8", "--inner-steps", "4", "--batch-size", "4", "--seq-len", "16", "--json"]
    assert bench.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    modes = out["modes"]
    assert set(modes) == {"step", "diloco", "diloco-avg", "sparseloco"}
    assert out["eval_every"] == 4 and [r["step"] for r in modes["step"]["records"]] == [3, 7]
    # the round modes sync twice, step mode 8 times: raw diloco sends a quarter of step's bytes
    assert modes["diloco"]["rounds"] == 2 and modes["step"]["rounds"] == 8
    assert modes["diloco"]["bytes"] * 4 == modes["step"]["bytes"]
    # ctopk2 at 1/16 in chunks of 256: 0.11 bytes an element up, relayed to both replicas down,
    # against raw float32 up and down: about 24x fewer per round
    assert modes["sparseloco"]["bytes"] * 20 < modes["diloco"]["bytes"]
    target = out["target_val_loss"]
    for row in modes.values():
        assert row["bytes_to_target"] is not None and min(r["val_loss"] for r in row["records"]) <= target
    assert len(out["targets"]) == 3


def test_bench_sync_prints_its_table(capsys) -> None:
    args = ["--steps", "4", "--inner-steps", "2", "--batch-size", "4", "--seq-len", "16"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("sync benchmark: gpt2-tiny, 2 replicas, 4 steps")
    for name in ("step", "diloco", "diloco-avg", "sparseloco"):
        assert f"\n{name} " in out
    assert "bytes to other targets" in out
    assert "  sparseloco: H 2, outer lr 1.0, density 0.0625, chunk 256, EF decay 0.95\n" in out


def test_the_testbed_configuration_in_runs_of_one_mode_each_combined(tmp_path, capsys) -> None:
    """`--testbed-config fusionnode-dp` takes the testbed's H, SparseLoCo settings and speed shares
    (home-volunteers-4: 6/5/3/2 of 16); runs of one mode each (`--rows-out`) combine into one table."""
    from fusionnode.bench.systems import DP_SYNC

    common = ["--testbed-config", "fusionnode-dp", "--steps", "5", "--seq-len", "16"]
    files = [tmp_path / "step.json", tmp_path / "sparse.json"]
    assert bench.main([*common, "--modes", "step", "--rows-out", str(files[0])]) == 0
    lap = ["--sync-overlap", "--overlap-steps", "1"]
    assert bench.main([*common, *lap, "--modes", "sparseloco", "--rows-out", str(files[1])]) == 0
    assert "summarise with --combine" in capsys.readouterr().out
    sparse = json.loads(files[1].read_text())
    assert sparse["meta"]["shares"] == [6, 5, 3, 2] and sparse["meta"]["seq_len"] == 16
    c = sparse["modes"]["sparseloco"]["sync"]
    assert (c["inner_steps"], c["topk_density"], c["chunk"], c["outer_lr"], c["ef_decay"]) == (
        DP_SYNC.inner_steps,
        DP_SYNC.topk_density,
        DP_SYNC.chunk,
        DP_SYNC.outer_lr,
        DP_SYNC.ef_decay,
    )
    assert DP_SYNC.outer_lr == 2.0 and DP_SYNC.ef_decay == 0.8
    assert c["overlap"] and c["overlap_steps"] == 1
    assert bench.main(["--combine", *map(str, files), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["modes"]) == {"step", "sparseloco"} and out["replicas"] == 4
    # a round closes every H steps and at the last step: 5 steps of H = 4 are 2 rounds
    rounds = -(-5 // DP_SYNC.inner_steps)
    assert out["modes"]["step"]["rounds"] == 5 and out["modes"]["sparseloco"]["rounds"] == rounds


def test_the_testbed_configuration_adds_its_diloco(tmp_path, capsys) -> None:
    """`--testbed-config fusionnode-dp` adds diloco-dp: DiLoCo with the testbed's outer step
    (bench/systems.py DP_DILOCO) at the testbed's H and overlap; without it the mode is unknown."""
    import pytest

    from fusionnode.bench.systems import DP_DILOCO, DP_SYNC

    rows = tmp_path / "diloco.json"
    common = ["--testbed-config", "fusionnode-dp", "--steps", "5", "--seq-len", "16", "--modes", "diloco-dp"]
    assert bench.main([*common, "--rows-out", str(rows)]) == 0
    c = json.loads(rows.read_text())["modes"]["diloco-dp"]["sync"]
    got = (c["mode"], c["inner_steps"], c["outer_lr"], c["outer_momentum"], c["codec"], c["overlap_steps"])
    assert got == ("diloco", DP_SYNC.inner_steps, DP_DILOCO.outer_lr, DP_DILOCO.outer_momentum, "raw", 1)
    assert (DP_DILOCO.inner_steps, DP_DILOCO.overlap_steps) == (DP_SYNC.inner_steps, DP_SYNC.overlap_steps)
    with pytest.raises(SystemExit, match="unknown"):
        bench.main(["--steps", "4", "--modes", "diloco-dp"])
