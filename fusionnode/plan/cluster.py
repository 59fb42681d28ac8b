"""Cluster description: devices and the links between them, loaded from JSON (protocol/CLUSTER.md).

A `Cluster` is pure data: device list plus dense bandwidth (bit/s) and latency (s) matrices.
Links come from, in increasing priority: the intra-site / inter-site defaults, per-site pairs,
per-device pairs, a full matrix; each device's optional `uplink_gbps` then caps every link it is on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from fusionnode.errors import ConfigError

log = logging.getLogger(__name__)

CLUSTER_FORMAT_VERSION = 1
DEFAULT_INTRA_SITE_GBPS = 10.0  # Gbit/s between two devices of one site when nothing is said
DEFAULT_INTRA_SITE_LATENCY_MS = 0.1  # ms
DEFAULT_INTER_SITE_GBPS = 0.1  # Gbit/s between sites when nothing is said
DEFAULT_INTER_SITE_LATENCY_MS = 30.0  # ms
DEFAULT_RAM_FACTOR = 2.0  # host RAM assumed = this x device memory when `ram_gb` is absent
MAX_DEVICES = 100_000  # refuse larger cluster files before building N x N matrices
ROLES = ("worker", "optimizer")
SELF_BANDWIDTH_BPS = 1e15  # bit/s: a device "talking to itself" (same-device host traffic)


@dataclasses.dataclass(frozen=True)
class Device:
    id: str
    tflops: float  # dense peak TFLOP/s in the training dtype
    memory_gb: float  # accelerator memory, GB (1e9 bytes)
    site: str  # "" when not given: every such device is its own site
    roles: tuple[str, ...] = ROLES
    ram_gb: float = 0.0  # host RAM for optimizer state, GB
    uplink_gbps: float = 0.0  # access-link cap, Gbit/s; 0 = no cap
    host: str = ""  # machine it runs on: devices of one host share its CPU cores ("" = its own)
    cores: int = 0  # CPU cores of that host (0: not shared, see plan/shared.py)

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def is_worker(self) -> bool:
        return "worker" in self.roles

    @property
    def is_optimizer(self) -> bool:
        return "optimizer" in self.roles


@dataclasses.dataclass(frozen=True, eq=False)
class Cluster:
    name: str
    devices: tuple[Device, ...]
    bandwidth_bps: np.ndarray  # [i, j] bit/s from device i to device j (diagonal: SELF_BANDWIDTH_BPS)
    latency_s: np.ndarray  # [i, j] seconds (diagonal 0)
    step_overhead_s: float = 0.0  # the runtime's fixed cost per training step (measured; 0 if unknown)

    def __post_init__(self) -> None:
        self.bandwidth_bps.setflags(write=False)
        self.latency_s.setflags(write=False)

    @property
    def size(self) -> int:
        return len(self.devices)

    def index(self, device_id: str) -> int:
        return self._index[device_id]

    @property
    def _index(self) -> dict[str, int]:
        cached = self.__dict__.get("_index_cache")
        if cached is None:
            cached = {d.id: i for i, d in enumerate(self.devices)}
            object.__setattr__(self, "_index_cache", cached)
        return cached

    def subset(self, indices: Sequence[int], name: str | None = None) -> Cluster:
        idx = np.asarray(indices, dtype=int)
        return Cluster(
            name=name or self.name,
            devices=tuple(self.devices[i] for i in idx),
            bandwidth_bps=self.bandwidth_bps[np.ix_(idx, idx)].copy(),
            latency_s=self.latency_s[np.ix_(idx, idx)].copy(),
            step_overhead_s=self.step_overhead_s,
        )


def _num(
    d: Mapping[str, Any], key: str, where: str, *, positive: bool = True, default: float | None = None
) -> float:
    if key not in d:
        if default is not None:
            return default
        raise ConfigError(f"{where}: missing field {key!r}")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{where}: {key!r} must be a finite number, got {v!r}")
    if positive and v <= 0:
        raise ConfigError(f"{where}: {key!r} must be > 0, got {v!r}")
    if not positive and v < 0:
        raise ConfigError(f"{where}: {key!r} must be >= 0, got {v!r}")
    return float(v)


def _link(d: Any, where: str) -> tuple[float, float]:
    """-> (bit/s, seconds) from {"bandwidth_gbps": .., "latency_ms": ..}."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where}: expected an object with bandwidth_gbps and latency_ms, got {d!r}")
    bw = _num(d, "bandwidth_gbps", where)
    lat = _num(d, "latency_ms", where, positive=False, default=0.0)
    return bw * 1e9, lat / 1e3


