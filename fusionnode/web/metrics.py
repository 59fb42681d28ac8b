"""The Prometheus view of a node's status: one collector that turns the status dict into gauges."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


def _num(x: Any) -> float | None:
    """A finite float, or None for missing / non-numeric / NaN values (Prometheus gets no sample)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def job_history(status: dict[str, Any], job: dict[str, Any]) -> list[dict[str, Any]]:
    """The step records of a job: ``job["history"]``, else ``status["history"][job_id]``, else []."""
    hist = job.get("history")
    if hist is None:
        hist = (
            (status.get("history") or {}).get(job.get("job"))
            if isinstance(status.get("history"), dict)
            else None
        )
    return list(hist or [])


class StatusCollector(Collector):
    """Prometheus collector over the latest status dict (set by the server before each scrape)."""

    def __init__(self) -> None:
        self.status: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        s = self.status
        peers = [p for p in s.get("peers") or [] if isinstance(p, dict)]
        jobs = [j for j in s.get("jobs") or [] if isinstance(j, dict)]

        up = GaugeMetricFamily("fusionnode_uptime_seconds", "Seconds since this daemon started")
        if _num(s.get("uptime_s")) is not None:
            up.add_metric([], _num(s.get("uptime_s")))
        yield up
        yield GaugeMetricFamily(
            "fusionnode_peers", "Peers this daemon sees in the swarm (itself included)", value=len(peers)
        )

        info = GaugeMetricFamily(
            "fusionnode_peer_info",
            "One sample per known peer (value 1)",
            labels=["peer", "kind", "device", "roles", "availability"],
        )
        tflops = GaugeMetricFamily(
            "fusionnode_peer_tflops_fp32", "Measured fp32 TFLOP/s of each peer", labels=["peer"]
        )
        bw = GaugeMetricFamily(
            "fusionnode_link_bandwidth_bits_per_second",
            "Measured bandwidth from one peer to another",
            labels=["src", "dst"],
        )
        rtt = GaugeMetricFamily(
            "fusionnode_link_rtt_seconds", "Measured round-trip time between peers", labels=["src", "dst"]
        )
        for p in peers:
            pid = str(p.get("peer_id", ""))
            dev = p.get("device") or {}
            info.add_metric(
                [
                    pid,
                    str(dev.get("kind", "")),
                    str(dev.get("name", "")),
                    ",".join(map(str, p.get("roles") or [])),
                    str(p.get("availability", "")),
                ],
                1,
            )
            if _num(dev.get("tflops_fp32")) is not None:
                tflops.add_metric([pid], _num(dev.get("tflops_fp32")))
            for dst, link in (p.get("links") or {}).items():
                if not isinstance(link, dict):
                    continue
                if _num(link.get("bandwidth_bps")) is not None:
                    bw.add_metric([pid, str(dst)], _num(link.get("bandwidth_bps")))
                if _num(link.get("rtt_s")) is not None:
                    rtt.add_metric([pid, str(dst)], _num(link.get("rtt_s")))
        yield from (info, tflops, bw, rtt)

        serving = GaugeMetricFamily(
            "fusionnode_serving_last_step",
            "Last step this peer ran for a stage it serves",
            labels=["job", "stage"],
        )
        for sv in s.get("serving") or []:
            if isinstance(sv, dict) and _num(sv.get("last_step")) is not None:
                serving.add_metric(
                    [str(sv.get("job", "")), str(sv.get("stage", ""))], _num(sv.get("last_step"))
                )
        yield serving

        fams = {
            "step": GaugeMetricFamily(
                "fusionnode_job_step", "Steps done by a job this peer drives", labels=["job"]
            ),
            "steps": GaugeMetricFamily(
                "fusionnode_job_steps_target", "Steps a job is asked to run", labels=["job"]
            ),
            "loss": GaugeMetricFamily(
                "fusionnode_job_loss", "Training loss of the last step", labels=["job"]
            ),
            "tokens_per_s": GaugeMetricFamily(
                "fusionnode_job_tokens_per_second", "Mean training throughput of a job", labels=["job"]
            ),
            "plan_version": GaugeMetricFamily(
                "fusionnode_job_plan_version", "Plan version in force", labels=["job"]
            ),
        }
        state = GaugeMetricFamily(
            "fusionnode_job_info", "One sample per driven job (value 1)", labels=["job", "model", "state"]
        )
        stages = GaugeMetricFamily("fusionnode_job_stages", "Pipeline stages of a job's plan", labels=["job"])
        wire = GaugeMetricFamily(
            "fusionnode_job_wire_bytes", "Bytes on the wire (all peers) in the last step", labels=["job"]
        )
        step_time = GaugeMetricFamily(
            "fusionnode_job_step_time_seconds", "Wall time of the last step", labels=["job"]
        )
        compute = GaugeMetricFamily(
            "fusionnode_stage_compute_seconds",
            "Compute time of a stage in the last step",
            labels=["job", "stage", "peer"],
        )
        wait = GaugeMetricFamily(
            "fusionnode_stage_wait_seconds",
            "Time a stage waited in the last step",
            labels=["job", "stage", "peer"],
        )
        util = GaugeMetricFamily(
            "fusionnode_stage_utilization_ratio",
            "compute_s / step_time_s of a stage in the last step",
            labels=["job", "stage", "peer"],
        )
        bubble = GaugeMetricFamily(
            "fusionnode_stage_bubble_ratio",
            "wait_s / step_time_s of a stage in the last step (idle, waiting for its neighbours)",
            labels=["job", "stage", "peer"],
        )
        link_labels = ["job", "stage", "direction", "src", "dst"]
        dense = GaugeMetricFamily(
            "fusionnode_link_dense_bytes",
            "Bytes a stage's link carried before compression, since the plan started",
            labels=link_labels,
        )
        wired = GaugeMetricFamily(
            "fusionnode_link_wire_bytes",
            "Bytes a stage's link carried after compression, since the plan started",
            labels=link_labels,
        )
        keep = GaugeMetricFamily(
            "fusionnode_link_keep_ratio",
            "Fraction of values the link's codec kept in the last step (1 = dense)",
            labels=link_labels,
        )
        for j in jobs:
            jid = str(j.get("job", ""))
            for key, fam in fams.items():
                if _num(j.get(key)) is not None:
                    fam.add_metric([jid], _num(j.get(key)))
            state.add_metric([jid, str(j.get("model", "")), str(j.get("state", ""))], 1)
            plan = [st for st in j.get("stages") or [] if isinstance(st, dict)]
            stages.add_metric([jid], len(plan))
            peer_of = {str(st.get("stage")): str(st.get("peer", "")) for st in plan}
            neighbours = stage_neighbours(plan)
            hist = job_history(s, j)
            if not hist or not isinstance(hist[-1], dict):
                continue
            last = hist[-1]
            if _num(last.get("wire_bytes")) is not None:
                wire.add_metric([jid], _num(last.get("wire_bytes")))
            st_time = _num(last.get("step_time_s"))
            if st_time is not None:
                step_time.add_metric([jid], st_time)
            for rec in last.get("stages") or []:
                if not isinstance(rec, dict):
                    continue
                labels = [jid, str(rec.get("stage", "")), peer_of.get(str(rec.get("stage")), "")]
                c, w = _num(rec.get("compute_s")), _num(rec.get("wait_s"))
                if c is not None:
                    compute.add_metric(labels, c)
                    if st_time:
                        util.add_metric(labels, c / st_time)
                if w is not None:
                    wait.add_metric(labels, w)
                    if st_time:
                        bubble.add_metric(labels, w / st_time)
                for link in stage_links(rec, peer_of, neighbours):
                    ll = [jid, link["stage"], link["direction"], link["src"], link["dst"]]
                    for fam, key in ((dense, "dense_bytes"), (wired, "wire_bytes"), (keep, "ratio")):
                        if _num(link.get(key)) is not None:
                            fam.add_metric(ll, _num(link[key]))
        yield from (*fams.values(), state, stages, wire, step_time, compute, wait, util, bubble)
        yield from (dense, wired, keep)


