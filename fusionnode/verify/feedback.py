"""The round-end check of SparseLoCo's error feedback (issue 20; `--sync sparseloco`).

Under sparseloco a stage does not send its pseudo-gradient Δ = θ_start − θ_end: it folds Δ into its
error-feedback accumulator and sends that accumulator's chunked top-k (compress/pseudograd.py):

    e = β e_prev + Δ;   c = ctopk2(e);   e_next = e − c.

The round-end check of diloco (train/inner_checks.py) recomputes θ_end from the round's last inner
step and compares Δ; under sparseloco the message also depends on e_prev, which no one but the
worker held. So the accumulators are committed and shown like the inner optimizer's state:

- **commit** (worker, every step's report, key ``ef``): the digest of the accumulators of the names
  the stage sends, as they are at the step's start (between two round closes they do not change: the
  digest is computed once per round);
- **show** (worker, the round-end fetch): beside the snapshot of the round's last inner step, a copy of
  the accumulators taken just before that round's fold (``ef/prev/``, must match the last step's
  ``ef``) and the accumulators after it (``ef/next/``), and the round they belong to (``ef_round``);
- **check** (driver): with Δ recomputed from the shown last inner step and the hosts' θ_start,
  ``e = β e_prev + Δ``; the contribution the hosts received (decoded, c) must be ``ctopk2(e)`` and
  ``e_next + c`` must be ``e``, each within FEEDBACK_REL_TOL of its norm (relative L2, the raw
  codec's tolerance; on CPU both are bit-equal, measured 0);
- **chain** (driver): the digest of the shown ``e_next`` is kept, and every report of the next round
  (on the same plan) must commit ``ef`` to it: a worker that showed an honest ``e_next`` but kept
  another one is caught there. A lie in the accumulators of a round that was not drawn is not seen
  (as a lie in an undrawn round's pseudo-gradient is not); whatever a liar sends beyond ``ctopk2(e)``
  while keeping ``e_next = e − c`` is paid back by its next messages (the feedback returns it).

Not covered: `--sync-overlap` (the fold runs beside the next round's steps, so no step boundary
separates ``e_prev`` from ``e_next``): its round ends are not checked, as under diloco.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fusionnode.verify.commitment import digest_tensors

EF_KEY = "ef"  # the commitment's key in a step's report
PREV, NEXT, ROUND = "ef/prev/", "ef/next/", "ef_round"
FEEDBACK_REL_TOL = 1e-3  # relative L2, as the raw codec's round-end tolerance (inner_checks.DELTA_REL_TOL)


# ---- the worker's side ---------------------------------------------------------------------------


def feedback_commit(sj: Any) -> dict[str, str]:
    """``{"ef": digest}`` of stage `sj`'s error-feedback accumulators (sparseloco), else {}; computed
    once per round close (`sj.rounds.closed`)."""
    rounds = getattr(sj, "rounds", None)
    fb = getattr(getattr(rounds, "sender", None), "feedback", None)
    if fb is None:
        return {}
    key = (rounds.closed, id(fb.acc), len(fb.acc))
    cached = getattr(rounds, "ef_digest", None)
    if cached is None or cached[0] != key:
        cached = (key, digest_tensors(dict(fb.acc)))
        rounds.ef_digest = cached
    return {EF_KEY: cached[1]}


def keep_before_fold(sj: Any, round_id: int) -> None:
    """At round `round_id`'s close, before its Δ is folded in: a copy of the accumulators (what the
    round-end check is shown as ``e_prev``), with the step of the inner snapshot then (the round's
    last). Kept only while the stage's steps are checked (an inner snapshot exists); replaced at the
    next close."""
    rounds = sj.rounds
    fb = getattr(getattr(rounds, "sender", None), "feedback", None)
    snap = getattr(sj, "inner_snap", None)
    if fb is None or snap is None:
        return
    rounds.ef_prev = (int(round_id), snap[0], {n: t.detach().clone() for n, t in fb.acc.items()})


def feedback_fetch(sj: Any) -> dict[str, torch.Tensor]:
    """The round-end fetch's error-feedback part: ``e_prev`` (kept at the last close), the
    accumulators now (``e_next``) and their round; {} when none was kept, or when the inner snapshot
    is no longer the closed round's last step (a transition check's fetch: it needs none)."""
    rounds = getattr(sj, "rounds", None)
    kept = getattr(rounds, "ef_prev", None)
    fb = getattr(getattr(rounds, "sender", None), "feedback", None)
    snap = getattr(sj, "inner_snap", None)
    if kept is None or fb is None or snap is None or snap[0] != kept[1]:
        return {}
    round_id, _step, prev = kept
    out = {PREV + n: t for n, t in prev.items()}
    out.update({NEXT + n: t.detach() for n, t in fb.acc.items()})
    out[ROUND] = torch.tensor([round_id], dtype=torch.int64)
    return out


# ---- the driver's side ---------------------------------------------------------------------------


def split_feedback(got: dict[str, torch.Tensor]) -> tuple[int | None, dict, dict]:
    """(round, e_prev, e_next) of a round-end fetch (removed from `got`); round None when not shown."""
    at = got.pop(ROUND, None)
    prev = {k[len(PREV) :]: got.pop(k) for k in [k for k in got if k.startswith(PREV)]}
    nxt = {k[len(NEXT) :]: got.pop(k) for k in [k for k in got if k.startswith(NEXT)]}
    if at is None or at.numel() != 1:
        return None, prev, nxt
    return int(at.reshape(-1)[0]), prev, nxt


def _rel(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], names: list[str]) -> float:
    err = sum(float((got[n].double() - want[n].double()).pow(2).sum()) for n in names)
    ref = sum(float(want[n].double().pow(2).sum()) for n in names)
    return math.sqrt(err) / max(math.sqrt(ref), 1e-30)


def feedback_mismatch(
    cfg: Any,
    names: list[str],
    delta: Mapping[str, torch.Tensor],
    prev: Mapping[str, torch.Tensor],
    nxt: Mapping[str, torch.Tensor],
    sent: Mapping[str, torch.Tensor],
) -> tuple[str, float]:
    """('', relative error) when the contribution the hosts received (`sent`, decoded) is the chunked
    top-k of ``e = β e_prev + Δ`` (`delta`: Δ recomputed) and the shown ``e_next`` is ``e − sent``;
    else (why not, relative error). `cfg`: the job's SyncConfig (β, chunk, k)."""
    from fusionnode.compress.pseudograd import CTOPK2

    missing = [n for n in names if n not in nxt or n not in sent]
    if missing:
        return f"no error feedback shown for {missing[:3]}", math.inf
    e: dict[str, torch.Tensor] = {}
    want: dict[str, torch.Tensor] = {}
    for n in names:
        d = delta[n].detach().to(torch.float32)
        acc = prev.get(n)
        # ErrorFeedbackAccumulator.compress: the first round starts the accumulator at Δ
        acc = d.clone() if acc is None else acc.detach().to(torch.float32).clone().mul_(cfg.ef_decay).add_(d)
        e[n] = acc
        want[n] = CTOPK2.encode_decoded(acc, chunk=cfg.chunk, k=cfg.k_per_chunk)[1]
    rel = _rel(sent, want, names)
    if not rel <= FEEDBACK_REL_TOL:
        return (
            f"its message is not the chunked top-k of its error feedback plus the recomputed Δ "
            f"(relative error {rel:.3g}, tolerance {FEEDBACK_REL_TOL:g})",
            rel,
        )
    kept = {n: nxt[n].detach().to(torch.float32) + sent[n].to(torch.float32) for n in names}
    rel_next = _rel(kept, e, names)
    if not rel_next <= FEEDBACK_REL_TOL:
        return (
            f"the error feedback it kept is not what it had less what it sent (relative error "
            f"{rel_next:.3g}, tolerance {FEEDBACK_REL_TOL:g})",
            rel_next,
        )
    return "", max(rel, rel_next)


def next_digest(nxt: Mapping[str, torch.Tensor]) -> str:
    """The digest the next round's reports must commit ``ef`` to: the shown ``e_next``."""
    return digest_tensors(dict(nxt))


__all__ = [
    "EF_KEY",
    "FEEDBACK_REL_TOL",
    "feedback_commit",
    "feedback_fetch",
    "feedback_mismatch",
    "keep_before_fold",
    "next_digest",
    "split_feedback",
]
