"""One step's gradient contributions on an optimizer host, as they arrive: each replica's
gradient folded into a sample-weighted running mean per parameter name (or, under a norm floor,
held apart until the step applies), and what is still missing. `ParameterStore` (optim/store.py)
keeps one per pending step and applies the optimizer to its `grads()`. Split from optim/store.py.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from fusionnode.optim.contributions import ExpectedContributions


class PendingStep:
    """Contributions received for one step."""

    def __init__(self, first_push: float, expected: ExpectedContributions, clip: float | None = None) -> None:
        self.first_push = first_push
        self.clip = clip  # the norm floor (optim/robust.py): replicas held apart until the step applies
        self.apart: dict[str, dict[str, tuple[Tensor, int]]] = {}
        self.floored = True  # `mean` is up to date with `apart`
        self.seen: set[tuple[str, str]] = set()  # (contributor, name)
        self.remaining = {n: len(c) for n, c in expected.by_name.items()}
        self.names_left = len(self.remaining)
        self.mean: dict[str, Tensor] = {}  # sum_r n_r g_r / sum_r n_r over complete replicas
        self.weight: dict[str, int] = {}  # sum of n_r over complete replicas
        self.replicas: dict[str, dict[str, int]] = {}  # name -> {replica: n_r} folded
        self.partial: dict[tuple[str, str], list[Any]] = {}  # (name, replica) -> [sum g, n, count]
        self.samples: dict[tuple[str, str], int] = {}  # (name, replica) -> n reported

    def complete(self) -> bool:
        return self.names_left == 0

    def fold(self, name: str, replica: str, grad_sum: Tensor, n: int, *, owned: bool) -> None:
        """Fold replica gradient `grad_sum` with weight n into the running weighted mean of `name`
        (with the floor: keep it apart, `grads` combines)."""
        if self.clip is not None:
            self.apart.setdefault(name, {})[replica] = (grad_sum if owned else grad_sum.clone(), n)
            self.replicas.setdefault(name, {})[replica] = n
            self.floored = False
            return
        if name in self.mean:
            weight = self.weight[name] + n
            self.mean[name].lerp_(grad_sum, n / weight)  # mean += (g - mean) * n / (W + n)
        else:
            weight = n
            self.mean[name] = grad_sum if owned else grad_sum.clone()
        self.weight[name] = weight
        self.replicas.setdefault(name, {})[replica] = n

    def grads(self) -> dict[str, Tensor]:
        """The step's gradient per name so far (complete replicas only)."""
        if not self.floored:
            from fusionnode.optim.robust import floor_mean

            self.mean, self.weight, _scales = floor_mean(self.apart, float(self.clip or 0))
            self.floored = True
        return self.mean