def stage_neighbours(plan: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """stage -> {"fwd": peer of the next stage, "bwd": peer of the previous one} in its pipeline."""
    at = {(st.get("replica", 0), st.get("pos", st.get("stage"))): st for st in plan}
    out: dict[str, dict[str, str]] = {}
    for (rep, pos), st in at.items():
        nb = {}
        if isinstance(pos, int):
            for direction, other in (("fwd", pos + 1), ("bwd", pos - 1)):
                if (rep, other) in at:
                    nb[direction] = str(at[(rep, other)].get("peer", ""))
        out[str(st.get("stage"))] = nb
    return out


def stage_links(
    rec: dict[str, Any], peer_of: dict[str, str], neighbours: dict[str, dict[str, str]]
) -> list[dict[str, Any]]:
    """The links of one stage record that carried bytes: its counters with the peers at both ends."""
    stage = str(rec.get("stage", ""))
    out = []
    for direction, counters in (rec.get("links") or {}).items():
        dst = neighbours.get(stage, {}).get(direction)
        if not isinstance(counters, dict) or dst is None or not counters.get("dense_bytes"):
            continue
        src = str(rec.get("peer") or peer_of.get(stage, ""))
        out.append({"stage": stage, "direction": str(direction), "src": src, "dst": dst, **counters})
    return out


def json_safe(obj: Any) -> Any:
    """A copy with NaN and infinities replaced by None: browsers' JSON.parse rejects them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj
