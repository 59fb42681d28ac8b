"""Planning, pure: cluster files, the cost model, OP-Fence, the DP x PP search, baselines, simulator."""

from fusionnode.plan.baselines import contiguous_split_plan, even_plan, memory_plan
from fusionnode.plan.cluster import Cluster, Device, bundled_clusters, load_cluster, load_cluster_dict
from fusionnode.plan.estimator import Chain, Estimator, PipelineCost, choose_ratio
from fusionnode.plan.evaluate import evaluate_plan
from fusionnode.plan.exhaustive import exhaustive_plan
from fusionnode.plan.plan import OptimizerHost, PipelinePlan, Plan, Prediction, StagePlan
from fusionnode.plan.planner import plan
from fusionnode.plan.simulator import SimResult, simulate

__all__ = [
    "Chain",
    "Cluster",
    "Device",
    "Estimator",
    "OptimizerHost",
    "PipelineCost",
    "PipelinePlan",
    "Plan",
    "Prediction",
    "SimResult",
    "StagePlan",
    "bundled_clusters",
    "choose_ratio",
    "contiguous_split_plan",
    "evaluate_plan",
    "even_plan",
    "exhaustive_plan",
    "load_cluster",
    "load_cluster_dict",
    "memory_plan",
    "plan",
    "simulate",
]
