"""DT-FM's five evaluation settings (Yuan et al., NeurIPS 2022, sec. 4), rebuilt as cluster documents.

64 identical V100-class GPUs (16 GB, 125 TFLOP/s fp16 peak, 61 GB host RAM each: an AWS p3 GPU's
share) on the delays and bandwidths the paper reports (and its scheduler's configuration lists):

* ``dtfm-datacenter``: 8 instances of 8 GPUs; 100 GB/s (800 Gbit/s) inside an instance, 25 Gbit/s
  between instances, no delay;
* ``dtfm-spot``: 8 instances of 4 GPUs plus 32 single-GPU instances; 100 GB/s inside an instance,
  10 Gbit/s between instances, no delay;
* ``dtfm-universities``: two campuses (Ohio, Virginia) of 32 GPUs; 5 Gbit/s and 1 ms inside a
  campus, 1.12 Gbit/s and 11 ms between;
* ``dtfm-regional``: four US regions of 16 GPUs (Virginia, Oregon, California, Ohio); 2 Gbit/s and
  5 ms inside a region, 1.02-1.25 Gbit/s and 11-67 ms between;
* ``dtfm-worldwide``: eight regions of 8 GPUs (Oregon, Virginia, Ohio, Tokyo, Seoul, London,
  Frankfurt, Ireland); 2 Gbit/s and 5 ms inside a region, 0.34-1.16 Gbit/s and 11-238 ms between
  (the paper's measured AWS region pairs).

The data-centre figures are given in GB/s by DT-FM's scheduler configuration (3.125 and 1.25, i.e.
25 and 10 Gbit/s as the paper states); the others in Gbit/s.

`with_activation_bytes` rescales a traced OP-DAG's float tensors (e.g. 0.5 for fp16 activations,
as DT-FM trains in fp16); parameters stay as they are.
"""

from __future__ import annotations

import dataclasses

from fusionnode.graph.dag import OpGraph

DEVICES = 64
V100 = {"tflops": 125.0, "memory_gb": 16.0, "ram_gb": 61.0}

# (delay ms, bandwidth Gbit/s) between AWS regions, as DT-FM's paper and scheduler list them
REGION_LINKS = {
    ("Oregon", "Virginia"): (67, 0.79),
    ("Oregon", "Ohio"): (49, 1.10),
    ("Oregon", "Tokyo"): (96, 0.523),
    ("Oregon", "Seoul"): (124, 0.46),
    ("Oregon", "London"): (136, 0.42),
    ("Oregon", "Frankfurt"): (143, 0.404),
    ("Oregon", "Ireland"): (124, 0.482),
    ("Virginia", "Ohio"): (11, 1.12),
    ("Virginia", "Tokyo"): (143, 0.524),
    ("Virginia", "Seoul"): (172, 0.500),
    ("Virginia", "London"): (76, 1.16),
    ("Virginia", "Frankfurt"): (90, 1.02),
    ("Virginia", "Ireland"): (67, 1.05),
    ("Ohio", "Tokyo"): (130, 0.694),
    ("Ohio", "Seoul"): (159, 0.529),
    ("Ohio", "London"): (86, 1.05),
    ("Ohio", "Frankfurt"): (99, 0.799),
    ("Ohio", "Ireland"): (77, 1.14),
    ("Tokyo", "Seoul"): (34, 1.10),
    ("Tokyo", "London"): (210, 0.366),
    ("Tokyo", "Frankfurt"): (223, 0.36),
    ("Tokyo", "Ireland"): (199, 0.465),
    ("Seoul", "London"): (238, 0.342),
    ("Seoul", "Frankfurt"): (235, 0.358),
    ("Seoul", "Ireland"): (228, 0.335),
    ("London", "Frankfurt"): (14, 1.14),
    ("London", "Ireland"): (12, 1.09),
    ("Frankfurt", "Ireland"): (24, 1.08),
    # the regional setting's California links
    ("Virginia", "California"): (59, 1.05),
    ("Oregon", "California"): (12, 1.25),
    ("California", "Ohio"): (52, 1.02),
}
# the regional setting's Virginia-Oregon link as its configuration gives it (the measured table: 0.79)
REGIONAL_OVERRIDES = {("Virginia", "Oregon"): (67, 1.15)}


