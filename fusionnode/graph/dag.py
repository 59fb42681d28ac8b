"""The OP-DAG data model: operators as nodes, tensors as edges, with costs.

Pure data, no torch imports: the planner, the estimator and the simulator read
it; `fusionnode.graph.trace` builds it from a torch module.

Node ids are positions in one fixed topological order (0..n-1). A stage of a
pipeline runs a contiguous range [lo, hi) of that order. Every tensor produced
by node i and consumed by node j > i is an edge; an edge "crosses" cut c (the
boundary between node c-1 and node c) when i < c <= j. Residual connections are
simply long edges: they cross every cut between their ends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class OpNode:
    id: int  # position in the topological order
    name: str  # torch.fx node name, unique in the graph
    kind: str  # "placeholder" | "call_module" | "call_function" | "call_method" | "get_attr" | "output"
    target: str  # stable torch name of the op ("torch.nn.functional.linear", "torch.nn.Linear", ...)
    flops: float  # forward FLOPs for one sample (batch size 1) at the traced sequence length
    param_bytes: int  # bytes of parameters this node owns (fp32), 0 if none
    param_names: tuple[str, ...]  # parameter names in the model's state dict that this node uses
    out_bytes: int  # bytes of this node's output for one sample
    out_shape: tuple[int, ...] = ()  # output shape for one sample (batch dim = 1); () if not a tensor
    out_dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class OpEdge:
    src: int  # producing node id
    dst: int  # consuming node id (src < dst)
    bytes: int  # bytes of the tensor for one sample


@dataclasses.dataclass(frozen=True)
class OpGraph:
    """An annotated OP-DAG. Costs are per sample; multiply by the micro-batch size."""

    model_name: str
    nodes: tuple[OpNode, ...]
    edges: tuple[OpEdge, ...]
    seq_len: int = 0  # tokens per sample (0 for non-sequence models)

    def __post_init__(self) -> None:
        for i, node in enumerate(self.nodes):
            if node.id != i:
                raise ValueError(f"node {node.name!r} has id {node.id}, expected {i} (topological order)")
        for e in self.edges:
            if not 0 <= e.src < e.dst < len(self.nodes):
                raise ValueError(f"edge {e} is not forward in the topological order")

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def cut_bytes(self) -> list[int]:
        """cut_bytes()[c] = bytes per sample crossing the boundary before node c, for c in 0..n.

        A tensor consumed by several nodes past the cut crosses once (it is sent once)."""
        n = len(self.nodes)
        # for each producer, the furthest consumer: the tensor crosses every cut in (src, last_dst]
        last: dict[int, int] = {}
        size: dict[int, int] = {}
        for e in self.edges:
            last[e.src] = max(last.get(e.src, e.src), e.dst)
            size[e.src] = e.bytes
        diff = [0] * (n + 2)
        for src, dst in last.items():
            diff[src + 1] += size[src]
            diff[dst + 1] -= size[src]
        out, acc = [], 0
        for c in range(n + 1):
            acc += diff[c]
            out.append(acc)
        return out

    def prefix_flops(self) -> list[float]:
        """prefix_flops()[i] = sum of flops of nodes [0, i)."""
        acc, out = 0.0, [0.0]
        for node in self.nodes:
            acc += node.flops
            out.append(acc)
        return out

    def prefix_param_bytes(self) -> list[int]:
        """Parameter bytes of nodes [0, i), counting a shared (tied) parameter once per range owner.

        For ranges use `range_param_bytes`, which deduplicates tied weights exactly."""
        acc, out = 0, [0]
        for node in self.nodes:
            acc += node.param_bytes
            out.append(acc)
        return out

    def range_param_names(self, lo: int, hi: int) -> list[str]:
        seen: dict[str, None] = {}
        for node in self.nodes[lo:hi]:
            for name in node.param_names:
                seen.setdefault(name, None)
        return list(seen)

    def total_flops(self) -> float:
        return sum(n.flops for n in self.nodes)


def stage_ranges(bounds: Sequence[int]) -> list[tuple[int, int]]:
    """[0, a, b, n] -> [(0, a), (a, b), (b, n)]"""
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
