"""The swarm as the planner sees it: a cluster document built from the peers' DHT records (their
advertised device figures, bounded by what this driver measured) and the links they probed."""

from __future__ import annotations

import statistics
from typing import Any

from fusionnode.train.rebalance import planning_tflops

DEFAULT_UNMEASURED_GBPS = 1.0  # link bandwidth assumed between peers whose link nobody probed yet
# a peer whose speed is under this fraction of the median of the others' is a clear straggler (one
# that sleeps, throttles or is starved), not the up to 2x that one CPU's peers differ by as its other
# load moves (the driver's own peer runs ~2x slower on one machine); on a shared machine it keeps its
# own figure, and train/escalate.py asks the planner about it
OUTLIER = 0.35


def outliers(speeds: dict[str, float] | Any, peers: list[str] | Any) -> list[str]:
    """The peers of `peers` measured under OUTLIER x the median speed of the other measured ones
    (peers not measured are not judged; with one other, its speed is the median)."""
    known = {p: speeds[p] for p in peers if speeds.get(p, 0) > 0}
    out = []
    for p, v in known.items():
        others = [w for q, w in known.items() if q != p]
        if others and v < OUTLIER * statistics.median(others):
            out.append(p)
    return out


def symmetric_links(records: list[Any]) -> dict[tuple[str, str], tuple[float, float]]:
    """(a, b) and (b, a) -> (bits/s, rtt s) of each probed link, bounded by what probes measured
    (SECURITY.md, attack 8): where both ends report it, the smaller bandwidth and the larger RTT, so
    one peer cannot advertise a link faster than the probe of the peer at its other end measured it;
    a link only one end reports is at most the fastest link that both of its ends measured (or
    DEFAULT_UNMEASURED_GBPS when no link is measured from both ends)."""
    out: dict[tuple[str, str], tuple[float, float]] = {}
    ends: dict[tuple[str, str], set[str]] = {}
    for rec in records:
        for other, m in (rec.links or {}).items():
            if m.bandwidth_bps <= 0 or other == rec.peer_id:
                continue
            key = (rec.peer_id, other) if rec.peer_id < other else (other, rec.peer_id)
            bps, rtt = float(m.bandwidth_bps), float(m.rtt_s)
            if key in out:
                bps, rtt = min(bps, out[key][0]), max(rtt, out[key][1])
            out[key] = out[key[::-1]] = (bps, rtt)
            ends.setdefault(key, set()).add(rec.peer_id)
    both = [out[k][0] for k, e in ends.items() if len(e) == 2]
    cap = max(both) if both else DEFAULT_UNMEASURED_GBPS * 1e9
    for key, e in ends.items():
        if len(e) < 2 and out[key][0] > cap:
            out[key] = out[key[::-1]] = (cap, out[key][1])
    return out


def host_key(maddrs: Any) -> str:
    """The machine a peer runs on, as far as its record tells: the sorted IP addresses it listens on
    (relay addresses left out). Peers that advertise the same set (every peer of a local swarm
    advertises 127.0.0.1 only) run on one machine; "" when it advertises none."""
    ips = set()
    for a in maddrs or ():
        parts = str(a).split("/")
        if "p2p-circuit" not in parts and len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            ips.add(parts[2])
    return ",".join(sorted(ips))


def shared_hosts(records: list[Any], ids: list[str]) -> dict[str, str]:
    """peer id -> host key for the CPU peers among `ids` that share a machine with another of them
    (plan/shared.py prices their shared cores); peers alone on their machine are left out."""
    by_id = {r.peer_id: r for r in records}
    groups: dict[str, list[str]] = {}
    for pid in ids:
        rec = by_id[pid]
        key = host_key(getattr(rec, "maddrs", ()))
        if key and getattr(rec.device, "kind", "") == "cpu":
            groups.setdefault(key, []).append(pid)
    return {pid: key for key, members in groups.items() if len(members) > 1 for pid in members}


