"""Optimizer hosts: fp32 masters and optimizer state off the workers (LuWu-style offload)."""

from fusionnode.optim.checkpoint import CheckpointError, load_latest_shard, save_shard
from fusionnode.optim.contributions import Contributor, ExpectedContributions, contributor_key
from fusionnode.optim.optimizers import (
    FlatOptimizer,
    LocalOptimizer,
    LRSchedule,
    OptimizerConfig,
    clip_coefficient,
    lr_at,
    make_local_optimizer,
)
from fusionnode.optim.sharding import param_bytes, shard_loads, shard_params
from fusionnode.optim.store import (
    ApplyResult,
    ParameterStore,
    PushResult,
    StepNotReadyError,
    StepOrderError,
    UnknownParameterError,
)

__all__ = [
    "ApplyResult",
    "CheckpointError",
    "Contributor",
    "ExpectedContributions",
    "FlatOptimizer",
    "LRSchedule",
    "LocalOptimizer",
    "OptimizerConfig",
    "ParameterStore",
    "PushResult",
    "StepNotReadyError",
    "StepOrderError",
    "UnknownParameterError",
    "clip_coefficient",
    "contributor_key",
    "load_latest_shard",
    "lr_at",
    "make_local_optimizer",
    "param_bytes",
    "save_shard",
    "shard_loads",
    "shard_params",
]
