"""H for a communication budget: the round length the planner chooses when the user gives none.

Under `--sync diloco|sparseloco` a round's exchange (pseudo-gradients up, the update down, on the
optimizer hosts' links) is paid once per H inner steps (plan/syncprice.py). The user may give H
(`--inner-steps`) or a budget (`--sync-budget F`, default `DEFAULT_SYNC_BUDGET`): the share of each
step's wall-clock time the amortised exchange may take. The simulator (plan/simulator.py) gives, for
a plan and an H, the step time and when each pipeline's backward pass and its sync finish; the
amortised exchange is the difference, and its share of the step is

    share(plan, H) = (max sync finish - max pipeline finish) / step time.

For a fixed plan the exchange's terms all scale with 1/H, so share(plan, H) falls as H grows and
the smallest H with share <= F is found by bisection over [h_min, H_MAX]. The plan, though, depends
on H: with cheaper sync the planner may choose more replicas, whose sync costs more. The search
therefore starts from H = h_min and repeats: plan at H; raise H to the smallest at which that plan
keeps within budget; stop when the plan chosen at H is within budget at H (H only grows, so it ends,
at the latest at H_MAX, where a plan that still exceeds the budget is returned with `fits` False).
That plan is kept and H lowered to the smallest at which it stays within budget (the planner chose
it for the H where the search stopped; the exposed exchange may be well under budget there, for a
replica's sync hides behind a slower replica's compute). The plan's layout is the planner's choice
for the budget; among H values the smallest for that layout. An H below it at which some other
(slower) layout would fit is not preferred: the budget buys the planner its layout, not the reverse.

Pure: the caller passes how to plan and simulate at an H (the CLI's `plan`/`simulate`, the driver).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fusionnode.errors import ConfigError
from fusionnode.plan.syncprice import SyncPrice
from fusionnode.sync import DEFAULT_SYNC_BUDGET, check_budget

__all__ = ["DEFAULT_SYNC_BUDGET", "H_MAX", "HChoice", "check_budget", "choose_inner_steps", "sync_share"]

H_MAX = 500  # the longest round the planner chooses
MAX_REPLANS = 12  # plans per search (H only grows: a bound, not a tuning knob)


@dataclasses.dataclass(frozen=True)
class SyncShare:
    """What the simulator says a plan's sync costs at one H."""

    inner_steps: int
    step_s: float  # simulated step time, sync included
    sync_s: float  # the amortised exchange per step
    share: float  # sync_s / step_s

    @property
    def round_s(self) -> float:
        """A round's wall-clock time: H steps, the exchange included."""
        return self.inner_steps * self.step_s


def sync_share(sim: Any, inner_steps: int) -> SyncShare:
    """The amortised exchange of a simulated step (plan/simulator.SimResult) and its share of it."""
    sync_s = max(0.0, float(max(sim.sync_finish_s)) - float(max(sim.pipeline_finish_s)))
    step = float(sim.step_time_s)
    return SyncShare(inner_steps, step, sync_s, sync_s / step if step > 0 else 0.0)


@dataclasses.dataclass(frozen=True)
class HChoice:
    inner_steps: int  # the chosen H
    budget: float
    fits: bool  # False: even H_MAX exceeds the budget (the plan at H_MAX is returned)
    at: SyncShare  # the chosen plan's figures at the chosen H
    tried: tuple[int, ...]  # the H values planned at, in order
    plan: Any = dataclasses.field(repr=False, compare=False, default=None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "inner_steps": self.inner_steps,
            "budget": self.budget,
            "fits": self.fits,
            "share": self.at.share,
            "sync_s": self.at.sync_s,
            "step_s": self.at.step_s,
            "round_s": self.at.round_s,
            "tried": list(self.tried),
        }

    def line(self) -> str:
        verdict = (
            f"the smallest H within the budget of {self.budget:.0%}"
            if self.fits
            else f"the longest round the planner chooses; still over the budget of {self.budget:.0%}"
        )
        return (
            f"H = {self.inner_steps} chosen for --sync-budget {self.budget:g} ({verdict}): the exchange "
            f"takes {self.at.sync_s:.4f} s per step, {self.at.share:.1%} of a {self.at.step_s:.3f} s step; "
            f"a round takes {self.at.round_s:.3f} s (planned at H = {', '.join(map(str, self.tried))})"
        )


def smallest_fitting(
    measure: Callable[[int], SyncShare], budget: float, lo: int, hi: int = H_MAX
) -> tuple[int, SyncShare, bool]:
    """The smallest H in [lo, hi] with measure(H).share <= budget, assuming the share falls as H
    grows (one plan); (hi, measure(hi), False) when none does."""
    at_lo = measure(lo)
    if at_lo.share <= budget:
        return lo, at_lo, True
    at_hi = measure(hi)
    if at_hi.share > budget:
        return hi, at_hi, False
    while hi - lo > 1:  # share(lo) > budget >= share(hi)
        mid = (lo + hi) // 2
        at_mid = measure(mid)
        if at_mid.share <= budget:
            hi, at_hi = mid, at_mid
        else:
            lo = mid
    return hi, at_hi, True


def choose_inner_steps(
    plan_at: Callable[[int], Any],
    simulate_at: Callable[[Any, int], Any],
    budget: float,
    h_min: int = 1,
    h_max: int = H_MAX,
) -> HChoice:
    """H for `budget` (see the module's docstring). `plan_at(H)` plans under rounds of H steps (it
    may raise PlanError, which propagates); `simulate_at(plan, H)` simulates a plan under them."""
    budget = check_budget(budget)
    if not 1 <= h_min <= h_max:
        raise ConfigError(f"inner steps: need 1 <= {h_min} <= {h_max}")
    h, tried = h_min, []
    for _ in range(MAX_REPLANS):
        p = plan_at(h)
        tried.append(h)
        found, at, fits = smallest_fitting(lambda x, p=p: sync_share(simulate_at(p, x), x), budget, h, h_max)
        if found == h:
            break
        h = found
    else:  # the bound on re-plans was reached: take the plan at the last H
        p = plan_at(h)
        tried.append(h)
        at = sync_share(simulate_at(p, h), h)
        fits = at.share <= budget
    if fits and h > h_min:  # the smallest H at which this plan stays within budget
        h, at, _ = smallest_fitting(lambda x, p=p: sync_share(simulate_at(p, x), x), budget, h_min, h)
    return HChoice(h, budget, fits, at, tuple(tried), p)


def plan_for_sync(
    sync: Any,
    plan_with: Callable[[SyncPrice], Any],
    simulate_with: Callable[[Any, SyncPrice], Any],
) -> tuple[Any, SyncPrice, Any, HChoice | None]:
    """Plan under `sync` (fusionnode.sync.SyncConfig): at its H, or, when it carries a budget, at the
    H chosen for it. Returns (plan, its SyncPrice, the SyncConfig with H fixed, the choice or None)."""
    if sync.budget is None:
        price = SyncPrice.from_dict(sync.price())
        return plan_with(price), price, sync, None

    def price_at(h: int) -> SyncPrice:
        return SyncPrice(sync.mode, h, sync.wire_ratio)

    choice = choose_inner_steps(
        lambda h: plan_with(price_at(h)),
        lambda p, h: simulate_with(p, price_at(h)),
        sync.budget,
        h_min=sync.overlap_steps or 1,
    )
    fixed = dataclasses.replace(sync, inner_steps=choice.inner_steps, budget=None)
    return choice.plan, price_at(choice.inner_steps), fixed, choice