def cluster_from_records(
    records: list[Any],
    workers: list[str],
    hosts: list[str],
    measured: dict[str, float] | None = None,
) -> dict[str, Any]:
    """A cluster document (protocol/CLUSTER.md) of live peers: TFLOPS, offered memory, probed links.

    TFLOPS are the peers' advertised figures only as far as `rebalance.planning_tflops` allows:
    replaced by `measured` speeds (the driver's table of stage times, any job, any layout) and
    otherwise capped relative to them; links are bounded by the probes (`symmetric_links`). CPU peers
    of one machine (`shared_hosts`) are marked with its `host` and `cores` and planned at one speed,
    the median of theirs: one CPU, whose peers' figures differ by what the others ran meanwhile;
    except a clear straggler (`outliers`, among the measured peers), which keeps its own and is left
    out of that median (of the measured figures, where any)."""
    devices, pairs, seen = [], [], set()
    by_id = {r.peer_id: r for r in records}
    ids = list(dict.fromkeys([*workers, *hosts]))
    tflops = planning_tflops(
        {pid: max(float(by_id[pid].device.tflops_fp32), 1e-4) for pid in ids},
        {p: v for p, v in (measured or {}).items() if p in ids},
    )
    host_of = shared_hosts(records, ids)
    known = {p for p, v in (measured or {}).items() if p in ids and v > 0}
    for key in set(host_of.values()):
        members = [p for p, k in host_of.items() if k == key]
        # judged among the measured peers only: an unmeasured one's figure is its advertisement
        # (capped), no speed to compare a measured straggler with
        slow = set(outliers({p: tflops[p] for p in members if p in known}, members))
        # the machine's speed from what was measured on it where anything was (an idle peer's figure
        # is its advertisement), else from the advertisements
        base = [p for p in members if p not in slow and p in known] or [p for p in members if p not in slow]
        speed = statistics.median(tflops[p] for p in base)
        tflops.update({p: speed for p in members if p not in slow})
    for pid in dict.fromkeys([*workers, *hosts]):
        rec = by_id[pid]
        roles = [
            r
            for r in ("worker", "optimizer")
            if (r == "worker" and pid in workers) or (r == "optimizer" and pid in hosts)
        ]
        device = {
            "id": pid,
            "tflops": max(tflops[pid], 1e-4),
            "memory_gb": rec.capacity_bytes / 1e9,
            "roles": roles,
        }
        if pid in host_of:
            device.update(host=host_of[pid], cores=int(rec.device.cpu_count))
        devices.append(device)
    measured = symmetric_links(records)
    relayed = {  # links through a circuit relay (issue 22): priced by their measured bandwidth, flagged
        frozenset((r.peer_id, o))
        for r in records
        for o, m in (r.links or {}).items()
        if getattr(m, "relayed", False)
    }
    for (a, b), (bps, rtt_s) in sorted(measured.items()):
        # the document's devices only: a live peer the job leaves out (`train --peers`) is no device
        if a < b and a in ids and b in ids and (a, b) not in seen:
            seen.add((a, b))
            pair = {"a": a, "b": b, "bandwidth_gbps": bps / 1e9, "latency_ms": rtt_s * 500.0}
            if frozenset((a, b)) in relayed:
                pair["relayed"] = True
            pairs.append(pair)
    return {
        "version": 1,
        "name": "swarm",
        "devices": devices,
        "links": {
            "inter_site": {"bandwidth_gbps": DEFAULT_UNMEASURED_GBPS, "latency_ms": 1.0},
            "pairs": pairs,
        },
    }


def cluster_links(doc: dict[str, Any]) -> dict[tuple[str, str], float]:
    """(from, to) -> bits/s of every device pair of a cluster document (what a testbed emulates)."""
    from fusionnode.plan.cluster import load_cluster_dict

    c = load_cluster_dict(doc, "cluster")
    ids = [d.id for d in c.devices]
    return {
        (a, b): float(c.bandwidth_bps[i, j]) for i, a in enumerate(ids) for j, b in enumerate(ids) if i != j
    }
