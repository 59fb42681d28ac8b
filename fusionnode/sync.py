"""How data-parallel replicas synchronise (`--sync`): the settings and `train`'s options for them.

Torch-free, so the CLI imports it at start-up. The CLI needs two hooks: `add_sync_args(parser)`
while building `train`'s parser, and `sync_from_args(args)` (ConfigError naming the option, which
the CLI turns into a usage error, exit 2) before the job starts.

`step` (the default) combines the replicas' gradients after every step; `diloco` and `sparseloco`
let each replica run `inner_steps` (H) inner steps alone, then exchange pseudo-gradients in rounds
(the outer optimizers are in `optim/outer.py`, the round protocol in `optim/rounds.py`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from fusionnode.errors import ConfigError

SYNC_MODES = ("step", "diloco", "sparseloco")
DEFAULT_SYNC = "step"
DEFAULT_INNER_STEPS = 15  # H for the low-communication modes when the user gives none (SparseLoCo's range)
DEFAULT_SYNC_BUDGET = 0.10  # --sync-budget: share of a step's wall-clock time a round's exchange may take
DEFAULT_OUTER_LR = {"diloco": 0.7, "sparseloco": 1.0}  # DiLoCo paper; SparseLoCo's plain averaged step
DEFAULT_OUTER_MOMENTUM = 0.9  # DiLoCo paper
DEFAULT_TOPK_DENSITY = 1 / 64  # SparseLoCo keeps 1-3% per chunk
DEFAULT_CHUNK = 4096  # elements per top-k chunk (SparseLoCo: 64x64 blocks)
DEFAULT_EF_DECAY = 0.95  # error-feedback decay β (SparseLoCo)
# what closes a round (issue 19): H inner steps of every replica, in step (the default); or time:
# each replica steps at its own pace and the round closes when the fastest has done H (train/free_rounds.py)
ROUND_CLOSES = ("steps", "time")
# codecs a pseudo-gradient may travel in, per sync mode (the first is the default)
SYNC_CODECS: dict[str, tuple[str, ...]] = {
    "step": ("raw",),
    "diloco": ("raw", "fp16", "q8"),
    "sparseloco": ("ctopk2",),
}


def check_budget(budget: Any, option: str = "--sync-budget") -> float:
    """A sync budget as a float in (0, 1]; ConfigError naming `option` otherwise."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget):
        raise ConfigError(f"{option} {budget!r}: must be a number in (0, 1], a share of the step time")
    if not 0 < budget <= 1:
        raise ConfigError(
            f"{option} {budget}: must lie in (0, 1], the share of each step's wall-clock time the "
            "replicas' sync may take (0.1 = 10%)"
        )
    return float(budget)


