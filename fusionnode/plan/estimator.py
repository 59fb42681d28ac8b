"""Workload estimator: the cost model every planner, baseline and test shares.

Cost model (all per training step; u = micro-batch size in samples, m = micro-batches):

* stage compute (forward + backward) on device d for node range [lo, hi):
  ``c = (1 + BACKWARD_FACTOR) * flops[lo:hi] * u / (tflops_d * 1e12 * efficiency) * calib_d``
* link after stage k (activation forward + its gradient backward, one micro-batch, the link taken
  as symmetric): ``l = 2 * latency + (act + grad) * 8 / bandwidth`` with ``act =
  wire_bytes(cut_bytes[hi] * u, r)``, the keep-ratio r chosen by `choose_ratio` so one direction
  fits in LINK_TARGET_FRACTION of the bottleneck compute time (the runtime's AdaTopK rule), top-k
  sending (value, index) pairs (TOPK_WIRE_FACTOR x the dense bytes per kept element), and ``grad``
  the dense bytes, or Q8_WIRE_FACTOR of them when the link compresses (the runtime quantises
  gradients to 8 bits rather than dropping them).
* pipeline time (1F1B, sends asynchronous, links full duplex): the first micro-batch's way through
  every stage and link and back, then one period per further micro-batch, the period being the
  slowest resource per micro-batch: a stage's compute or one direction of a link,
  ``sum_k c_k + sum_k l_k + (m - 1) * max(max_k c_k, max_k d_k, max_k R_k / (S - k))`` (d_k the
  link's slower direction), where
  ``R_k = sum_{j >= k} (c_j + l_j)`` is stage k's round trip: 1F1B lets it have only S - k
  micro-batches in flight, which slow links make the limit.  With identical stages and free links
  this is the classic ``(m + S - 1) * c``; against the event simulator (plan/simulator.py) it is
  within -7%..+7% on 80% of random pipelines.  The split DP minimises ``max_k (c_k + l_k)``,
  an upper bound of the period that also keeps the fill short.
* memory of stage k: params x (2 with offload: weights + grads; 4 without: + Adam m, v) plus
  (S - k) micro-batches in flight of its activations (sum of out_bytes) and its input.
* data-parallel sync through optimizer hosts (offload on): after its last backward, every stage
  pushes its gradients to each host (bytes split by the hosts' shares) and pulls the new
  parameters: ``2 * sum_h (latency + P_k * share_h * 8 / bw(d, h))``; a pipeline's sync is the max
  over its stages.  Hosts are also limited by their own link: ``H = max_h 2 * P * share_h *
  pipelines * 8 / host_bw_h``.  Offload off: pipelines all-reduce directly, each stage moving
  ``2 * P_k`` bytes both ways over its slowest link to a worker outside its pipeline (0 with one
  pipeline).
* step time ``max(max_p (pipeline_p + sync_p), H) + overhead``, where the overhead is the
  runtime's fixed cost per step (its RPC rounds: inputs, `job.step`, the optimizer, commits), 0
  unless measured (a cluster file's ``step_overhead_ms``, or calibration from step records).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np

from fusionnode.errors import ConfigError
from fusionnode.graph.dag import OpGraph
from fusionnode.plan.cluster import Cluster
from fusionnode.plan.syncprice import EVERY_STEP, SyncPrice

log = logging.getLogger(__name__)

DEFAULT_EFFICIENCY = 0.4  # fraction of peak TFLOP/s a device sustains on transformer ops
BACKWARD_FACTOR = 2.0  # backward FLOPs / forward FLOPs
DENSE_ELEMENT_BYTES = 4  # fp32 activation element
TOPK_BYTES_PER_KEPT = 6  # fp16 value (2) + int32 index (4) per kept element
TOPK_WIRE_FACTOR = TOPK_BYTES_PER_KEPT / DENSE_ELEMENT_BYTES  # wire bytes per kept dense byte
K_MIN = 0.01  # smallest keep-ratio `choose_ratio` takes unless told (the codec's own minimum)
# The keep-ratio floor of AdaTopK: the smallest ratio the runtime's policy uses (compress/policy.py
# DEFAULT_K_MIN) and so the smallest a plan may count on under `--compress adatopk`. From `fusionnode
# bench adatopk` (gpt2-tiny cut after block 2, 400 steps, batch 16 x 128, seed 0, the policy on its
# 9.5 Mbit/s link, where it sits at the floor; activations centered global top-k, gradients q8, no
# warm-up, as the runtime sends them; dense validation loss 2.3732; protocol/COMPRESSION.md,
# "Keep-ratio floor", 2026-11-24, one run each): floor 0.20 costs +2.71% loss at 5.13x fewer link
# bytes (+1.85% at 7.56x with q4 gradients), 0.25 +2.33% at 4.83x, 0.15 +3.18% at 5.49x, 0.30 +5.36%
# (run-to-run noise is 1-3 points); the 9.56% the policy would pick cost +5.75..+6.62%. 0.20 is the
# lowest floor within about 2% of dense that keeps the benchmark's >= 5x fewer bytes.
PLAN_KEEP_FLOOR = 0.2
LINK_TARGET_FRACTION = 0.8  # AdaTopK aims each link direction at this fraction of the bottleneck compute
Q8_WIRE_FACTOR = 0.26  # wire bytes per dense byte of a q8 gradient (1 byte per element + row scales)
USABLE_MEMORY_FRACTION = 0.9  # of a device's memory_gb that a stage may fill
OPTIMIZER_BYTES_FACTOR = 4  # fp32 master + grad accumulator + Adam m, v on a host, x param bytes
WORKER_PARAM_FACTOR_OFFLOAD = 2  # weights + grads on a worker when the optimizer is offloaded
WORKER_PARAM_FACTOR_LOCAL = 4  # weights + grads + Adam m, v when it is not


def link_time(nbytes: float, bandwidth_bps: float, latency_s: float) -> float:
    """Seconds to move nbytes over one link: latency + serialisation."""
    return latency_s + nbytes * 8.0 / bandwidth_bps


def wire_bytes(nbytes: float, ratio: float) -> float:
    """Bytes on the wire for a tensor of nbytes dense, top-k compressed to keep-ratio `ratio`."""
    return nbytes if ratio >= 1.0 else nbytes * ratio * TOPK_WIRE_FACTOR


def choose_ratio(
    nbytes: float, bandwidth_bps: float, latency_s: float, target_time_s: float, k_min: float = K_MIN
) -> float:
    """AdaTopK keep-ratio for one transfer: 1.0 (dense) if it already fits in target_time_s,
    else the largest ratio whose (value, index) payload fits, never below k_min."""
    if nbytes <= 0 or link_time(nbytes, bandwidth_bps, latency_s) <= target_time_s:
        return 1.0
    avail = target_time_s - latency_s
    if avail <= 0:
        return k_min
    ratio = avail * bandwidth_bps / 8.0 / (nbytes * TOPK_WIRE_FACTOR)
    return float(min(1.0, max(k_min, ratio)))


def link_comm(nbytes: float, bandwidth_bps: float, latency_s: float, ratio: float) -> tuple[float, float]:
    """(both directions' seconds, the slower direction's serialisation) of one micro-batch over a
    link, as the runtime's AdaTopK sends it: the activation top-k compressed to `ratio`, and its
    gradient back q8-quantised whenever the link compresses at all (dense otherwise)."""
    act = wire_bytes(nbytes, ratio) * 8.0 / bandwidth_bps
    grad = (nbytes * Q8_WIRE_FACTOR if ratio < 1.0 else nbytes) * 8.0 / bandwidth_bps
    return 2.0 * latency_s + act + grad, max(act, grad)


@dataclasses.dataclass(frozen=True, eq=False)
class Chain:
    """The OP-DAG seen as a chain of blocks between allowed cuts (see fence.coarsen).

    bounds[b] is the node index of the b-th allowed cut (bounds[0] = 0, bounds[-1] = n);
    prefix arrays are indexed by position in bounds."""

    bounds: np.ndarray  # int, node ids of allowed cuts
    flops: np.ndarray  # prefix forward flops per sample
    params: np.ndarray  # prefix param bytes
    acts: np.ndarray  # prefix activation bytes per sample (sum of out_bytes)
    cut: np.ndarray  # bytes per sample crossing each allowed cut

    @property
    def blocks(self) -> int:
        return len(self.bounds) - 1

    @staticmethod
    def from_graph(graph: OpGraph, bounds: Sequence[int] | None = None) -> Chain:
        n = graph.num_nodes
        if n == 0:
            raise ConfigError(f"model {graph.model_name!r} has an empty OP-DAG")
        b = np.arange(n + 1) if bounds is None else np.asarray(sorted(set(bounds)), dtype=int)
        if b[0] != 0 or b[-1] != n:
            raise ValueError("chain bounds must start at 0 and end at the node count")
        pf = np.asarray(graph.prefix_flops(), dtype=float)
        pp = np.asarray(graph.prefix_param_bytes(), dtype=float)
        pa = np.concatenate([[0.0], np.cumsum([float(nd.out_bytes) for nd in graph.nodes])])
        cut = np.asarray(graph.cut_bytes(), dtype=float)
        return Chain(bounds=b, flops=pf[b], params=pp[b], acts=pa[b], cut=cut[b])


@dataclasses.dataclass(frozen=True)
class PipelineCost:
    """The cost model's verdict on one pipeline: devices in order, split at chain positions."""

    devices: tuple[int, ...]  # cluster indices, one per stage
    split: tuple[int, ...]  # chain positions, len S + 1, split[0] = 0, split[-1] = blocks
    micro_batch_size: int
    compute_s: tuple[float, ...]  # fwd + bwd per micro-batch, per stage
    comm_s: tuple[float, ...]  # outgoing link fwd + bwd per micro-batch (0 for the last stage)
    serial_s: tuple[float, ...]  # the outgoing link's slower direction per micro-batch (0 for the last)
    ratios: tuple[float, ...]  # keep-ratio of each outgoing link (1.0 for the last stage)
    memory_bytes: tuple[float, ...]
    param_bytes: tuple[float, ...]
    fits: bool  # every stage within its device's usable memory

    @property
    def stages(self) -> int:
        return len(self.devices)

    @property
    def bottleneck_s(self) -> float:
        """max_k (compute + outgoing link both ways): the split DP's objective."""
        return max(c + x for c, x in zip(self.compute_s, self.comm_s, strict=True))

    @functools.cached_property
    def period_s(self) -> float:
        """Seconds per micro-batch in steady state: the slowest stage or link direction, or a stage's
        round trip (its compute and everything after it, there and back) over the S - k micro-batches
        1F1B lets it have in flight, whichever is longest."""
        s = self.stages
        tail = np.cumsum(np.asarray(self.compute_s[::-1]) + np.asarray(self.comm_s[::-1]))[::-1]
        window = float(np.max(tail / np.arange(s, 0, -1)))
        return max(max(self.compute_s), max(self.serial_s), window, 1e-12)

    @functools.cached_property
    def fill_s(self) -> float:
        """One micro-batch's way forward through every stage and link, and back."""
        return sum(self.compute_s) + sum(self.comm_s)

    def pipeline_time(self, micro_batches: int) -> float:
        if micro_batches <= 0:
            return 0.0
        return self.fill_s + (micro_batches - 1) * self.period_s

    def capacity(self, seconds: float) -> int:
        """Most micro-batches the pipeline runs within `seconds` (the inverse of pipeline_time)."""
        if seconds < self.fill_s * (1 - 1e-12):
            return 0
        return math.floor((seconds - self.fill_s) / self.period_s * (1 + 1e-12)) + 1


