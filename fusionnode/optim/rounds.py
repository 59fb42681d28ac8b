"""The round protocol of the low-communication sync modes, as plain functions on named tensors.

A round is H inner steps. At its end every replica sends, per parameter name, its pseudo-gradient
Δr = θ_start − θ_end in the sync codec (`ReplicaSync.encode`), with the tokens it processed in the
round. The owner of those names (an optimizer host, or the in-process reference) collects one
contribution per replica (`RoundCombiner.add`, which refuses a round other than the open one, so
no round is applied twice), then closes the round (`RoundCombiner.close`) into a `RoundUpdate`
that it applies to its masters and sends to every replica, which applies it to θ_start
(`apply_update`): both sides compute the same bits.

- diloco: the update carries u, the Nesterov outer step on the token-weighted mean of the decoded
  pseudo-gradients, encoded in the sync codec; θ <- θ − decode(u).
- sparseloco: the update relays every replica's encoded message and its token weight (SparseLoCo's
  all-gather); θ <- θ − outer_lr · Σ w_r ĉr / Σ w_r, computed the same way by every receiver.
  A replica already holds its own message (it sent it): the host leaves it out of what it sends
  that replica (`RoundUpdate.nbytes_to`, `own_message`), and the replica puts back the bytes it
  sent, so every receiver still sums the same messages in the same order (the same bits) while
  the download of R replicas falls from R·R messages to R·(R − 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fusionnode.compress.pseudograd import ErrorFeedbackAccumulator, encode_pseudograd
from fusionnode.errors import FusionNodeError
from fusionnode.optim.outer import AveragedOuter, NesterovOuter, make_outer, weighted_mean
from fusionnode.sync import SyncConfig
from fusionnode.verify.contrib import clip_scales
from fusionnode.wire.codec_api import EncodedTensor
from fusionnode.wire.limits import DEFAULT_LIMITS, Limits
from fusionnode.wire.tensors import decode_tensor, pack_encoded


class RoundError(FusionNodeError, ValueError):
    """A contribution to a round that is not open, or a second one from the same replica."""


def encoded_bytes(encs: Mapping[str, EncodedTensor]) -> int:
    """Bytes the encoded tensors take on the wire (their msgpack form, descriptor included)."""
    return sum(len(pack_encoded(e)) for e in encs.values())


def pseudo_gradient(start: Mapping[str, Tensor], end: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Δ = θ_start − θ_end per name, in float32."""
    return {n: start[n].detach().to(torch.float32) - end[n].detach().to(torch.float32) for n in start}


class ReplicaSync:
    """A replica's side of the round: encodes its pseudo-gradient (SparseLoCo: through its error
    feedback, which stays on the replica)."""

    def __init__(self, cfg: SyncConfig) -> None:
        self.cfg = cfg
        self.feedback = (
            ErrorFeedbackAccumulator(cfg.ef_decay, cfg.chunk, cfg.k_per_chunk)
            if cfg.mode == "sparseloco"
            else None
        )

    def encode(self, delta: Mapping[str, Tensor]) -> dict[str, EncodedTensor]:
        out: dict[str, EncodedTensor] = {}
        for name in sorted(delta):
            if self.feedback is not None:
                out[name], _ = self.feedback.compress(name, delta[name])
            else:
                out[name] = encode_pseudograd(delta[name], self.cfg.codec)
        return out


NO_REPLICA = -1  # the replica of a relayed message that is no replica's (`RoundCombiner._nothing`)


@dataclass
class RoundUpdate:
    """What closes a round, sent to every replica: u per name (diloco), or every replica's message
    with its token weight (sparseloco)."""

    round: int
    mode: str
    outer_lr: float
    updates: dict[str, EncodedTensor] = field(default_factory=dict)  # diloco
    relayed: list[tuple[float, dict[str, EncodedTensor]]] = field(default_factory=list)  # sparseloco
    relayed_replicas: list[int] = field(default_factory=list)  # sparseloco: the replica of each relayed

    def nbytes(self) -> int:
        if self.mode == "diloco":
            return encoded_bytes(self.updates)
        return sum(encoded_bytes(encs) for _, encs in self.relayed)

    def nbytes_to(self, replica: int) -> int:
        """Bytes sent to `replica`: the update, less its own relayed message (it holds that one)."""
        if replica not in self.relayed_replicas:
            return self.nbytes()
        own = self.relayed[self.relayed_replicas.index(replica)][1]
        return self.nbytes() - encoded_bytes(own)


