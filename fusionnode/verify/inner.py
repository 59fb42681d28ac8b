"""Spot-checks under `--sync diloco|sparseloco` (issue 20): the stages' inner steps.

Within a round each worker trains its stage with its own inner optimizer, so the parameters a step
computed with are the worker's, not the optimizer hosts'. The worker commits to them (their digest
in the step's report, made before it learns which micro-batches are checked); a checked stage's
parameters are then fetched from it, per stage (each replica's differ), and must match that
digest before the recompute uses them (`scoped`, `stage_params`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

SCOPE = "\x00stage{}\x00"  # prefix of a stage's own copy of a parameter among the fetched values


def scoped(stage: int, name: str) -> str:
    """The key of stage `stage`'s own value of parameter `name` (round modes: each replica's differ)."""
    return SCOPE.format(int(stage)) + name


def stage_params(params: Mapping[str, torch.Tensor], a: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Stage `a`'s parameters among `params`: its own copy where one was fetched (`scoped`), else the
    job's value (the hosts', or a frozen parameter)."""
    stage = a["stage"]
    return {
        n: params[scoped(stage, n)] if scoped(stage, n) in params else params[n] for n in a["param_specs"]
    }


__all__ = ["scoped", "stage_params"]