class Estimator:
    """Per-device compute speed (with calibration), per-pair links, and the step cost model."""

    def __init__(
        self,
        cluster: Cluster,
        efficiency: float = DEFAULT_EFFICIENCY,
        offload: bool = True,
        step_overhead_s: float | None = None,
        compress: bool = True,
        keep_floor: float = PLAN_KEEP_FLOOR,
        sync: SyncPrice | None = None,
    ):
        if not 0 < efficiency <= 1:
            raise ConfigError(f"efficiency must be in (0, 1], got {efficiency}")
        overhead = cluster.step_overhead_s if step_overhead_s is None else step_overhead_s
        if not (overhead >= 0 and math.isfinite(overhead)):
            raise ConfigError(f"the step overhead must be >= 0 seconds, got {overhead}")
        self.step_overhead_s = float(overhead)
        self.compress = compress  # AdaTopK on slow links (evaluate's default)
        if not 0 < keep_floor <= 1:
            raise ConfigError(f"keep floor must be in (0, 1], got {keep_floor}")
        self.keep_floor = keep_floor  # the smallest keep ratio a plan may count on
        self.cluster = cluster
        self.efficiency = efficiency
        self.offload = offload
        self.sync = sync or EVERY_STEP  # how the data-parallel sync is paid: every step, or per round
        self._calib = np.ones(cluster.size)
        self._speed = np.array([d.tflops * 1e12 * efficiency for d in cluster.devices])
        self._cap = np.array([d.memory_bytes * USABLE_MEMORY_FRACTION for d in cluster.devices])
        self._ids = [d.id for d in cluster.devices]

    # ---- calibration -------------------------------------------------------------------------
    def calibrate(self, device_id: str, factor: float) -> None:
        """Multiply the device's predicted compute times by `factor` (= measured / predicted)."""
        if not (factor > 0 and math.isfinite(factor)):
            raise ConfigError(f"calibration factor for {device_id!r} must be > 0, got {factor}")
        self._calib[self.cluster.index(device_id)] *= factor

    def calibration(self, device_id: str) -> float:
        return float(self._calib[self.cluster.index(device_id)])

    def prediction_error(self, measurements: Mapping[tuple[str, float], float]) -> dict[str, float]:
        """Relative error (predicted - measured) / measured per device, for measurements keyed by
        (device_id, forward flops of the measured work, fwd + bwd) -> measured seconds."""
        out: dict[str, float] = {}
        for (dev, flops), measured in measurements.items():
            pred = self.compute_time(self.cluster.index(dev), flops)
            out[dev] = (pred - measured) / measured
        return out

    # ---- primitives --------------------------------------------------------------------------
    def seconds_per_flop(self, device: int) -> float:
        """Seconds per forward FLOP for forward + backward on this device (cluster index)."""
        return (1.0 + BACKWARD_FACTOR) * self._calib[device] / self._speed[device]

    def seconds_per_flop_all(self) -> np.ndarray:
        return (1.0 + BACKWARD_FACTOR) * self._calib / self._speed

    def compute_time(self, device: int, flops: float) -> float:
        """Forward + backward seconds for `flops` forward FLOPs on device (cluster index)."""
        return flops * self.seconds_per_flop(device)

    def capacity(self, device: int) -> float:
        return float(self._cap[device])

    def capacities(self) -> np.ndarray:
        return self._cap

    def param_factor(self) -> int:
        return WORKER_PARAM_FACTOR_OFFLOAD if self.offload else WORKER_PARAM_FACTOR_LOCAL

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(bit/s, seconds) of the link a -> b (cluster indices)."""
        return float(self.cluster.bandwidth_bps[a, b]), float(self.cluster.latency_s[a, b])

    # ---- the pipeline cost -------------------------------------------------------------------
    def evaluate(
        self,
        chain: Chain,
        devices: Sequence[int],
        split: Sequence[int],
        micro_batch_size: int,
        compress: bool | None = None,
        ratios: Sequence[float] | None = None,
    ) -> PipelineCost:
        """Cost of one pipeline: devices[k] runs chain blocks [split[k], split[k+1]).

        Keep-ratios are chosen by `choose_ratio` (or 1.0 when compress is False) unless `ratios`
        gives them (one per stage, the last ignored); compress None means the estimator's own setting."""
        if compress is None:
            compress = self.compress
        s = len(devices)
        if len(split) != s + 1 or split[0] != 0 or split[-1] != chain.blocks:
            raise ValueError(
                f"split {split} does not cover the chain of {chain.blocks} blocks with {s} stages"
            )
        u = micro_batch_size
        spf = self.seconds_per_flop_all()
        compute = []
        params = []
        memory = []
        pf = self.param_factor()
        for k in range(s):
            lo, hi = split[k], split[k + 1]
            compute.append(float((chain.flops[hi] - chain.flops[lo]) * u * spf[devices[k]]))
            p = float(chain.params[hi] - chain.params[lo])
            params.append(p)
            inflight = s - k
            act = (chain.acts[hi] - chain.acts[lo] + chain.cut[lo]) * u * inflight
            memory.append(p * pf + float(act))
        target = max(compute)
        comm, chosen, serial = [], [], []
        for k in range(s - 1):
            bw, lat = self.link(devices[k], devices[k + 1])
            x = float(chain.cut[split[k + 1]]) * u
            if ratios is not None:
                r = float(ratios[k])
            else:
                r = (
                    choose_ratio(x, bw, lat, LINK_TARGET_FRACTION * target, self.keep_floor)
                    if compress
                    else 1.0
                )
            chosen.append(r)
            both, slower = link_comm(x, bw, lat, r)
            comm.append(both)
            serial.append(slower)
        comm.append(0.0)
        serial.append(0.0)
        chosen.append(1.0)
        fits = all(mem <= self._cap[d] for mem, d in zip(memory, devices, strict=False))
        return PipelineCost(
            devices=tuple(int(d) for d in devices),
            split=tuple(int(x) for x in split),
            micro_batch_size=u,
            compute_s=tuple(compute),
            comm_s=tuple(comm),
            serial_s=tuple(serial),
            ratios=tuple(chosen),
            memory_bytes=tuple(memory),
            param_bytes=tuple(params),
            fits=fits,
        )

    # ---- data-parallel sync ------------------------------------------------------------------
    def stage_sync_time(
        self,
        device: int,
        param_bytes: float,
        hosts: Sequence[tuple[int, float]],
        multi: bool,
        outside_bw_bps: float = math.inf,
    ) -> float:
        """Push grads + pull params of one stage (see the module docstring); under a round sync
        mode, the round's pseudo-gradient up and update down, per step (plan/syncprice.py)."""
        if param_bytes <= 0:
            return 0.0
        nbytes = self.sync.round_bytes(param_bytes)
        if self.offload:
            t = 0.0
            for h, share in hosts:
                if h == device or share <= 0:
                    continue
                bw, lat = self.link(device, h)
                t += 2.0 * link_time(nbytes * share, bw, lat)
            return self.sync.per_step(t)
        if not multi:
            return 0.0
        return self.sync.per_step(2.0 * (nbytes * 2 * 8.0 / outside_bw_bps))

    def outside_bandwidth(self, pipeline_devices: Sequence[int], workers: Sequence[int]) -> np.ndarray:
        """For offload off: each device's slowest link to a worker outside its pipeline."""
        inside = set(int(d) for d in pipeline_devices)
        others = np.array([w for w in workers if w not in inside], dtype=int)
        if len(others) == 0:
            return np.full(len(pipeline_devices), math.inf)
        return self.cluster.bandwidth_bps[np.ix_(np.asarray(pipeline_devices, dtype=int), others)].min(axis=1)

    def host_bound(
        self, total_param_bytes: float, hosts: Sequence[tuple[int, float]], pipelines: int
    ) -> float:
        """Seconds the optimizer hosts' own links need for every pipeline's push + pull."""
        if not self.offload or pipelines == 0:
            return 0.0
        bw = self.cluster.bandwidth_bps
        worst = 0.0
        for h, share in hosts:
            dev = self.cluster.devices[h]
            row = np.delete(bw[h], h)
            host_bw = (
                dev.uplink_gbps * 1e9 if dev.uplink_gbps > 0 else (float(row.max()) if len(row) else math.inf)
            )
            round_bytes = self.sync.round_bytes(total_param_bytes * share)
            worst = max(worst, 2.0 * round_bytes * pipelines * 8.0 / host_bw)
        return self.sync.per_step(worst)
