"""How the optimizer hosts weigh the data-parallel replicas' contributions: `--contrib-policy`.

Two layers for the rounds of ``--sync diloco|sparseloco`` (where each replica's pseudo-gradient
arrives apart, held by the host until the round closes):

- the floor, on every host (``clip`` and ``score``): each replica's pseudo-gradient norm over the
  host's shard is compared with the median of the replicas' positive norms (the lower median: with
  two replicas, the smaller one; a zero contribution scales nobody down; with a verdict, of the kept
  replicas' norms only: a dropped tiny one cannot shrink the kept ones, optim/rounds.py; under
  ``--round-close time``, per inner step: a replica that did 3 steps beside one that did 1 is not
  scaled down for it), and a contribution above ``clip`` x that median has its weight scaled
  by ``clip x median / norm``: a liar that scales its contribution up is scaled back down, whatever
  it sends. Honest replicas' norms differ by far less than 2x, so their weights, and the bits of the
  outer step, are what they were without the floor.
- scoring, by the driver (``score``): the hosts hold the complete round; the driver, which holds
  the whole model on its CPU (train/scoring.py), evaluates on a held-out batch none of the replicas
  trained on (a validation batch it draws at random) the loss at the round's start and at the
  round's start moved by each replica's contribution alone; a contribution that does not help and
  points away from every other replica's (``verdict``: its gain under a quarter of the best, and its
  largest cosine with another one, from the hosts' Gram matrices, under 0.03), or whose gain is
  clearly negative (at most -0.25 x the best, whatever its direction) gets weight 0, and the
  hosts close the round with the driver's verdict times the floor's weights (`opt.round_verdict`).
  Measured on gpt2-tiny (tests/test_contrib.py): honest replicas' cosines 0.29-0.65 (diloco) and
  0.06-0.11 (sparseloco's sparse messages), a random pseudo-gradient's 0.0003-0.003; honest gains on
  one batch go from +1.6 early to -0.2..+0.2 later, a random one's stay within +-0.005.

The weights multiply the plan's token weights of the outer step's weighted mean (optim/outer.py),
so the aggregate stays a weighted mean of the replicas' contributions: SparseLoCo's receivers,
which compute it themselves from the relayed messages and their weights, need nothing new (a
coordinate-wise trimmed mean would not fit there; the norm floor does, in both modes).

Under ``--sync step`` the floor weighs each step's gradients the same way, at 5 x the lower median
by default (one step's gradients are noisier than a round's pseudo-gradients; optim/robust.py: the
host's store holds the replicas' gradients of a step apart until it applies, R x the shard's
gradient memory instead of 1 x); scoring is for the rounds only (the spot-checks' gradient check
covers a step's pushes).

``auto``: ``score`` for a round job and ``clip`` for a step job in a public swarm, ``off`` in a
private or local one (as `--verify-policy` does: verify/policy.py).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

CONTRIB_POLICIES = ("auto", "off", "clip", "score")
DEFAULT_CLIP_MULT = 2.0  # a contribution's norm above this multiple of the median is scaled down
# ... under --sync step: one step's gradients of small replica batches are noisier than a round's
# pseudo-gradients (honest ratios up to 2.65x measured on 4-sample replicas, 1.7x for rounds)
DEFAULT_STEP_CLIP_MULT = 5.0
DEFAULT_KEEP_RATIO = 0.25  # a scored contribution is kept when it gains >= this fraction of the best
DEFAULT_MIN_AGREE = 0.03  # ... or when its cosine with another replica's contribution is at least this
# a cosine with another replica this high rescues any gain, however negative: one small held-out batch
# can rank honest replicas either way (an honest diloco pair scored [-0.113, 0.034] at cosine 0.45 in
# tests/test_sync_components.py), while a liar needs most of its norm off the honest direction to do
# harm (a 12%-honest, 2x-norm mix: cosine 0.058). Honest cosines measured: diloco 0.29-0.84,
# sparseloco (1/16 top-k, 2-bit) 0.077-0.10, so under sparseloco only gains within noise are rescued
STRONG_AGREE = 0.2


@dataclass(frozen=True)
class ContribPolicy:
    policy: str  # "off" | "clip" | "score" (resolved)
    clip: float = DEFAULT_CLIP_MULT
    keep_ratio: float = DEFAULT_KEEP_RATIO
    min_agree: float = DEFAULT_MIN_AGREE

    @property
    def floor(self) -> bool:
        return self.policy != "off"

    @property
    def score(self) -> bool:
        return self.policy == "score"

    def host_config(self) -> dict[str, object] | None:
        """What `opt.init` tells a host (`OptInit.contrib`); None when the policy is off."""
        return {"clip": self.clip, "score": self.score} if self.floor else None

    def to_dict(self) -> dict[str, object]:
        return {"policy": self.policy, "clip": self.clip, "keep_ratio": self.keep_ratio}


def resolve_contrib_policy(
    policy: str | None, *, private: bool, rounds: bool, clip: float | None = None
) -> ContribPolicy:
    """The policy in force from the user's choice (None: auto); ValueError on a bad value or on
    ``clip``/``score`` for a job without rounds."""
    policy = policy or "auto"
    if policy not in CONTRIB_POLICIES:
        raise ValueError(f"contrib policy must be one of {', '.join(CONTRIB_POLICIES)}, got {policy!r}")
    if clip is not None and not (
        isinstance(clip, int | float) and not isinstance(clip, bool) and 1 <= clip < math.inf
    ):
        raise ValueError(f"contrib clip must be a number >= 1, got {clip!r}")
    if policy == "auto":
        policy = "off" if private else ("score" if rounds else "clip")
    elif policy == "score" and not rounds:
        raise ValueError(
            "--contrib-policy score judges the replicas' pseudo-gradients of --sync diloco|sparseloco "
            "rounds; under --sync step use clip (the hosts' norm floor on each step's gradients)"
        )
    default = DEFAULT_CLIP_MULT if rounds else DEFAULT_STEP_CLIP_MULT
    return ContribPolicy(policy, float(default if clip is None else clip))


def clip_scales(
    norms: Sequence[float], mult: float = DEFAULT_CLIP_MULT, work: Sequence[float] | None = None
) -> list[float]:
    """Per contribution, min(1, mult x reference / its norm), the reference being the lower median of
    the positive norms (with two, the smaller one): 1 for every contribution within `mult` x the
    reference. A zero norm contributes nothing and is left out of the reference (a replica sending
    zeros must not scale the others down to nothing); a non-finite norm gets 0.

    `work` (rounds closed by time): each contribution's inner steps, or any measure proportional to
    them (the driver's verdict: its steps over the round's most). Norms are then compared per step:
    a replica that did 3 steps is judged against the others' norms scaled to 3 steps, not against a
    replica that did 1, so honest work is not scaled down for being more, and a liar scaling its
    contribution up is still bounded. A pseudo-gradient's norm grows about linearly with its steps
    (exponent 0.88-1.38 measured over 1-8 inner steps of gpt2-tiny, higher in the lr warm-up);
    sparseloco's messages, which carry the error feedback, slower (about 0.6 for 3 steps against 1):
    there a 1-step replica beside an 8-step one may be scaled a little, at a ninth of the weight."""
    if work is not None:
        if len(work) != len(norms) or any(not (math.isfinite(w) and w > 0) for w in work):
            raise ValueError(f"work must be one positive number per contribution, got {list(work)}")
        per_step = [n / w for n, w in zip(norms, work, strict=True)]
        return clip_scales(per_step, mult)
    positive = [n for n in norms if math.isfinite(n) and n > 0]
    bound = mult * statistics.median_low(positive) if positive else math.inf
    out = []
    for n in norms:
        if not math.isfinite(n):
            out.append(0.0)
        elif n > bound:
            out.append(bound / n)
        else:
            out.append(1.0)
    return out


def agreement(gram: Sequence[Sequence[float]]) -> list[float]:
    """Per replica, its largest cosine similarity with another replica's contribution, from the Gram
    matrix of the contributions (summed over the hosts' shards); 1 for a lone replica."""
    n = len(gram)
    norms = [math.sqrt(max(gram[r][r], 0.0)) for r in range(n)]
    out = []
    for r in range(n):
        cos = [gram[r][q] / (norms[r] * norms[q]) for q in range(n) if q != r and norms[r] * norms[q] > 0]
        out.append(max(cos) if cos else (1.0 if n == 1 else 0.0))
    return out


def conclusive(scores: Sequence[float], keep_ratio: float = DEFAULT_KEEP_RATIO) -> bool:
    """Whether the gains say anything: some gain is positive, and the best is at least `keep_ratio`
    of the largest loss change. Not when a larger change went the wrong way (an honest replica's
    noise late in training; a random direction barely moves the loss either way, so a tiny positive
    gain of it must not outrank an honest one)."""
    finite = [s for s in scores if math.isfinite(s)]
    best = max(finite) if finite else -math.inf
    return best > 0 and best >= keep_ratio * max(abs(s) for s in finite)


def verdict(
    scores: Sequence[float],
    keep_ratio: float = DEFAULT_KEEP_RATIO,
    agree: Sequence[float] | None = None,
    min_agree: float = DEFAULT_MIN_AGREE,
) -> list[float]:
    """Weight 0 for a contribution that does not help: its loss gain (score) is not positive or under
    `keep_ratio` of the best gain, and (with `agree`) it points away from every other replica's (its
    largest cosine similarity with another one is under `min_agree`) or its gain is clearly negative
    (at most -`keep_ratio` x the best: agreement over `min_agree` rescues a gain within noise, and only
    agreement over STRONG_AGREE a clearly negative one); 1 otherwise. All 1 when none
    gains, or when the best gain is under `keep_ratio` of the largest loss change (a held-out batch
    that tells nothing: the floor alone weighs the round).

    The gate on direction keeps honest replicas whose gain on one small batch is noise (late in
    training the honest gains are a few hundredths and one batch can rank them either way): honest
    pseudo-gradients start from the same parameters and share their main direction, a random or
    reversed one does not."""
    if not conclusive(scores, keep_ratio):
        return [1.0] * len(scores)
    best = max(s for s in scores if math.isfinite(s))
    out = []
    for r, s in enumerate(scores):
        helps = math.isfinite(s) and s > 0 and s >= keep_ratio * best
        noise = math.isfinite(s) and s > -keep_ratio * best  # a gain within one batch's noise
        cos = agree[r] if agree is not None and math.isfinite(agree[r]) else -math.inf
        rescued = cos >= STRONG_AGREE or (cos >= min_agree and noise)
        out.append(1.0 if helps or rescued else 0.0)
    return out


__all__ = [
    "CONTRIB_POLICIES",
    "DEFAULT_CLIP_MULT",
    "DEFAULT_KEEP_RATIO",
    "DEFAULT_MIN_AGREE",
    "DEFAULT_STEP_CLIP_MULT",
    "ContribPolicy",
    "agreement",
    "clip_scales",
    "conclusive",
    "resolve_contrib_policy",
    "verdict",
]