def own_message(
    sent: Mapping[str, EncodedTensor], received: Mapping[str, EncodedTensor], names: list[str]
) -> dict[str, EncodedTensor]:
    """A replica's own relayed message rebuilt from what the host sent of it (`received`: the names
    the replica did not send) and what the replica sent (`sent`): the same bytes the host relayed to
    every other replica. RoundError unless together they give exactly `names`."""
    got = {n: received[n] for n in received}
    got.update({n: sent[n] for n in names if n in sent})
    if set(got) != set(names):
        raise RoundError(f"the own message lacks or adds names: {sorted(set(got) ^ set(names))[:3]}")
    return got


def update_tensors(
    update: RoundUpdate, names: list[str], limits: Limits = DEFAULT_LIMITS
) -> dict[str, Tensor]:
    """The float32 amount to subtract from θ for each of `names`."""
    if update.mode == "diloco":
        return {n: decode_tensor(update.updates[n], limits).to(torch.float32) for n in names}
    weights = [w for w, _ in update.relayed]
    out = {}
    for n in names:
        mean = weighted_mean([decode_tensor(encs[n], limits) for _, encs in update.relayed], weights)
        out[n] = mean.mul_(update.outer_lr)
    return out


@torch.no_grad()
def apply_update(params: Mapping[str, Tensor], update: RoundUpdate, limits: Limits = DEFAULT_LIMITS) -> None:
    """θ <- θ − u for every name of `params` (in place)."""
    for name, u in update_tensors(update, sorted(params), limits).items():
        p = params[name]
        if u.shape != p.shape:
            raise RoundError(
                f"round {update.round}: update of {name!r} has shape {tuple(u.shape)}, not {tuple(p.shape)}"
            )
        p.sub_(u.to(p.dtype))