def _devices(raw: Any) -> list[Device]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError("cluster: 'devices' must be a non-empty list")
    out: list[Device] = []
    for k, d in enumerate(raw):
        where = f"devices[{k}]"
        if not isinstance(d, Mapping):
            raise ConfigError(f"{where}: expected an object, got {d!r}")
        did = d.get("id")
        if not isinstance(did, str) or not did:
            raise ConfigError(f"{where}: missing or empty string field 'id'")
        where = f"device {did!r}"
        count = d.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"{where}: 'count' must be a positive integer, got {count!r}")
        tflops = _num(d, "tflops", where)
        mem = _num(d, "memory_gb", where)
        site = d.get("site", "")
        if not isinstance(site, str):
            raise ConfigError(f"{where}: 'site' must be a string")
        roles = d.get("roles", list(ROLES))
        if not isinstance(roles, list) or not roles or any(r not in ROLES for r in roles):
            raise ConfigError(
                f"{where}: 'roles' must be a non-empty list drawn from {list(ROLES)}, got {roles!r}"
            )
        ram = _num(d, "ram_gb", where, default=DEFAULT_RAM_FACTOR * mem)
        uplink = _num(d, "uplink_gbps", where, default=0.0, positive=False)
        if "uplink_gbps" in d and uplink <= 0:
            raise ConfigError(f"{where}: 'uplink_gbps' must be > 0, got {uplink!r}")
        host = d.get("host", "")
        if not isinstance(host, str):
            raise ConfigError(f"{where}: 'host' must be a string")
        cores = d.get("cores", 0)
        if isinstance(cores, bool) or not isinstance(cores, int) or cores < 0:
            raise ConfigError(f"{where}: 'cores' must be a non-negative integer, got {cores!r}")
        ids = [did] if count == 1 else [f"{did}-{i}" for i in range(count)]
        for one in ids:
            out.append(Device(one, tflops, mem, site, tuple(roles), ram, uplink, host, cores))
    if len(out) > MAX_DEVICES:
        raise ConfigError(f"cluster: {len(out)} devices, more than the limit of {MAX_DEVICES}")
    seen: set[str] = set()
    for dev in out:
        if dev.id in seen:
            raise ConfigError(f"cluster: duplicate device id {dev.id!r}")
        seen.add(dev.id)
    return out