@dataclass(frozen=True)
class SyncConfig:
    """How the data-parallel replicas synchronise. Invalid values raise ConfigError naming the option."""

    mode: str = DEFAULT_SYNC  # "step", "diloco" or "sparseloco"
    inner_steps: int = 1  # H: inner steps per round (1 for "step")
    outer_lr: float | None = None  # None = DEFAULT_OUTER_LR[mode]
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM  # diloco only
    codec: str | None = None  # pseudo-gradient codec; None = SYNC_CODECS[mode][0]
    topk_density: float = DEFAULT_TOPK_DENSITY  # sparseloco: kept share of each chunk
    chunk: int = DEFAULT_CHUNK  # sparseloco: elements per chunk
    ef_decay: float = DEFAULT_EF_DECAY  # sparseloco: error-feedback decay β
    # diloco/sparseloco: a round's exchange overlaps the next round's first `overlap_steps` (D)
    # inner steps; its outer update is applied after them (θ ← θ_global + the inner progress since
    # the round's end). None = H: one round late
    overlap: bool = False
    overlap_steps: int | None = None
    # diloco/sparseloco without --inner-steps: the planner chooses H so that a round's exchange,
    # amortised over H, takes at most this share of a step (plan/choose_h.py); until then
    # inner_steps holds DEFAULT_INNER_STEPS. None: H is the user's (or chosen already)
    budget: float | None = None
    round_close: str = "steps"  # ROUND_CLOSES
    # a synchronous warm-up (`--sync-warmup W`; the schedule: `round_start` below, protocol/ROUNDS.md
    # "Warm-up"): the first W steps run as rounds of `warmup_inner_steps` (h) steps, each installed at
    # its close (no overlap, D = 0), then rounds of H. h != 1 needs W > 0
    warmup_steps: int = 0
    warmup_inner_steps: int = 1

    def __post_init__(self) -> None:
        if self.mode not in SYNC_MODES:
            raise ConfigError(
                f"--sync {self.mode!r}: unknown sync mode; expected one of {', '.join(SYNC_MODES)}"
            )
        if (
            isinstance(self.inner_steps, bool)
            or not isinstance(self.inner_steps, int)
            or self.inner_steps < 1
        ):
            raise ConfigError(f"--inner-steps {self.inner_steps!r}: must be an integer >= 1")
        if self.mode == "step" and self.inner_steps != 1:
            raise ConfigError(
                f"--inner-steps {self.inner_steps}: --sync step synchronises every step; "
                "use --sync diloco or sparseloco for rounds of several steps"
            )
        if self.outer_lr is None:
            object.__setattr__(self, "outer_lr", DEFAULT_OUTER_LR.get(self.mode, 1.0))
        if not (
            isinstance(self.outer_lr, (int, float)) and math.isfinite(self.outer_lr) and self.outer_lr > 0
        ):
            raise ConfigError(f"--outer-lr {self.outer_lr!r}: must be a finite number > 0")
        object.__setattr__(self, "outer_lr", float(self.outer_lr))
        if not (isinstance(self.outer_momentum, (int, float)) and 0 <= self.outer_momentum < 1):
            raise ConfigError(f"--outer-momentum {self.outer_momentum!r}: must lie in [0, 1)")
        if self.codec is None:
            object.__setattr__(self, "codec", SYNC_CODECS[self.mode][0])
        if self.codec not in SYNC_CODECS[self.mode]:
            raise ConfigError(
                f"--sync-codec {self.codec!r}: unknown for --sync {self.mode}; "
                f"expected one of {', '.join(SYNC_CODECS[self.mode])}"
            )
        if not (isinstance(self.topk_density, (int, float)) and 0 < self.topk_density <= 1):
            raise ConfigError(f"--topk-density {self.topk_density!r}: must lie in (0, 1]")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or not 1 <= self.chunk <= 65536:
            raise ConfigError(f"--chunk {self.chunk!r}: must be an integer in [1, 65536]")
        if not (isinstance(self.ef_decay, (int, float)) and 0 <= self.ef_decay <= 1):
            raise ConfigError(f"--ef-decay {self.ef_decay!r}: must lie in [0, 1]")
        if not isinstance(self.overlap, bool):
            raise ConfigError(f"--sync-overlap {self.overlap!r}: must be true or false")
        if self.overlap and self.mode == "step":
            raise ConfigError(
                "--sync-overlap: --sync step has no rounds to overlap; use diloco or sparseloco"
            )
        d = self.overlap_steps
        if d is not None and (not self.overlap or isinstance(d, bool) or not isinstance(d, int)):
            raise ConfigError(f"--overlap-steps {d!r}: an integer, with --sync-overlap only")
        if d is not None and not 1 <= d <= self.inner_steps:
            raise ConfigError(f"--overlap-steps {d}: must lie in [1, H = {self.inner_steps}]")

        if self.round_close not in ROUND_CLOSES:
            raise ConfigError(
                f"--round-close {self.round_close!r}: expected one of {', '.join(ROUND_CLOSES)}"
            )
        if self.round_close == "time" and not self.rounds:
            raise ConfigError(
                "--round-close time: --sync step has no rounds to close; use diloco or sparseloco"
            )
        if self.budget is not None:
            if not self.rounds:
                raise ConfigError(
                    "--sync-budget: --sync step synchronises every step; use diloco or sparseloco"
                )
            object.__setattr__(self, "budget", check_budget(self.budget))
        self._check_warmup()

    def _check_warmup(self) -> None:
        """`--sync-warmup W` / `--warmup-inner-steps h`: ConfigError naming the option."""
        w, h = self.warmup_steps, self.warmup_inner_steps
        for name, v, low in (("--sync-warmup", w, 0), ("--warmup-inner-steps", h, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"{name} {v!r}: must be an integer >= {low}")
        if not w:
            if h != 1:  # no effect without a warm-up, and its keys would reach peers (to_dict)
                raise ConfigError(
                    f"--warmup-inner-steps {h} needs --sync-warmup W: without a warm-up it has no effect"
                )
            return
        if not self.rounds:
            raise ConfigError(
                "--sync-warmup: --sync step synchronises every step already; use diloco or sparseloco"
            )
        if self.round_close == "time":
            raise ConfigError(
                "--sync-warmup with --round-close time: the warm-up's rounds are closed by step count; "
                "use --round-close steps"
            )
        if self.budget is not None:
            raise ConfigError(
                "--sync-warmup with --sync-budget: the warm-up is counted in rounds of H; give --inner-steps"
            )
        if h > self.inner_steps:
            raise ConfigError(f"--warmup-inner-steps {h}: must lie in [1, H = {self.inner_steps}]")
        if w % self.inner_steps or w % h:
            raise ConfigError(
                f"--sync-warmup {w}: must be a multiple of H = {self.inner_steps} and of "
                f"--warmup-inner-steps {h} (the warm-up ends at a round boundary of both)"
            )

    @property
    def delay(self) -> int:
        """--sync-overlap: the inner steps of the next round a round's exchange may take (D)."""
        return self.overlap_steps or self.inner_steps

    def applies_delayed(self, step: int) -> bool:
        """--sync-overlap: whether the previous round's update is applied after inner step `step`
        (the D-th step of a round; the D = H-th is its close, which applies it anyway). Not in the
        warm-up (its rounds are installed at their close)."""
        return self.overlap and step >= self.warmup_steps and self.offset(step) == self.delay - 1

    def round_index(self, step: int) -> int:
        """The round containing `step` (rounds closed by step count; the warm-up's rounds first)."""
        w, h = self.warmup_steps, self.inner_steps
        if step < w:
            return step // self.warmup_inner_steps
        return w // self.warmup_inner_steps + (step - w) // h

    def round_start(self, q: int) -> int:
        """The first step of round `q` (the step count after rounds 0..q-1)."""
        n = self.warmup_steps // self.warmup_inner_steps
        return q * self.warmup_inner_steps if q <= n else self.warmup_steps + (q - n) * self.inner_steps

    def offset(self, step: int) -> int:
        """Inner steps of its round before `step`."""
        return step - self.round_start(self.round_index(step))

    def is_boundary(self, steps_done: int) -> bool:
        """Whether `steps_done` steps end a round (0 included)."""
        return self.round_start(self.round_index(steps_done)) == steps_done

    def rounds_before(self, steps_done: int) -> int:
        """Rounds that start before step `steps_done` (those closed at a boundary)."""
        return 0 if steps_done <= 0 else self.round_index(steps_done - 1) + 1

    def overlapped_before(self, step: int) -> bool:
        """--sync-overlap: whether the round containing `step` follows an overlapped round (one
        whose update it re-bases on): every round after the first one past the warm-up."""
        return self.overlap and step >= self.warmup_steps + self.inner_steps

    @property
    def rounds(self) -> bool:
        """Whether replicas train alone between syncs (diloco, sparseloco)."""
        return self.mode != "step"

    @property
    def k_per_chunk(self) -> int:
        """Elements kept per full chunk: ceil(density * chunk), at least 1."""
        return max(1, min(self.chunk, math.ceil(self.topk_density * self.chunk - 1e-9)))

    @property
    def wire_ratio(self) -> float:
        """Bytes a round's pseudo-gradient takes on the wire per float32 byte of the parameters,
        for the planner's price of a round (plan/syncprice.py): raw 1, fp16 1/2, q8 about 1/4 (one
        float32 scale per row left out), ctopk2 per chunk 8 bytes of scales plus k positions (u8 up
        to chunks of 256, else u16) and k 2-bit values."""
        if self.codec == "ctopk2":
            k = self.k_per_chunk
            width = 1 if self.chunk <= 256 else 2
            return min(1.0, (8 + k * width + k / 4) / (4 * self.chunk))
        return {"raw": 1.0, "fp16": 0.5, "q8": 0.25}[self.codec]

    def price(self) -> dict[str, Any]:
        """The planner's price of this sync (plan/syncprice.SyncPrice's fields)."""
        if not self.rounds:
            return {"mode": "step", "inner_steps": 1, "wire_ratio": 1.0}
        return {"mode": self.mode, "inner_steps": self.inner_steps, "wire_ratio": self.wire_ratio}

    def round_closes(self, step: int, total_steps: int) -> bool:
        """Whether the round containing `step` ends after it (every H steps, and at the last step)."""
        return self.is_boundary(step + 1) or step + 1 == total_steps

    def checkpoint_due(self, steps_done: int, save_every: int) -> bool:
        """Round modes: whether the job is checkpointed after `steps_done` steps, a round boundary
        (a multiple of H, or of h in the warm-up) at or after a multiple of `save_every` passed since the previous boundary
        (a checkpoint mid-round would hold parameters the rounds have not caught up with)."""
        if not save_every or steps_done <= 0 or not self.is_boundary(steps_done):
            return False
        return steps_done // save_every > self.round_start(self.round_index(steps_done - 1)) // save_every

    def settles_at_close(self, step: int, total_steps: int, save_every: int) -> bool:
        """--sync-overlap: whether the commit closing the round at `step` also awaits its exchange and
        installs θ_global (no exchange left under way): at the job's last step, in the warm-up
        (`--sync-warmup`), and at a boundary where
        the job is checkpointed (a checkpoint, and a resume or a redone round from it, then hold what
        they hold without overlap)."""
        return self.overlap and (
            step + 1 == total_steps or step < self.warmup_steps or self.checkpoint_due(step + 1, save_every)
        )

    def to_dict(self) -> dict[str, Any]:
        """The settings as a map; without a warm-up its two keys are left out, so a job without one
        reads the same to peers that predate `--sync-warmup` (their `from_dict` refuses unknown keys).
        (h is 1 without a warm-up: `_check_warmup`.)"""
        out = asdict(self)
        if not self.warmup_steps:
            del out["warmup_steps"], out["warmup_inner_steps"]
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> SyncConfig:
        if not raw:
            return cls()
        if not isinstance(raw, Mapping):
            raise ConfigError(f"sync settings must be a map, got {type(raw).__name__}")
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown sync settings {sorted(unknown)}")
        return cls(**raw)


# planners whose layout honours rounds: simple (the replicas the user gives) and fusion (it prices
# the replicas' sync per round, amortised over H: plan/syncprice.py); even and memory, the baselines,
# price the sync every step
ROUND_PLANNERS = ("simple", "fusion")


def add_sync_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data-parallel sync (several replicas)")
    g.add_argument(
        "--sync",
        choices=SYNC_MODES,
        default="step",
        help="how replicas synchronise: every step through the optimizer hosts (step, the default), "
        "or every --inner-steps steps by pseudo-gradients: DiLoCo (diloco) or SparseLoCo (sparseloco)",
    )
    g.add_argument(
        "--inner-steps",
        type=int,
        default=None,
        metavar="H",
        help="inner steps per round with diloco/sparseloco (default: the planner's choice for --sync-budget "
        f"where it plans the job (plan, simulate, train --planner fusion), else {DEFAULT_INNER_STEPS}; 1 with step)",
    )
    g.add_argument(
        "--sync-budget",
        type=float,
        default=None,
        metavar="F",
        help="diloco/sparseloco without --inner-steps: the share of each step's wall-clock time a round's "
        "exchange, amortised over H, may take; the planner chooses the smallest H (1..500) within it "
        f"(default {DEFAULT_SYNC_BUDGET:g}, i.e. {DEFAULT_SYNC_BUDGET * 100:.0f}%%)",
    )
    g.add_argument(
        "--outer-lr",
        type=float,
        default=None,
        help="outer learning rate (default: 0.7 diloco, 1.0 sparseloco)",
    )
    g.add_argument(
        "--outer-momentum",
        type=float,
        default=DEFAULT_OUTER_MOMENTUM,
        help="Nesterov momentum of the diloco outer step (default %(default)s)",
    )
    codecs = sorted({c for cs in SYNC_CODECS.values() for c in cs})
    g.add_argument(
        "--sync-codec",
        default=None,
        metavar="CODEC",
        help=f"pseudo-gradient codec: {', '.join(codecs)} (default: raw for diloco, ctopk2 for sparseloco; "
        "q8 is int8)",
    )
    g.add_argument(
        "--topk-density",
        type=float,
        default=DEFAULT_TOPK_DENSITY,
        help="sparseloco: share of each chunk sent (default 1/64)",
    )
    g.add_argument(
        "--topk-chunk",
        type=int,
        default=DEFAULT_CHUNK,
        help="sparseloco: elements per top-k chunk (default %(default)s)",
    )
    g.add_argument(
        "--ef-decay",
        type=float,
        default=DEFAULT_EF_DECAY,
        help="sparseloco: error-feedback decay (default %(default)s)",
    )
    g.add_argument(
        "--sync-overlap",
        action="store_true",
        help="diloco/sparseloco: send a round's pseudo-gradient and go on with the next round's inner "
        "steps; the round's outer update is applied after --overlap-steps of them (Streaming DiLoCo's "
        "delayed update)",
    )
    g.add_argument(
        "--overlap-steps",
        type=int,
        default=None,
        metavar="D",
        help="with --sync-overlap: inner steps of the next round a round's exchange may take, 1..H "
        "(default H: the update is applied one round late)",
    )
    g.add_argument(
        "--sync-warmup",
        type=int,
        default=0,
        metavar="W",
        help="diloco/sparseloco: a synchronous warm-up: the first W steps (a multiple of H) run as rounds of "
        "--warmup-inner-steps steps, each installed at its close (no overlap), then rounds of H (default 0: "
        "none; sparseloco's warm-up rounds are compressed like the others; peers older than this option "
        "refuse such a job)",
    )
    g.add_argument(
        "--warmup-inner-steps",
        type=int,
        default=1,
        metavar="h",
        help="needs --sync-warmup: inner steps per warm-up round, 1..H, dividing W (default %(default)s)",
    )
    g.add_argument(
        "--round-close",
        choices=ROUND_CLOSES,
        default="steps",
        help="diloco/sparseloco: what closes a round: H inner steps of every replica in step (steps, "
        "the default), or time: each replica steps at its own pace, the round closes when the fastest "
        "has done H, and each replica's pseudo-gradient weighs the tokens the driver fed it",
    )
    g.add_argument(
        "--round-steps",
        default=None,
        metavar="FILE",
        help="--local --round-close time: replay a swarm run's inner steps per replica and round, "
        "from its metrics file (--metrics-out) or a JSON list of per-round lists",
    )


def sync_from_args(args: argparse.Namespace, plans: bool | None = None) -> SyncConfig:
    """The SyncConfig of `train`'s (or `plan`'s, `simulate`'s) options, checked against the rest of
    the command. `plans`: whether the command's planner prices the sync and so can choose H for
    --sync-budget (default: `train --planner fusion` on the swarm).

    Raises ConfigError naming the option: H < 1, an unknown codec, a --sync the chosen planner or
    the run cannot honour, a budget outside (0, 1] or one nobody can honour (a share of zero is
    refused by `train`'s --shares parser).
    """
    mode = args.sync
    inner = args.inner_steps
    budget = getattr(args, "sync_budget", None)
    if plans is None:
        plans = getattr(args, "planner", "simple") == "fusion" and not getattr(args, "local", False)
    if budget is not None:
        check_budget(budget)
        if mode == "step":
            raise ConfigError("--sync-budget: --sync step synchronises every step; use diloco or sparseloco")
        if inner is not None:
            raise ConfigError(
                f"--sync-budget {budget:g} with --inner-steps {inner}: give one (the budget lets the "
                "planner choose H)"
            )
        if not plans:
            raise ConfigError(
                f"--sync-budget: only the planner prices the sync to choose H (use --planner fusion on the "
                f"swarm), or give --inner-steps (default {DEFAULT_INNER_STEPS})"
            )
    if mode != "step" and inner is None and plans:
        budget = DEFAULT_SYNC_BUDGET if budget is None else budget
    if inner is None:
        inner = 1 if mode == "step" else DEFAULT_INNER_STEPS
    cfg = SyncConfig(
        mode=mode,
        inner_steps=inner,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        codec=args.sync_codec,
        topk_density=args.topk_density,
        chunk=args.topk_chunk,
        ef_decay=args.ef_decay,
        overlap=bool(getattr(args, "sync_overlap", False)),
        overlap_steps=getattr(args, "overlap_steps", None),
        budget=budget,
        round_close=getattr(args, "round_close", "steps"),
        warmup_steps=getattr(args, "sync_warmup", 0),
        warmup_inner_steps=getattr(args, "warmup_inner_steps", 1),
    )
    if cfg.rounds:
        planner = getattr(args, "planner", "simple")
        if planner not in ROUND_PLANNERS:
            raise ConfigError(
                f"--planner {planner} prices data-parallel sync every step and cannot honour --sync {mode}; "
                "use --planner fusion, or --planner simple with --replicas or --shares"
            )
        if getattr(args, "offload", "auto") == "off":
            raise ConfigError(f"--sync {mode} closes rounds on the optimizer hosts: use --offload on or auto")
        if getattr(args, "rebalance_every", 0):
            raise ConfigError(f"--rebalance-every cannot move stages in the middle of a --sync {mode} round")
    round_steps = getattr(args, "round_steps", None)
    if cfg.round_close == "time":
        time_close_refusals(
            offload=getattr(args, "offload", "auto"),
            local=bool(getattr(args, "local", False)),
            round_steps=round_steps,
            verify_policy=getattr(args, "verify_policy", None),
        )
    elif round_steps is not None:
        raise ConfigError("--round-steps: a schedule of rounds closed by time; needs --round-close time")
    return cfg


def state_copies(sync: dict[str, Any] | None, offload: bool) -> int:
    """Copies of a stage's parameters a worker holds: values and gradients (x2) with the optimizer on
    hosts; plus two optimizer states (x4) with a local one; a round mode (a local inner optimizer)
    also keeps θ_start (x5) and, for sparseloco, the error feedback (x6)."""
    mode = (sync or {}).get("mode", "step")
    if mode == "step":
        return 2 if offload else 4
    return 6 if mode == "sparseloco" else 5


def time_close_checks_refusal(verify_policy: Any) -> None:
    """Rounds closed by time run without spot-checks (train/free_rounds.py): an explicit
    `--verify-policy sample|all` with them is refused up front (ConfigError naming both options);
    auto and off are the driver's to settle (train/checks.job_policy turns auto's checks off)."""
    if verify_policy in ("sample", "all"):
        raise ConfigError(
            f"--round-close time with --verify-policy {verify_policy}: rounds closed by time run without "
            "spot-checks; use --round-close steps to check the work, or --verify-policy auto|off"
        )


def time_close_refusals(
    *,
    offload: Any,
    local: bool = False,
    round_steps: Any = None,
    verify_policy: Any = None,
) -> None:
    """What --round-close time cannot be combined with yet (ConfigError naming the options): its
    rounds are not spot-checked (no --verify-policy sample|all), and close on optimizer hosts. They
    are checkpointed and resumed, and recover from failures (train/free_recovery.py). The --local
    reference replays a swarm run's step counts."""
    time_close_checks_refusal(verify_policy)
    if offload == "off":
        raise ConfigError("--round-close time closes rounds on the optimizer hosts: use --offload on or auto")
    if local and round_steps is None:
        raise ConfigError(
            "--round-close time with --local: the reference replays a swarm run's inner steps per round; "
            "give --round-steps (that run's metrics file, or a JSON list of per-round step counts)"
        )
    if round_steps is not None and not local:
        raise ConfigError("--round-steps: only the --local reference replays a schedule")


def job_refusals(sync: SyncConfig, params: Mapping[str, Any]) -> None:
    """The driver's checks of a job's --sync against the rest of its request (a client that is not
    the CLI skips `sync_from_args`): ConfigError naming the option."""
    if sync.rounds and int(params.get("rebalance_every") or 0) > 0:
        raise ConfigError(f"--rebalance-every: --sync {sync.mode} does not rebalance yet")
    if sync.budget is not None and (params.get("planner") or "simple") != "fusion":
        raise ConfigError(
            f"--sync-budget: only the planner prices the sync to choose H (use --planner fusion on the "
            f"swarm), or give --inner-steps (default {DEFAULT_INNER_STEPS})"
        )
    # with a budget, inner_steps holds a placeholder until the planner chooses H: the CLI's
    # DEFAULT_INNER_STEPS, or SyncConfig's 1 from a client that gave none; any other H is the user's
    if sync.budget is not None and sync.inner_steps not in (1, DEFAULT_INNER_STEPS):
        raise ConfigError(
            f"--sync-budget {sync.budget:g} with --inner-steps {sync.inner_steps}: give one (the budget "
            "lets the planner choose H)"
        )
    if sync.round_close == "time":
        time_close_refusals(offload=params.get("offload"))
    if sync.rounds and (params.get("planner") or "simple") not in ROUND_PLANNERS:
        raise ConfigError(
            f"--planner {params.get('planner')} prices data-parallel sync every step and cannot honour "
            f"--sync {sync.mode}; use --planner fusion or simple"
        )
