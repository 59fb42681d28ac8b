"""The comparison table of `fusionnode bench testbed`: FusionNode's configurations and hivemind's
collaborative training (bench/hivemind_peer.py) on the same netns testbed, measured the same way.

Per system and testbed:
- wall-clock time to a target loss: the first time the system's loss, as a mean over its last
  `WINDOW` steps, is at or below the target. The target is one the baseline reaches (its own final
  `WINDOW`-step mean, unless `--target-loss` fixes it) and is stated with the table. The loss is
  each step's training loss on a batch the model has not seen (every batch is a fresh draw of the
  corpus), because FusionNode's driver measures held-out loss only at the end of a run; the final
  validation loss (the same `evaluate` on the same held-out batches) is reported beside it;
- the time axis: FusionNode: the summed step times of its step records (plan and setup left out);
  hivemind: seconds since the common start signal, the swarm's DHT and optimizers already up;
- tokens/s: every token the system trained on over its wall-clock time (hivemind's peers may
  overshoot a target batch a little: their tokens are counted as processed);
- bytes sent: the transmit counters of every emulated link (/proc/net/dev of each namespace, the
  interfaces the testbed made) before and after the run, summed over devices; headers included;
- utilisation: per device, the share of the wall-clock time it spent computing (forward and
  backward, paced to the emulated device speed).
"""

from __future__ import annotations

import csv
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

WINDOW = 3  # steps in the running mean of the loss that time-to-target and final loss use


def netdev_tx(netns: str, prefix: str = "to") -> int:
    """Bytes transmitted by the interfaces named `prefix`* in network namespace `netns` (the
    testbed's veths), from its /proc/net/dev."""
    text = subprocess.run(
        ["ip", "netns", "exec", netns, "cat", "/proc/net/dev"], capture_output=True, text=True, check=True
    ).stdout
    return parse_netdev_tx(text, prefix)


def parse_netdev_tx(text: str, prefix: str = "to") -> int:
    total = 0
    for line in text.splitlines()[2:]:
        if ":" not in line:
            continue
        name, rest = line.split(":", 1)
        fields = rest.split()
        if name.strip().startswith(prefix) and len(fields) >= 9:
            total += int(fields[8])  # receive: 8 fields, then transmit bytes
    return total


def running_mean(values: list[float], window: int = WINDOW) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def time_to_target(curve: list[dict[str, Any]], target: float, window: int = WINDOW) -> float | None:
    """The first `t` at which the running mean of `loss` over `window` points is <= target."""
    smooth = running_mean([p["loss"] for p in curve], window)
    for p, v in zip(curve, smooth, strict=True):
        if v <= target:
            return p["t"]
    return None