def _doc(name: str, description: str, sites: list[str], links: dict) -> dict:
    devices = [{"id": f"g{i:02d}", "site": s, **V100} for i, s in enumerate(sites)]
    return {"version": 1, "name": name, "description": description, "devices": devices, "links": links}


def _pair(a: str, b: str, table: dict) -> tuple[float, float]:
    return table.get((a, b)) or table.get((b, a)) or REGION_LINKS.get((a, b)) or REGION_LINKS[(b, a)]


def _regions(
    name: str, description: str, regions: list[str], per: int, inside: tuple[float, float], table: dict
) -> dict:
    sites = [r for r in regions for _ in range(per)]
    pairs = []
    for i, a in enumerate(regions):
        for b in regions[i + 1 :]:
            delay, gbps = _pair(a, b, table)
            pairs.append({"a": a, "b": b, "bandwidth_gbps": gbps, "latency_ms": delay})
    links = {"intra_site": {"bandwidth_gbps": inside[1], "latency_ms": inside[0]}, "sites": pairs}
    return _doc(name, description, sites, links)


def scenario(name: str) -> dict:
    """The cluster document of one of DT-FM's settings (see SCENARIOS)."""
    if name == "dtfm-datacenter":
        sites = [f"instance-{i // 8}" for i in range(DEVICES)]
        links = {
            "intra_site": {"bandwidth_gbps": 800.0, "latency_ms": 0.0},
            "inter_site": {"bandwidth_gbps": 25.0, "latency_ms": 0.0},
        }
        return _doc(name, "DT-FM case 1: on-demand data centre, 8 x 8 V100", sites, links)
    if name == "dtfm-spot":
        sites = [f"spot-{i // 4}" if i < 32 else f"single-{i}" for i in range(DEVICES)]
        links = {
            "intra_site": {"bandwidth_gbps": 800.0, "latency_ms": 0.0},
            "inter_site": {"bandwidth_gbps": 10.0, "latency_ms": 0.0},
        }
        return _doc(name, "DT-FM case 2: spot instances, 8 x 4 V100 + 32 x 1 V100", sites, links)
    if name == "dtfm-universities":
        return _regions(
            name, "DT-FM case 3: two universities, 2 x 32 V100", ["Ohio", "Virginia"], 32, (1.0, 5.0), {}
        )
    if name == "dtfm-regional":
        return _regions(
            name,
            "DT-FM case 4: regional, 4 US regions x 16 V100",
            ["Virginia", "Oregon", "California", "Ohio"],
            16,
            (5.0, 2.0),
            REGIONAL_OVERRIDES,
        )
    if name == "dtfm-worldwide":
        cities = ["Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt", "Ireland"]
        return _regions(name, "DT-FM case 5: worldwide, 8 regions x 8 V100", cities, 8, (5.0, 2.0), {})
    raise KeyError(f"unknown DT-FM scenario {name!r} (known: {', '.join(SCENARIOS)})")


SCENARIOS = ("dtfm-datacenter", "dtfm-spot", "dtfm-universities", "dtfm-regional", "dtfm-worldwide")
IRREGULAR = ("dtfm-regional", "dtfm-worldwide")  # the settings whose links are uneven


def with_activation_bytes(graph: OpGraph, factor: float) -> OpGraph:
    """`graph` with every float tensor's bytes scaled by `factor` (0.5: fp16 activations)."""

    def floating(nd) -> bool:
        return nd.out_dtype.startswith("float") or nd.out_dtype in ("bfloat16", "half")

    nodes = tuple(
        dataclasses.replace(nd, out_bytes=round(nd.out_bytes * factor)) if floating(nd) else nd
        for nd in graph.nodes
    )
    edges = tuple(
        dataclasses.replace(e, bytes=round(e.bytes * factor)) if floating(graph.nodes[e.src]) else e
        for e in graph.edges
    )
    return dataclasses.replace(graph, nodes=nodes, edges=edges)
