"""Rebalancing decisions: measured stage speeds, candidate layouts, hysteresis, bans, blame.

Pure functions over plain data (no network, no torch): the driver feeds them the stage
timings its workers report and acts on what they return.

Model. A stage of a pipeline runs operators [lo, hi) of the OP-DAG on one peer. Its
compute time per step is proportional to the operators' flops divided by the peer's
speed, so a peer's measured speed is ``flops(lo, hi) / compute_s`` (flops per second of
compute, forward and backward together: the constant factor cancels when speeds are
compared). A pipeline of n stages and m micro-batches takes about
``(m + n - 1) * max_i t_i / m`` per step (1F1B: fill and drain, then the bottleneck stage
sets the pace), where ``t_i`` is stage i's compute time for the whole step.

Decision. A candidate layout is adopted when its predicted step time beats the current
one by more than ``min_gain`` (relative) *and* the time saved over the remaining steps
exceeds the cost of moving (re-assigning stages, shipping parameters) — hysteresis so a
noisy measurement does not make the plan flap.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fusionnode.train.contention import SharedHosts, best_on_shared_hosts
from fusionnode.train.speeds import (  # noqa: F401  (re-exported: the run's table and trigger)
    DEFAULT_WINDOW,
    DROP_SIGMAS,
    MIN_DROP,
    NOISE_SIGMAS,
    PERSIST_CHECKS,
    RUN_HISTORY,
    SPEED_WINDOW,
    SpeedBook,
    Trigger,
)
from fusionnode.wire.job import ErrorCode, Failure

logger = logging.getLogger(__name__)

DEFAULT_MIN_GAIN = 0.25  # relative step-time improvement below which a re-plan is not worth it
DEFAULT_BAN_S = 15.0  # seconds a peer is banned after its first failure (doubles each time, Petals)
MAX_BAN_S = 600.0  # seconds: the longest ban
ADVERTISED_CAP = 4.0  # an unmeasured peer is planned at most this many times the fastest measured one


@dataclass(frozen=True)
class Layout:
    """One pipeline: `peers[i]` runs operators [bounds[i], bounds[i+1])."""

    peers: tuple[str, ...]
    bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.peers) + 1:
            raise ValueError(f"{len(self.peers)} peers need {len(self.peers) + 1} bounds, got {self.bounds}")
        if any(b <= a for a, b in zip(self.bounds, self.bounds[1:], strict=False)):
            raise ValueError(f"stage bounds must strictly increase: {self.bounds}")


@dataclass(frozen=True)
class Decision:
    adopt: bool
    reason: str
    current_s: float  # predicted step time of the plan in force (seconds)
    candidate_s: float  # predicted step time of the best candidate (seconds)
    layout: Layout | None = None  # the candidate (also when not adopted, for the record)

    @property
    def gain(self) -> float:
        return 1.0 - self.candidate_s / self.current_s if self.current_s > 0 else 0.0


def stage_flops(flops: Sequence[float], lo: int, hi: int) -> float:
    return float(sum(flops[lo:hi]))


def measured_speeds(
    flops: Sequence[float],
    samples: Iterable[tuple[str, int, int, float]],
) -> dict[str, float]:
    """Flops per second of compute for each peer from (peer, lo, hi, compute_s) samples (mean over
    its samples: sum of flops / sum of seconds). Samples with no compute time are ignored."""
    work: dict[str, float] = {}
    secs: dict[str, float] = {}
    for peer, lo, hi, compute_s in samples:
        if compute_s <= 0 or not math.isfinite(compute_s):
            continue
        work[peer] = work.get(peer, 0.0) + stage_flops(flops, lo, hi)
        secs[peer] = secs.get(peer, 0.0) + compute_s
    return {p: work[p] / secs[p] for p in work if work[p] > 0}


def fill_speeds(
    measured: Mapping[str, float], advertised: Mapping[str, float], peers: Iterable[str]
) -> dict[str, float]:
    """Speeds for every peer: measured where known; otherwise the advertised figure scaled by the
    median measured/advertised ratio of the measured peers (so units agree); 1.0 if nothing is known."""
    ratios = sorted(
        measured[p] / advertised[p] for p in measured if advertised.get(p, 0) > 0 and measured[p] > 0
    )
    scale = ratios[len(ratios) // 2] if ratios else None
    known = sorted(measured.values())
    fallback = known[len(known) // 2] if known else 1.0
    cap = ADVERTISED_CAP * known[-1] if known else math.inf
    out = {}
    for p in peers:
        if p in measured:
            out[p] = measured[p]
        elif scale is not None and advertised.get(p, 0) > 0:
            out[p] = min(advertised[p] * scale, cap)  # an advertisement cannot outbid measurements
        else:
            out[p] = fallback
    return out


def planning_tflops(advertised: Mapping[str, float], measured: Mapping[str, float]) -> dict[str, float]:
    """The TFLOPS the planner may use for each peer of `advertised` (its self-reported figures),
    given `measured` speeds (any unit, the same for every peer: SpeedBook's work per second).

    The rule (SECURITY.md, attack 8): with measurements, scale = the median of measured/advertised
    over the measured peers; a measured peer's figure is its measurement / scale (the
    advertisement is replaced); an unmeasured peer keeps its advertisement but at most
    ADVERTISED_CAP x the fastest measured peer's figure. With no measurement at all, every figure is
    at most ADVERTISED_CAP x the median advertised figure (one liar among honest peers is bounded)."""
    adv = {p: float(v) for p, v in advertised.items() if math.isfinite(float(v)) and float(v) > 0}
    ratios = sorted(measured[p] / adv[p] for p in measured if p in adv and measured[p] > 0)
    out: dict[str, float] = {}
    if ratios:
        scale = ratios[len(ratios) // 2]
        known = {p: max(measured[p] / scale, 1e-6) for p in measured if p in advertised and measured[p] > 0}
        cap = ADVERTISED_CAP * max(known.values())
        for p in advertised:
            out[p] = known[p] if p in known else min(adv.get(p, 1e-6), cap)
        return out
    figures = sorted(adv.values())
    cap = ADVERTISED_CAP * figures[len(figures) // 2] if figures else math.inf
    return {p: min(adv.get(p, 1e-6), cap) for p in advertised}


def calibrate_cluster(doc: Mapping, measured: Mapping[str, float], advertised: Mapping[str, float]) -> dict:
    """A copy of a cluster document (protocol/CLUSTER.md) whose devices' TFLOPS are what
    `planning_tflops` allows: measured speeds in the advertised unit (median ratio measured/advertised
    of the measured peers), unmeasured advertisements capped relative to them."""
    adv = {d["id"]: float(advertised.get(d["id"], d["tflops"])) for d in doc.get("devices", [])}
    figures = planning_tflops(adv, {p: v for p, v in measured.items() if p in adv})
    out = dict(doc)
    out["devices"] = [{**d, "tflops": max(figures[d["id"]], 1e-6)} for d in doc.get("devices", [])]
    return out


def weighted_bounds(flops: Sequence[float], speeds: Sequence[float]) -> tuple[int, ...]:
    """Contiguous split of the operators into len(speeds) non-empty stages (stage i on the peer of
    speed speeds[i]) that minimises the largest stage time flops/speed: exact, by dynamic
    programming over (stage, first operator of the next stage), O(stages x operators^2)."""
    n, k = len(flops), len(speeds)
    if k < 1 or k > n:
        raise ValueError(f"cannot split {n} operators into {k} stages")
    if min(speeds) <= 0:
        raise ValueError("speeds must be positive")
    w = [max(float(f), 0.0) for f in flops]
    if not sum(w):
        w = [1.0] * n
    prefix = [0.0]
    for x in w:
        prefix.append(prefix[-1] + x)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(k + 1)]  # best[s][j]: first s stages cover ops [0, j)
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        sp = speeds[s - 1]
        for j in range(s, n - (k - s) + 1):
            b, arg = inf, s - 1
            for i in range(s - 1, j):
                prev = best[s - 1][i]
                if prev >= b:
                    continue
                t = max(prev, (prefix[j] - prefix[i]) / sp)
                if t < b:
                    b, arg = t, i
            best[s][j], cut[s][j] = b, arg
    bounds = [n]
    j = n
    for s in range(k, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    return tuple(reversed(bounds))


def predict_step_s(
    layout: Layout, flops: Sequence[float], speeds: Mapping[str, float], micro_batches: int
) -> float:
    """Predicted step time (seconds) of one pipeline under the 1F1B schedule."""
    times = [
        stage_flops(flops, layout.bounds[i], layout.bounds[i + 1]) / speeds[p]
        for i, p in enumerate(layout.peers)
    ]
    n, m = len(times), max(1, micro_batches)
    return (m + n - 1) * max(times) / m


def candidates(
    current: Layout, flops: Sequence[float], speeds: Mapping[str, float], spares: Sequence[str]
) -> list[Layout]:
    """Layouts worth predicting: the current peers with speed-weighted bounds; the slowest peer
    swapped for the fastest spare; the slowest peer dropped; the fastest spare added."""
    peers = list(current.peers)
    out: list[Layout] = []

    def add(ps: list[str]) -> None:
        if not ps or len(ps) > len(flops) or len(set(ps)) != len(ps):
            return
        lay = Layout(tuple(ps), weighted_bounds(flops, [speeds[p] for p in ps]))
        if lay not in out:
            out.append(lay)

    add(peers)
    slow = min(peers, key=lambda p: speeds[p])
    spare = sorted(spares, key=lambda p: -speeds[p])
    if spare:
        add([spare[0] if p == slow else p for p in peers])
        add([*peers, spare[0]])
    if len(peers) > 1:
        add([p for p in peers if p != slow])
    return out


def decide(
    current: Layout,
    flops: Sequence[float],
    speeds: Mapping[str, float],
    micro_batches: int,
    *,
    spares: Sequence[str] = (),
    steps_left: int,
    move_cost_s: float,
    min_gain: float = DEFAULT_MIN_GAIN,
) -> Decision:
    """Whether to adopt a better layout now (see the module docstring for the rule)."""
    cur = predict_step_s(current, flops, speeds, micro_batches)
    best, best_s = None, math.inf
    for lay in candidates(current, flops, speeds, spares):
        t = predict_step_s(lay, flops, speeds, micro_batches)
        if t < best_s - 1e-12:
            best, best_s = lay, t
    if best is None or best == current:
        return Decision(False, "the current layout is the best candidate", cur, min(cur, best_s), best)
    gain = 1.0 - best_s / cur
    saved = (cur - best_s) * steps_left
    if gain < min_gain:
        return Decision(False, f"gain {gain:.0%} below the {min_gain:.0%} threshold", cur, best_s, best)
    if saved <= move_cost_s:
        return Decision(
            False,
            f"saves {saved:.1f} s over {steps_left} steps, moving costs {move_cost_s:.1f} s",
            cur,
            best_s,
            best,
        )
    slow = min(current.peers, key=lambda p: speeds[p])
    return Decision(
        True,
        f"predicted step {cur:.3f} s -> {best_s:.3f} s ({gain:.0%} faster; slowest peer {slow[:12]}…)",
        cur,
        best_s,
        best,
    )


@dataclass(frozen=True)
class JobDecision:
    adopt: bool
    reason: str
    current_s: float  # predicted step time of the job (its slowest pipeline), seconds
    candidate_s: float
    layouts: tuple[Layout, ...] = ()  # one per pipeline (also when not adopted, for the record)
    shares: tuple[int, ...] = ()  # samples per pipeline under `layouts` (moved when shares pay)
    culprit: str | None = None  # the bottleneck: the slowest stage's peer of the slowest pipeline

    @property
    def gain(self) -> float:
        return 1.0 - self.candidate_s / self.current_s if self.current_s > 0 else 0.0


def balance_shares(
    per_sample_s: Sequence[float], micro_batches: Sequence[int], batch: int
) -> list[int] | None:
    """Batch shares (samples per pipeline, each a multiple of its micro-batch count and at least one
    micro-batch each) that minimise the slowest pipeline, given each pipeline's seconds per sample:
    greedily, one micro-batch of samples at a time to the pipeline that would finish first with it.
    None if the batch cannot be shared so."""
    shares = [max(1, int(m)) for m in micro_batches]
    left = batch - sum(shares)
    if left < 0:
        return None
    while left > 0:
        fits = [i for i, m in enumerate(shares) if micro_batches[i] <= left]
        if not fits:
            return None
        i = min(fits, key=lambda k: (per_sample_s[k] * (shares[k] + micro_batches[k]), k))
        shares[i] += max(1, int(micro_batches[i]))
        left -= max(1, int(micro_batches[i]))
    return shares


def decide_job(
    current: Sequence[Layout],
    flops: Sequence[Sequence[float]],
    speeds: Mapping[str, float],
    micro_batches: Sequence[int],
    *,
    spares: Sequence[str] = (),
    steps_left: int,
    move_cost_s: float,
    min_gain: float = DEFAULT_MIN_GAIN,
    shares: Sequence[int] = (),
    hosts: SharedHosts | None = None,
) -> JobDecision:
    """`decide` for a job of several pipelines (data-parallel replicas): a step takes as long as its
    slowest pipeline. Pipelines are taken slowest first; each gets the best of its `candidates`
    (spares shared: a peer one pipeline takes is no spare for the next; a peer it drops becomes one).
    `flops[i]` is pipeline i's work per operator (graph FLOPs x its sequences per step), so every
    pipeline is priced in the same unit as `speeds`. The same threshold and move-cost rule as `decide`.

    With `shares` (samples per pipeline) and several pipelines, the batch shares are tried first
    (`balance_shares`: pipeline times scale with their samples); a share change that clears the
    threshold and the move cost is returned as is (layouts unchanged, new `shares`); else the
    pipelines are re-split or swapped as above.

    With `hosts` (peers that share a machine's cores), the re-split, the current layout and, when
    the plan holds a clear straggler, the pipelines consolidated onto fewer of their peers are
    priced with the shared cores (train/contention.py)."""
    if not current:
        raise ValueError("no pipeline")
    times = [
        predict_step_s(lay, f, speeds, m) for lay, f, m in zip(current, flops, micro_batches, strict=True)
    ]
    cur = max(times)
    share: JobDecision | None = None
    worst = max(range(len(current)), key=lambda k: times[k])
    lay_w, f_w = current[worst], flops[worst]
    culprit = max(
        range(len(lay_w.peers)),
        key=lambda i: stage_flops(f_w, lay_w.bounds[i], lay_w.bounds[i + 1]) / speeds[lay_w.peers[i]],
    )
    culprit_peer = lay_w.peers[culprit]
    if shares and len(current) > 1:  # first the cheap move: the batch shared by the pipelines' speeds
        new_shares = balance_shares(
            [t / n for t, n in zip(times, shares, strict=True)], micro_batches, sum(shares)
        )
        if new_shares is not None and tuple(new_shares) != tuple(shares):
            new = max(t / n * k for t, n, k in zip(times, shares, new_shares, strict=True))
            gain, saved = 1.0 - new / cur, (cur - new) * steps_left
            if gain >= min_gain and saved > move_cost_s:
                share = JobDecision(
                    True,
                    f"predicted step {cur:.3f} s -> {new:.3f} s ({gain:.0%} faster; slowest peer "
                    f"{culprit_peer[:12]}…) by batch shares "
                    f"{list(shares)} -> {new_shares}",
                    cur,
                    new,
                    tuple(current),
                    tuple(new_shares),
                    culprit_peer,
                )
    split = _resplit(current, flops, speeds, micro_batches, spares, steps_left, move_cost_s, min_gain, times)
    if hosts is not None and hosts.any_shared(p for lay in current for p in lay.peers):
        # peers of one machine share its cores: the candidates priced so, consolidations included
        lays, new_s = best_on_shared_hosts(current, split.layouts, flops, speeds, micro_batches, hosts)
        split = _verdict(current, flops, speeds, cur, new_s, lays, steps_left, move_cost_s, min_gain)
    split = dataclasses.replace(split, culprit=culprit_peer)
    # the shares move unless re-placing stages is clearly better (by the threshold again): a share
    # move cannot take all the work off a slow peer (each pipeline keeps a micro-batch per step)
    if share is not None and not (split.adopt and split.candidate_s <= (1.0 - min_gain) * share.candidate_s):
        return share
    return split


def _resplit(
    current: Sequence[Layout],
    flops: Sequence[Sequence[float]],
    speeds: Mapping[str, float],
    micro_batches: Sequence[int],
    spares: Sequence[str],
    steps_left: int,
    move_cost_s: float,
    min_gain: float,
    times: list[float],
) -> JobDecision:
    """`decide_job`'s re-split or swap of the pipelines' stages (shares unchanged)."""
    cur = max(times)
    times = list(times)
    layouts = list(current)
    used = {p for lay in current for p in lay.peers}
    free = [p for p in spares if p not in used]
    for i in sorted(range(len(layouts)), key=lambda k: -times[k]):
        best, best_s = layouts[i], times[i]
        for lay in candidates(layouts[i], flops[i], speeds, free):
            t = predict_step_s(lay, flops[i], speeds, micro_batches[i])
            if t < best_s - 1e-12:
                best, best_s = lay, t
        if best != layouts[i]:
            free = [p for p in free if p not in best.peers] + [
                p for p in layouts[i].peers if p not in best.peers
            ]
            layouts[i], times[i] = best, best_s
    new = max(times)
    # a pipeline that was not holding the job back keeps its layout (moving it gains nothing)
    cur_times = [
        predict_step_s(lay, f, speeds, m) for lay, f, m in zip(current, flops, micro_batches, strict=True)
    ]
    for i, lay in enumerate(current):
        others = {p for j, o in enumerate(layouts) if j != i for p in o.peers}
        if layouts[i] != lay and cur_times[i] <= new and not others & set(lay.peers):
            layouts[i], times[i] = lay, cur_times[i]
    return _verdict(
        current, flops, speeds, cur, max(times), tuple(layouts), steps_left, move_cost_s, min_gain
    )


def _verdict(
    current: Sequence[Layout],
    flops: Sequence[Sequence[float]],
    speeds: Mapping[str, float],
    cur: float,
    new: float,
    out: tuple[Layout, ...],
    steps_left: int,
    move_cost_s: float,
    min_gain: float,
) -> JobDecision:
    """Whether the job moves from `current` (predicted step `cur`) to `out` (`new`): the threshold
    and move-cost rule of `decide`."""
    if out == tuple(current):
        return JobDecision(False, "the current layout is the best candidate", cur, cur, out)
    gain = 1.0 - new / cur
    saved = (cur - new) * steps_left
    if gain < min_gain:
        return JobDecision(False, f"gain {gain:.0%} below the {min_gain:.0%} threshold", cur, new, out)
    if saved <= move_cost_s:
        return JobDecision(
            False,
            f"saves {saved:.1f} s over {steps_left} steps, moving costs {move_cost_s:.1f} s",
            cur,
            new,
            out,
        )
    slow = max(
        (
            (p, stage_flops(f, lay.bounds[i], lay.bounds[i + 1]) / speeds[p])
            for lay, f in zip(current, flops, strict=True)
            for i, p in enumerate(lay.peers)
        ),
        key=lambda x: x[1],
    )[0]
    return JobDecision(
        True,
        f"predicted step {cur:.3f} s -> {new:.3f} s ({gain:.0%} faster; slowest peer {slow[:12]}…)",
        cur,
        new,
        out,
    )


@dataclass(frozen=True)
class Check:
    """One rebalance check: the decision, whether the trigger lets it act, and what it saw."""

    decision: JobDecision
    act: bool
    why: str
    noise: float  # the measured noise of the window's speeds (SpeedBook.noise)
    spread: float  # the standard error of the bottleneck's log slow-down (SpeedBook.shift; not measured
    # yet: the step-to-step spread of stage speeds, SpeedBook.spread)
    slowed: float | None  # the bottleneck's speed / its speed before it slowed (SpeedBook.shift)


def check_job(
    book: SpeedBook,
    trigger: Trigger,
    current: Sequence[Layout],
    flops: Sequence[Sequence[float]],
    speeds: Mapping[str, float],
    micro_batches: Sequence[int],
    **decide: Any,
) -> Check:
    """`decide_job` (its keyword arguments in `decide`) and the run's `trigger` over the run's
    `book` of measured speeds: what a driver's rebalance check does, without the network."""
    d = decide_job(current, flops, speeds, micro_batches, **decide)
    in_plan = [p for lay in current for p in lay.peers]
    noise = book.noise(in_plan)
    # the bottleneck's drop since it began (its own level shift is not compared with, nor counted
    # as noise: a slow-down the previous checks saw too is still measured against the speed before)
    shift = book.shift(d.culprit) if d.culprit else None
    slowed, spread = shift if shift is not None else (None, book.spread(in_plan))
    act, why = trigger.check(
        d.adopt, d.gain, decide.get("min_gain", DEFAULT_MIN_GAIN), noise, d.culprit, slowed, spread
    )
    return Check(d, act, why, noise, spread, slowed)


@dataclass
class Bans:
    """Peers that failed, each banned for an interval that doubles with every failure (Petals)."""

    base_s: float = DEFAULT_BAN_S
    max_s: float = MAX_BAN_S
    failures: dict[str, int] = field(default_factory=dict)
    until: dict[str, float] = field(default_factory=dict)

    def fail(self, peer: str, now: float) -> float:
        """Records a failure; returns the ban's length in seconds."""
        n = self.failures.get(peer, 0) + 1
        self.failures[peer] = n
        length = min(self.max_s, self.base_s * 2 ** (n - 1))
        self.until[peer] = now + length
        return length

    def banned(self, peer: str, now: float) -> bool:
        return self.until.get(peer, 0.0) > now

    def allowed(self, peers: Iterable[str], now: float) -> list[str]:
        return [p for p in peers if not self.banned(p, now)]


@dataclass
class PeerBook:
    """What a driver remembers about peers across its jobs: measured speeds and bans."""

    speeds: SpeedBook = field(default_factory=SpeedBook)
    bans: Bans = field(default_factory=lambda: Bans())


def blame(
    errors: Mapping[str, Sequence[Failure]], peers: Sequence[str], unreachable: Iterable[str] = ()
) -> dict[str, str]:
    """Which peers to treat as failed after a step went wrong, and why: by error code and peer id.

    `errors`: peer -> the failures of the calls to it (wire/job.py `Failure`: code, peer to blame);
    `unreachable`: peers that did not answer a liveness probe. A peer whose refusal has the code
    `leaving`, or that a `version_skew` failure names (it runs another version of the checks, which
    is no lie), is marked "leave" (also once it is gone); other unreachable peers are failed;
    otherwise a peer of the plan that a failure blames (it sent wrong shapes or non-finite values:
    `bad_tensor`) is failed; if nobody is blamed, the peers whose calls failed, except calls a live
    peer closed unanswered (`unanswered`: its rate or stream limits, transient; nobody is blamed and
    the step is simply replayed).
    Returns {peer: "failure" | "leave"}.
    """
    out: dict[str, str] = {
        p: "leave" for p, fs in errors.items() if any(f.code == ErrorCode.LEAVING for f in fs)
    }
    for fs in errors.values():  # another version of the checks (verify/compat.py): out of the plan, no ban
        out.update({f.blame: "leave" for f in fs if f.code == ErrorCode.VERSION_SKEW and f.blame in peers})
    for p in unreachable:
        out.setdefault(p, "failure")  # a peer that said it is leaving may be gone already: still a leave
    if out:
        return out
    errors = {p: fs for p, fs in errors.items() if any(f.code != ErrorCode.UNANSWERED for f in fs)}
    if not errors:  # every failed call was refused by a live peer's limits: retry, blame nobody
        return {}
    known = set(peers)
    for fs in errors.values():
        for f in fs:
            if f.blame in known:
                out[f.blame] = "failure"
    if not out:
        out = {p: "failure" for p in errors}
    return out


__all__ = [
    "ADVERTISED_CAP",
    "Bans",
    "Decision",
    "JobDecision",
    "Layout",
    "PeerBook",
    "SpeedBook",
    "blame",
    "calibrate_cluster",
    "candidates",
    "check_job",
    "decide",
    "decide_job",
    "fill_speeds",
    "measured_speeds",
    "planning_tflops",
    "predict_step_s",
    "weighted_bounds",
]
