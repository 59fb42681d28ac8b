"""What the command line says to people: job events, plans and availability changes as sentences,
peers by one short name everywhere, the next commands to try. Plain functions of the records the
daemon sends, so any renderer (plain lines, a rich terminal) can use them."""

from __future__ import annotations

import re
from typing import Any

SHORT_PEER_CHARS = 8  # characters of a peer id's end shown in tables and events


def short_peer(peer_id: str) -> str:
    """How human-readable output names a peer everywhere: the end of its id (ids share their start)."""
    return "…" + str(peer_id)[-SHORT_PEER_CHARS:]


def format_plan(ev: dict[str, Any]) -> list[str]:
    """A plan event as lines: the pipelines (data-parallel replicas), each one's stages in order."""
    stages = ev.get("stages") or []
    pipelines: dict[int, list[dict[str, Any]]] = {}
    for s in stages:
        pipelines.setdefault(int(s.get("replica", 0)), []).append(s)
    version = ev.get("plan_version", 1)
    hosts = ev.get("optimizer_hosts") or []
    opt = (
        f"optimizer state on {len(hosts)} optimizer host(s)"
        if ev.get("offload")
        else "optimizer state on the workers"
    )
    head = "plan" if version == 1 else f"new plan (version {version})"
    lines = [
        f"  {head} ({ev.get('planner', 'simple')} planner): {len(pipelines)} pipeline(s) over "
        f"{len(stages)} worker(s), {opt}"
    ]
    chosen = ((ev.get("prediction") or {}).get("sync") or {}).get("chosen")
    if chosen:
        lines.append(
            f"    rounds of H = {chosen['inner_steps']} steps, chosen for a sync budget of {chosen['budget']:.0%}: "
            f"the exchange is {chosen['share']:.1%} of a {chosen['step_s']:.3f} s step (simulated), a round "
            f"{chosen['round_s']:.3f} s" + ("" if chosen["fits"] else "; over budget at the longest round")
        )
    for replica, rows in sorted(pipelines.items()):
        for s in sorted(rows, key=lambda s: s.get("pos", 0)):
            lines.append(
                f"    pipeline {replica} stage {s.get('pos', 0)}: OP-DAG nodes [{s['lo']}, {s['hi']}) "
                f"on {short_peer(s['peer'])} ({s['n_params']} parameter tensors)"
            )
    return lines


def _why(reason: Any) -> str:
    """A peer's error as part of a sentence: the transport's "peer X… refused 'job.step': PeerError: ..."
    becomes "it refused job.step: ..."."""
    text = str(reason or "no reason given")
    text = re.sub(r"peer \S+ refused '([\w.]+)': (?:\w+Error: )?", r"it refused \1: ", text)
    return text[:300]


def format_event(ev: dict[str, Any]) -> str:
    """A job event as a sentence: who failed or left, what was re-planned, how long recovery took."""
    kind = ev.get("kind")
    at = f"step {ev['step']}: " if ev.get("step") is not None else ""
    who = f"{ev.get('role') or 'worker'} {short_peer(ev['peer'])}" if ev.get("peer") else ""
    if kind == "refused":
        return f"worker {short_peer(ev['peer'])} declined its stage ({_why(ev.get('reason'))}); planning without it"
    if kind == "failure" and who:
        ban = f"; it is left out of plans for {ev['ban_s']:.0f} s" if ev.get("ban_s") else ""
        return f"{at}{who} failed ({_why(ev.get('reason'))}){ban}"
    if kind == "failure":
        return f"{at}a step failed but every peer still answers ({_why(ev.get('reason'))}); retrying"
    if kind == "leave":
        return f"{at}{who} left the swarm (it finished its work in flight first)"
    if kind == "join":
        return f"{at}worker {short_peer(ev['peer'])} joined the swarm"
    if kind == "recovered":
        took = ev.get("time_to_recover_s")
        since = ev.get("since_failure_s")
        timing = f" in {took:.2f} s" if took is not None else ""
        timing += f" ({since:.2f} s after the failure)" if since is not None else ""
        return f"{at}recovered{timing}: {ev.get('reason', '')}"
    if kind == "replan":
        moved = f"; moving the stages took {ev['move_s']:.2f} s" if ev.get("move_s") is not None else ""
        return f"{at}re-planned (plan version {ev.get('plan_version')}): {ev.get('reason', '')}{moved}"
    if kind == "notice":
        return f"{at}{ev.get('reason', '')}"
    if kind == "scored":  # a round's contributions judged (--contrib-policy score)
        dropped = [r for r, v in enumerate(ev.get("verdict") or []) if v == 0]
        verdict = f"dropped replica(s) {dropped}" if dropped else "every replica kept"
        why = f" (not scored: {ev['error']})" if ev.get("error") else f", loss gains {ev.get('scores')}"
        return f"round {ev.get('round')}: {verdict}{why}"
    if ev.get("reason"):
        return f"{at}{str(kind).replace('_', ' ')}: {ev['reason']}"
    return f"{at}{kind}: " + ", ".join(f"{k}={v}" for k, v in ev.items() if k not in ("type", "kind"))


def next_steps(checkpoint: str) -> str:
    """The commands to try on a checkpoint just written."""
    return (
        f"next:       fusionnode generate --checkpoint {checkpoint} --prompt 'def '\n"
        f"            fusionnode export --checkpoint {checkpoint} --out model.safetensors"
    )


def describe_availability(command: str, res: dict[str, Any]) -> str:
    """What `pause` or `resume` did, as a sentence (a resume can leave the peer paused by its schedule
    or its owner's activity: then it says so, and until when)."""
    if res.get("availability") != "paused":
        return "resumed: this peer contributes again"
    if command == "pause":
        return (
            "paused: work in flight finished and this peer's stages were released; "
            "`fusionnode resume` to contribute again"
        )
    reason = res.get("reason")
    if reason == "schedule":
        until = f" until {res['next_window']}" if res.get("next_window") else ""
        why = f"it is outside its --schedule {res.get('schedule')} and stays paused{until}"
    elif reason == "owner":
        why = "its owner is using the machine (--when idle): it stays paused until the machine is idle"
    else:
        why = f"it stays paused ({reason})"
    return f"not resumed: the manual pause is lifted, but {why}"