def fusionnode_curve(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(t, loss) per step: t = the summed step times up to and including it."""
    out, t = [], 0.0
    for i, s in enumerate(steps):
        t += s["step_time_s"]
        out.append({"step": i, "t": t, "loss": s["loss"]})
    return out


def fusionnode_utilisation(steps: list[dict[str, Any]], peer_ids: list[str]) -> list[float]:
    """Per device (in `peer_ids` order): its stages' compute seconds over the summed step times."""
    wall = sum(s["step_time_s"] for s in steps) or 1.0
    busy = dict.fromkeys(peer_ids, 0.0)
    for s in steps:
        for st in s["stages"]:
            if st.get("peer") in busy:
                busy[st["peer"]] += st["compute_s"]
    return [min(1.0, busy[p] / wall) for p in peer_ids]


def hivemind_curve(swarm: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    """(t, loss) per epoch of the swarm: the sample-weighted mean loss, at that epoch's parameters,
    of the local steps that trained on FusionNode's batch of that step (`shared`; every local step of
    the epoch where no peer's was), at the time the last step of that epoch or an earlier one
    finished (with local updates a slow peer may still be in an earlier epoch than the others: the
    curve waits for it, so time only runs forward)."""
    by_epoch: dict[int, list[dict[str, Any]]] = {}
    for peer in swarm["peers"]:
        for r in peer["steps"]:
            if r["epoch"] < steps:
                by_epoch.setdefault(r["epoch"], []).append(r)
    out, t = [], 0.0
    for e in sorted(by_epoch):
        t = max(t, *(r["t"] for r in by_epoch[e]))
        rs = [r for r in by_epoch[e] if r.get("shared")] or by_epoch[e]
        n = sum(r["samples"] for r in rs)
        out.append({"step": e, "t": t, "loss": sum(r["loss"] * r["samples"] for r in rs) / n})
    return out


def hivemind_wall(swarm: dict[str, Any]) -> float:
    """Seconds until the last peer reached the final epoch (or gave up)."""
    ends = [p["done"]["t"] for p in swarm["peers"] if p["done"]]
    logged = [r["t"] for p in swarm["peers"] for r in p["steps"]]
    return max(ends or logged or [0.0])


def hivemind_utilisation(swarm: dict[str, Any]) -> list[float]:
    wall = hivemind_wall(swarm) or 1.0
    return [min(1.0, sum(r["compute_s"] for r in p["steps"]) / wall) for p in swarm["peers"]]


def row(
    system: str,
    *,
    kind: str,
    curve: list[dict[str, Any]],
    wall_s: float,
    tokens: int,
    bytes_sent: int | None,
    val_loss: float | None,
    utilisation: list[float],
    settings: dict[str, Any] | None = None,
    note: str = "",
) -> dict[str, Any]:
    losses = [p["loss"] for p in curve]
    return {
        "system": system,
        "kind": kind,
        "steps": len(curve),
        "wall_s": wall_s,
        "tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "bytes_sent": bytes_sent,
        "final_loss": statistics.fmean(losses[-WINDOW:]) if losses else float("nan"),
        "val_loss": val_loss,
        "utilisation": utilisation,
        "settings": settings or {},
        "note": note,
        "curve": curve,
    }


def choose_target(rows: list[dict[str, Any]], target: float | None) -> tuple[float | None, str]:
    """The target loss and where it came from: `target` if given; else, when hivemind ran, the
    highest final running mean among hivemind's systems (a loss every baseline a user would run
    reaches, so that each speed-up against them is a measured ratio); else FusionNode's baseline's
    final running mean, else the first FusionNode row's."""
    if target is not None:
        return target, "--target-loss"
    hivemind = [r for r in rows if r["kind"] == "hivemind" and r["curve"]]
    if hivemind:
        worst = max(hivemind, key=lambda r: r["final_loss"])
        names = " and ".join(r["system"] for r in hivemind)
        return worst["final_loss"], (
            f"the highest final {WINDOW}-step mean loss of {names} ({worst['system']}'s): every one reaches it"
        )
    for name in ("baseline",):
        r = next((r for r in rows if r["system"] == name and r["curve"]), None)
        if r is not None:
            return r["final_loss"], f"{name}'s final {WINDOW}-step mean loss"
    r = next((r for r in rows if r["kind"] == "fusionnode" and r["curve"]), None)
    if r is not None:
        return r["final_loss"], f"{r['system']}'s final {WINDOW}-step mean loss"
    return None, "no FusionNode run to take a target from"


def finish(rows: list[dict[str, Any]], target: float | None) -> dict[str, Any]:
    """Fills in each row's time to the target and the speed-ups against hivemind's rows."""
    value, source = choose_target(rows, target)
    for r in rows:
        r["time_to_target_s"] = time_to_target(r["curve"], value) if value is not None else None
    return {
        "target_loss": value,
        "target_source": source,
        "window": WINDOW,
        "rows": rows,
        "speedups": speedups(rows),
    }


def speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per FusionNode row that reached the target and hivemind row: how many times sooner it did
    (hivemind's time / FusionNode's). A hivemind system that never reached the target gives a lower
    bound: its whole wall-clock time over FusionNode's time (`at_least`)."""
    out = []
    for f in rows:
        if f["kind"] != "fusionnode" or f["time_to_target_s"] is None:
            continue
        for h in rows:
            if h["kind"] != "hivemind":
                continue
            reached = h["time_to_target_s"] is not None
            theirs = h["time_to_target_s"] if reached else h["wall_s"]
            out.append(
                {
                    "system": f["system"],
                    "versus": h["system"],
                    "times_sooner": theirs / max(f["time_to_target_s"], 1e-9),
                    "at_least": not reached,
                }
            )
    return out


def print_comparison(cluster: str, network: str, comp: dict[str, Any]) -> None:
    from fusionnode.term import table

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    target = comp["target_loss"]
    print()
    table(
        [
            "system",
            "to target s",
            "wall s",
            "tokens/s",
            "sent MiB",
            "loss",
            "val loss",
            "computing (per device)",
        ],
        [
            (
                r["system"],
                num(r["time_to_target_s"], ".1f") if r["time_to_target_s"] is not None else "not reached",
                f"{r['wall_s']:.1f}",
                f"{r['tokens_per_s']:.0f}",
                num(None if r["bytes_sent"] is None else r["bytes_sent"] / 2**20, ".1f"),
                f"{r['final_loss']:.4f}",
                num(r["val_loss"], ".4f"),
                " ".join(f"{u:.0%}" for u in r["utilisation"]),
            )
            for r in comp["rows"]
        ],
        title=(
            f"{cluster} ({network}): time to loss {num(target, '.4f')} ({comp['target_source']}; "
            f"loss = mean of the last {comp['window']} steps' training loss on unseen batches)"
        ),
        right=(1, 2, 3, 4, 5, 6),
    )
    for x in comp.get("speedups", []):
        print(
            f"  {x['system']} reached the target {'at least ' if x['at_least'] else ''}"
            f"{x['times_sooner']:.1f}x sooner than {x['versus']}"
            + (f" ({x['versus']} never reached it: its whole run)" if x["at_least"] else "")
        )
    for r in comp["rows"]:
        if r["settings"]:
            print(f"  {r['system']}: " + ", ".join(f"{k}={v}" for k, v in r["settings"].items()))
        if r["note"]:
            print(f"  {r['system']}: {r['note']}")


def write_curves_csv(results: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["cluster", "system", "step", "t_s", "loss"])
        for res in results:
            for r in res["comparison"]["rows"]:
                for p in r["curve"]:
                    w.writerow([res["cluster"], r["system"], p["step"], f"{p['t']:.3f}", f"{p['loss']:.5f}"])


def plot_loss_vs_time(results: list[dict[str, Any]], path: Path) -> bool:
    """Loss against wall-clock time, one panel per testbed, the target as a dashed line (PNG with
    matplotlib; False when it is not installed: the CSV of the curves is written either way)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'fusionnode[bench]')", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for k, res in enumerate(results):
        ax = axes[0][k]
        comp = res["comparison"]
        for r in comp["rows"]:
            if r["curve"]:
                ax.plot(
                    [p["t"] for p in r["curve"]],
                    running_mean([p["loss"] for p in r["curve"]], comp["window"]),
                    label=r["system"],
                    linestyle="--" if r["kind"] == "hivemind" else "-",
                )
        if comp["target_loss"] is not None:
            ax.axhline(comp["target_loss"], color="grey", linewidth=0.8, linestyle=":", label="target")
        ax.set_title(f"{res['cluster']} ({res['network']})")
        ax.set_xlabel("wall-clock s")
        ax.set_ylabel(f"loss ({comp['window']}-step mean)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def evaluate_params(params_path: str | Path, *, batch_size: int, seq_len: int, seed: int) -> float:
    """FusionNode's validation loss (`train.local.evaluate`, the driver's held-out batches) of a
    gpt2-tiny state dict saved by a hivemind peer."""
    import torch

    from fusionnode.train.data import BatchSource, load_corpus
    from fusionnode.train.local import build_job_model, evaluate
    from fusionnode.train.spec import JobSpec

    model = build_job_model(JobSpec(model="gpt2-tiny", batch_size=batch_size, seq_len=seq_len, seed=seed))
    model.load_state_dict(torch.load(params_path, weights_only=True))
    with torch.no_grad():
        return evaluate(model, BatchSource(load_corpus(), batch_size=batch_size, seq_len=seq_len, seed=seed))


def print_table(res: dict[str, Any]) -> None:
    from fusionnode.term import table

    label = "tc/netns links" if res["network"] == "netns" else "user-space token buckets on loopback"
    speeds = ", ".join(f"{v * 1e3:.1f}" for v in res["emulated_tflops"])

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    print()
    table(
        [
            *("config", "tokens/s", "speedup", "step s", "sim s", "err", "closed s", "err", "wire MiB"),
            *("loss", "Δloss", "pipes", "stages"),
        ],
        [
            (
                r["config"],
                f"{r['tokens_per_s']:.0f}",
                num(r["speedup"], ".2f") + ("x" if r["speedup"] is not None else ""),
                f"{r['step_time_s']:.3f}",
                num(r["simulated_step_time_s"], ".3f"),
                num(r["simulation_error"], "+.0%"),
                num(r["predicted_step_time_s"], ".3f"),
                num(r["prediction_error"], "+.0%"),
                f"{r['wire_bytes'] / 2**20:.1f}",
                f"{r['final_loss']:.4f}",
                num(r["loss_vs_baseline"], "+.1%"),
                r["pipelines"],
                r["stages"],
            )
            for r in res["rows"]
        ],
        title=f"{res['cluster']}: {res['devices']} peers, {label}, devices paced at {speeds} GFLOP/s",
        right=tuple(range(1, 13)),
    )


def plot(results: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'fusionnode[bench]')", file=sys.stderr)
        return False
    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 7), squeeze=False)
    for k, res in enumerate(results):
        for r in res["rows"]:
            t = [p["t"] for p in r["curve"]]
            axes[0][k].plot(t, [p["tokens_per_s"] for p in r["curve"]], label=r["config"])
            axes[1][k].plot(t, [p["loss"] for p in r["curve"]], label=r["config"])
        axes[0][k].set_title(f"{res['cluster']} ({res['network']})")
        axes[0][k].set_ylabel("tokens/s")
        axes[1][k].set_ylabel("loss")
        axes[1][k].set_xlabel("training time (s)")
        axes[0][k].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True