def load_cluster_dict(d: Any, name: str = "cluster") -> Cluster:
    """Build a Cluster from a parsed cluster document (see protocol/cluster.schema.json)."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{name}: a cluster document must be a JSON object")
    version = d.get("version", CLUSTER_FORMAT_VERSION)
    if version != CLUSTER_FORMAT_VERSION:
        raise ConfigError(f"{name}: cluster format version {version!r} is not supported (expected 1)")
    name = str(d.get("name", name))
    devs = _devices(d.get("devices"))
    n = len(devs)
    links = d.get("links", {})
    if not isinstance(links, Mapping):
        raise ConfigError(f"{name}: 'links' must be an object")
    unknown = set(links) - {"intra_site", "inter_site", "sites", "pairs", "matrix"}
    if unknown:
        raise ConfigError(f"{name}: unknown key(s) in 'links': {sorted(unknown)}")
    intra = (
        _link(links["intra_site"], "links.intra_site")
        if "intra_site" in links
        else (
            DEFAULT_INTRA_SITE_GBPS * 1e9,
            DEFAULT_INTRA_SITE_LATENCY_MS / 1e3,
        )
    )
    inter = (
        _link(links["inter_site"], "links.inter_site")
        if "inter_site" in links
        else (
            DEFAULT_INTER_SITE_GBPS * 1e9,
            DEFAULT_INTER_SITE_LATENCY_MS / 1e3,
        )
    )
    # site codes: devices without a site are each their own site
    site_names = [dev.site if dev.site else f"\0{dev.id}" for dev in devs]
    codes = {s: i for i, s in enumerate(dict.fromkeys(site_names))}
    site_of = np.array([codes[s] for s in site_names])
    same = site_of[:, None] == site_of[None, :]
    bw = np.where(same, intra[0], inter[0]).astype(float)
    lat = np.where(same, intra[1], inter[1]).astype(float)

    sites = links.get("sites", [])
    if not isinstance(sites, list):
        raise ConfigError(f"{name}: links.sites must be a list")
    for k, p in enumerate(sites):
        where = f"links.sites[{k}]"
        if not isinstance(p, Mapping) or "a" not in p or "b" not in p:
            raise ConfigError(f"{where}: expected an object with 'a', 'b', 'bandwidth_gbps'")
        for s in (p["a"], p["b"]):
            if s not in codes:
                raise ConfigError(
                    f"{where}: unknown site {s!r} (known: {sorted(c for c in codes if c[:1] != chr(0))})"
                )
        b, l_ = _link(p, where)
        ma = site_of == codes[p["a"]]
        mb = site_of == codes[p["b"]]
        sel = np.outer(ma, mb) | np.outer(mb, ma)
        bw[sel] = b
        lat[sel] = l_

    index = {dev.id: i for i, dev in enumerate(devs)}
    pairs = links.get("pairs", [])
    if not isinstance(pairs, list):
        raise ConfigError(f"{name}: links.pairs must be a list")
    for k, p in enumerate(pairs):
        where = f"links.pairs[{k}]"
        if not isinstance(p, Mapping) or "a" not in p or "b" not in p:
            raise ConfigError(f"{where}: expected an object with 'a', 'b', 'bandwidth_gbps'")
        for s in (p["a"], p["b"]):
            if s not in index:
                raise ConfigError(f"{where}: unknown device {s!r}")
        b, l_ = _link(p, where)
        i, j = index[p["a"]], index[p["b"]]
        bw[i, j] = bw[j, i] = b
        lat[i, j] = lat[j, i] = l_

    if "matrix" in links:
        m = links["matrix"]
        if not isinstance(m, Mapping) or "bandwidth_gbps" not in m:
            raise ConfigError(
                f"{name}: links.matrix must have 'bandwidth_gbps' (and optionally 'latency_ms')"
            )
        for key, target, scale, positive in (
            ("bandwidth_gbps", bw, 1e9, True),
            ("latency_ms", lat, 1e-3, False),
        ):
            if key not in m:
                continue
            try:
                arr = np.asarray(m[key], dtype=float)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{name}: links.matrix.{key} is not a numeric matrix") from exc
            if arr.shape != (n, n):
                raise ConfigError(f"{name}: links.matrix.{key} must be {n} x {n}, got shape {arr.shape}")
            off = ~np.eye(n, dtype=bool)
            vals = arr[off]
            if not np.all(np.isfinite(vals)) or (np.any(vals <= 0) if positive else np.any(vals < 0)):
                raise ConfigError(
                    f"{name}: links.matrix.{key} has {'non-positive' if positive else 'negative'} or non-finite entries"
                )
            target[off] = vals * scale

    caps = np.array([dev.uplink_gbps * 1e9 if dev.uplink_gbps > 0 else np.inf for dev in devs])
    bw = np.minimum(bw, np.minimum(caps[:, None], caps[None, :]))
    np.fill_diagonal(bw, SELF_BANDWIDTH_BPS)
    np.fill_diagonal(lat, 0.0)
    if not any(dev.is_worker for dev in devs):
        raise ConfigError(f"{name}: no device has the 'worker' role")
    overhead = _num(d, "step_overhead_ms", name, positive=False, default=0.0) / 1e3
    return Cluster(name=name, devices=tuple(devs), bandwidth_bps=bw, latency_s=lat, step_overhead_s=overhead)


def subset_doc(doc: Mapping[str, Any], keep: set[str] | frozenset[str]) -> dict[str, Any]:
    """A cluster document of only the devices whose id is in `keep`: the device list, the rows and
    columns of a links matrix, and the device pairs are filtered alike (sites and defaults stay)."""
    devices = list(doc.get("devices", []))
    idx = [i for i, d in enumerate(devices) if d.get("id") in keep]
    out = dict(doc)
    out["devices"] = [devices[i] for i in idx]
    links = doc.get("links")
    if isinstance(links, Mapping):
        links = dict(links)
        matrix = links.get("matrix")
        if isinstance(matrix, Mapping):
            links["matrix"] = {
                key: [[rows[i][j] for j in idx] for i in idx] if isinstance(rows, list) else rows
                for key, rows in matrix.items()
            }
        if isinstance(links.get("pairs"), list):
            links["pairs"] = [p for p in links["pairs"] if p.get("a") in keep and p.get("b") in keep]
        out["links"] = links
    return out


def bundled_clusters() -> list[str]:
    """Names (file stems) of the example clusters shipped with the package."""
    root = resources.files("fusionnode.plan") / "clusters"
    return sorted(p.name[: -len(".json")] for p in root.iterdir() if p.name.endswith(".json"))


def load_cluster(path_or_name: str | Path) -> Cluster:
    """Load a cluster file, or a bundled example by its stem (e.g. "geo-48")."""
    p = Path(path_or_name)
    if p.is_file():
        text, name = p.read_text(), p.stem
    else:
        stem = str(path_or_name)
        res = resources.files("fusionnode.plan") / "clusters" / f"{stem}.json"
        if "/" in stem or not res.is_file():
            raise ConfigError(
                f"cluster {str(path_or_name)!r}: no such file and no bundled cluster of that name "
                f"(bundled: {', '.join(bundled_clusters())})"
            )
        text, name = res.read_text(), stem
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"cluster {str(path_or_name)!r}: malformed JSON: {exc}") from exc
    return load_cluster_dict(doc, name=name)