class RoundCombiner:
    """The owner's side of the rounds for a set of names: one contribution per replica per round,
    rounds closed in order, each exactly once."""

    def __init__(
        self,
        cfg: SyncConfig,
        replicas: int,
        names: frozenset[str] | set[str] | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        """`names`: the names every replica must send before the round closes (an optimizer host's
        shard, sent piecewise by the stages that hold them); None = whatever the first message holds."""
        if replicas < 1:
            raise ValueError("a round needs at least one replica")
        self.cfg = cfg
        self.replicas = replicas
        self.names = frozenset(names) if names is not None else None
        self.limits = limits
        self.outer: NesterovOuter | AveragedOuter = make_outer(cfg)
        self.round = 0  # the open round
        self.pending: dict[int, tuple[float, dict[str, EncodedTensor]]] = {}
        self.received_bytes = 0  # cumulative, every contribution accepted
        self.sent_bytes = 0  # cumulative, the update once per replica
        self.applied: list[int] = []  # the ledger: the ids of the rounds closed, in order
        # --contrib-policy (verify/contrib.py): the norm floor's multiple (None: off); `hold`: a complete
        # round waits for the driver's verdict (`close(verdict=...)`) before it closes
        self.clip: float | None = None
        self.hold = False
        self.last_weights: list[float] = []  # each replica's weight in the last round closed
        self._gram: list[list[float]] | None = None  # of the open round's contributions (`gram`)

    def drop_pending(self) -> list[int]:
        """Forget the open round's contributions (a re-plan: the round is redone by the new plan's
        stages); returns the replicas whose contributions were dropped."""
        dropped = sorted(self.pending)
        self.pending = {}
        self._gram = None
        return dropped

    def state(self) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """What a checkpoint keeps of the rounds: (the open round, the ledger and the outer
        optimizer's scalars; its tensors, e.g. DiLoCo's Nesterov buffer, cloned)."""
        outer = self.outer.state_dict()
        bufs = {n: t.clone() for n, t in outer.pop("buf", {}).items()}
        return {"round": self.round, "applied": list(self.applied), "outer": outer}, bufs

    def load_state(self, meta: Mapping[str, Any], bufs: Mapping[str, Tensor]) -> None:
        """Restore `state()`; pending contributions are dropped."""
        outer = dict(meta["outer"])
        if isinstance(self.outer, NesterovOuter):
            outer["buf"] = dict(bufs)
        self.outer.load_state_dict(outer)
        self.round = int(meta["round"])
        self.applied = [int(r) for r in meta["applied"]]
        self.pending = {}
        self._gram = None

    def start_at(self, round_id: int) -> None:
        """A combiner that continues a job at round `round_id` with new outer state (the parameters
        came from the driver's checkpoint; no shard checkpoint held the outer state)."""
        self.round = int(round_id)
        self.applied = list(range(round_id))
        self.pending = {}
        self._gram = None

    def complete(self, verdict: list[float] | None = None) -> bool:
        """Whether every replica sent every name; with the driver's `verdict`, every replica it keeps
        (weight > 0): a replica it gives 0 (one that lost its round: train/free_recovery.py) may have
        sent nothing, or part, which the close leaves out. A verdict keeping none needs them all."""
        need = [r for r, v in enumerate(verdict or ()) if v > 0] or range(self.replicas)
        if any(r not in self.pending for r in need):
            return False
        if self.names is None:
            return True
        return all(set(self.pending[r][1]) >= self.names for r in need)

    def add(self, round_id: int, replica: int, tokens: float, encs: dict[str, EncodedTensor]) -> bool:
        """Accept (part of) replica `replica`'s contribution to `round_id`; returns whether the round
        is complete. Raises RoundError for a closed or future round, a name sent twice, a name not
        expected, tokens that differ from the replica's earlier part, or a bad replica."""
        if round_id != self.round:
            why = "already applied" if round_id < self.round else "not open yet"
            raise RoundError(f"round {round_id} is {why} (the open round is {self.round})")
        if not 0 <= replica < self.replicas:
            raise RoundError(f"replica {replica} is not one of the {self.replicas} replicas")
        if not tokens > 0:
            raise RoundError(f"replica {replica} reports {tokens} tokens for round {round_id}")
        if self.names is not None and not set(encs) <= self.names:
            raise RoundError(f"round {round_id}: names not held here: {sorted(set(encs) - self.names)[:3]}")
        held = self.pending.get(replica)
        if held is not None:
            if self.names is None or set(encs) & set(held[1]):
                raise RoundError(f"replica {replica} already contributed to round {round_id}")
            if float(tokens) != held[0]:
                raise RoundError(f"replica {replica} reports {tokens} tokens, earlier {held[0]}")
            held[1].update(encs)
        else:
            self.pending[replica] = (float(tokens), dict(encs))
        self.received_bytes += encoded_bytes(encs)
        self._gram = None
        return self.complete()

    def gram(self) -> list[list[float]]:
        """The dot products of the replicas' pseudo-gradients over the names held here (the open
        round, complete): [r][q] = <Δr, Δq>; the diagonal holds the squared norms."""
        if self._gram is not None:
            return self._gram
        out = [[0.0] * self.replicas for _ in range(self.replicas)]
        for n in sorted(self.pending[0][1]):  # one name at a time: R decoded tensors in memory
            ts = [
                decode_tensor(self.pending[r][1][n], self.limits).double().reshape(-1)
                for r in range(self.replicas)
            ]
            for r in range(self.replicas):
                for q in range(r, self.replicas):
                    out[r][q] += float(ts[r] @ ts[q])
        for r in range(self.replicas):
            for q in range(r):
                out[r][q] = out[q][r]
        self._gram = out  # until the round's contributions change
        return out

    def norms(self) -> list[float]:
        """Each replica's pseudo-gradient norm over the names held here (the open round, complete)."""
        if self._gram is not None:
            return [math.sqrt(max(self._gram[r][r], 0.0)) for r in range(self.replicas)]
        out = []
        for r in range(self.replicas):
            if r not in self.pending:  # a replica the verdict dropped, which sent nothing: not weighed
                out.append(0.0)
                continue
            encs = self.pending[r][1]
            sq = sum(float(decode_tensor(encs[n], self.limits).double().pow(2).sum()) for n in sorted(encs))
            out.append(math.sqrt(sq))
        return out

    def weights(self, verdict: list[float] | None = None) -> tuple[list[float], list[float]]:
        """(each replica's weight in the outer step's mean, the floor's scale of it): the plan's
        tokens x the floor's norm scale (`clip`) x the driver's verdict (1 kept, 0 dropped). With a
        verdict the floor's reference is the kept replicas' norms only (a dropped one, a liar sending
        a tiny contribution, must not scale the kept ones down), each norm over its verdict (under
        --round-close time a replica's steps over the round's most: norms compared per step, so one
        that did 3 steps is not scaled down beside one that did 1), and a dropped replica never gets a
        weight: a round whose kept replicas weigh nothing is a RoundError, not the floor's. A
        verdict that drops every replica weighs nothing: `close` applies nothing then."""
        tokens = [self.pending[r][0] if r in self.pending else 0.0 for r in range(self.replicas)]
        norms = self.norms() if self.clip is not None else None
        if verdict is not None:
            if len(verdict) != self.replicas or any(not 0 <= v <= 1 for v in verdict):
                raise RoundError(f"a verdict needs one weight in [0, 1] per replica, got {verdict}")
            kept = [r for r, v in enumerate(verdict) if v > 0]
            if kept:
                scales = [0.0] * self.replicas
                if norms is not None:  # per unit of the verdict: per inner step under --round-close time
                    got = clip_scales([norms[r] for r in kept], self.clip, [verdict[r] for r in kept])
                    for r, sc in zip(kept, got, strict=True):
                        scales[r] = sc
                else:
                    for r in kept:
                        scales[r] = 1.0
                judged = [w * s * float(v) for w, s, v in zip(tokens, scales, verdict, strict=True)]
                if not sum(judged) > 0:
                    raise RoundError(f"round {self.round}: no kept contribution keeps a weight")
                return judged, scales
        scales = clip_scales(norms, self.clip) if norms is not None else [1.0] * self.replicas
        floor = [w * s for w, s in zip(tokens, scales, strict=True)]
        if not sum(floor) > 0:
            raise RoundError(f"round {self.round}: no contribution keeps a weight")
        return floor, scales

    def close(
        self, masters: Mapping[str, Tensor] | None = None, verdict: list[float] | None = None
    ) -> RoundUpdate:
        """Close the open round: the update (also applied to `masters` when given); `verdict`: the
        driver's weight of each replica (--contrib-policy score, or 0 for a replica that lost its
        round under --round-close time). A verdict that drops every replica (each has a worker a
        round-end check caught) closes the round applying nothing: a zero update, the outer
        optimizer's state untouched."""
        if not self.complete(verdict):
            raise RoundError(f"round {self.round} is missing contributions")
        if verdict is not None and len(verdict) == self.replicas and not any(v > 0 for v in verdict):
            return self._closed(self._nothing(), [0.0] * self.replicas, masters)
        if self.clip is not None or verdict is not None:
            weights = self.weights(verdict)[0]
        else:
            weights = [self.pending[r][0] for r in range(self.replicas)]
        # replica order: same bits everywhere; a replica of weight 0 is left out
        kept_replicas = [r for r, w in enumerate(weights) if w > 0]
        contributions = [(weights[r], self.pending[r][1]) for r in kept_replicas]
        update = RoundUpdate(self.round, self.cfg.mode, self.cfg.outer_lr)
        if self.cfg.mode == "diloco":
            kept = [w for w, _ in contributions]
            names = sorted(contributions[0][1])
            mean = {
                n: weighted_mean([decode_tensor(encs[n], self.limits) for _, encs in contributions], kept)
                for n in names
            }
            u = self.outer.update(mean)
            update.updates = {n: encode_pseudograd(u[n], self.cfg.codec) for n in names}
        else:
            self.outer.rounds += 1
            update.relayed = contributions
            update.relayed_replicas = kept_replicas
        return self._closed(update, weights, masters)

    def _nothing(self) -> RoundUpdate:
        """A round's update that changes nothing: u = 0 (diloco), or one zero message relayed at
        weight 1 as no replica's (sparseloco: its mean is 0). The workers' pulls take it as any."""
        update = RoundUpdate(self.round, self.cfg.mode, self.cfg.outer_lr)
        encs = self.pending[0][1]
        zero = {n: encode_pseudograd(torch.zeros(encs[n].shape), self.cfg.codec) for n in sorted(encs)}
        if self.cfg.mode == "diloco":
            update.updates = zero
        else:
            update.relayed, update.relayed_replicas = [(1.0, zero)], [NO_REPLICA]
        return update

    def _closed(
        self, update: RoundUpdate, weights: list[float], masters: Mapping[str, Tensor] | None
    ) -> RoundUpdate:
        if masters is not None:
            apply_update(masters, update, self.limits)
        self.sent_bytes += sum(update.nbytes_to(r) for r in range(self.replicas))
        self.last_weights = list(weights)
        self.pending = {}
        self._gram = None
        self.applied.append(self.round)
        self.round += 1
        return update


# ---- the driver's side: which stage sends which name, and what closes a round ---------------------
def contributing_names(stage_args: list[Any]) -> dict[int, list[str]]:
    """Per stage id, the names it sends at a round's end: each name of a replica once, by the first
    of its stages (in stage order) that holds it (a tied parameter lives on two stages). A stage is a
    map or an object with stage, replica, param_specs and frozen."""

    def get(a: Any, key: str) -> Any:
        return a.get(key) if isinstance(a, dict) else getattr(a, key, None)

    out: dict[int, list[str]] = {}
    seen: set[tuple[int, str]] = set()
    for a in sorted(stage_args, key=lambda a: get(a, "stage")):
        frozen = set(get(a, "frozen") or [])
        mine = []
        for name in sorted(get(a, "param_specs")):
            if name in frozen or (get(a, "replica"), name) in seen:
                continue
            seen.add((get(a, "replica"), name))
            mine.append(name)
        out[get(a, "stage")] = mine
    return out


def round_of(cfg: SyncConfig, step: int, total_steps: int) -> int | None:
    """The id of the round that `step` closes (rounds closed by step count), or None."""
    return cfg.round_index(step) if cfg.round_closes(step, total_steps) else None


def round_tokens(cfg: SyncConfig, step: int, samples: int, seq_len: int) -> int:
    """Tokens a replica of `samples` sequences per step processed in the round `step` closes."""
    return samples * seq_len * (cfg.offset(step) + 1)
