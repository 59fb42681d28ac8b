"""OP-DAG tracing: costs, cuts, meta-device tracing of big models, untraceable models."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from fusionnode.errors import GraphError
from fusionnode.graph.portable import check_portable, describe_stage
from fusionnode.graph.trace import graph_for, tensor_only_cuts, trace_model, trace_spec
from fusionnode.models import build_model, model_info
from fusionnode.models.gpt2 import CONFIGS

torch.set_num_threads(1)

T = 128  # gpt2-tiny max context


def node_id(graph, name: str) -> int:
    (i,) = [n.id for n in graph.nodes if n.name == name]
    return i


def test_gpt2_tiny_flops_match_analytic_formula():
    graph = graph_for("gpt2-tiny")
    c = CONFIGS["gpt2-tiny"]
    d, L, V = c.n_embd, c.n_layer, c.vocab_size
    matmul_params = L * 12 * d * d + V * d  # qkv, proj, fc, fc-proj weights + the (tied) head
    attention = L * 4 * T * T * d  # q @ k^T and attn @ v, 2 FLOPs per MAC
    analytic = 2 * matmul_params * T + attention
    assert graph.seq_len == T
    assert abs(graph.total_flops() - analytic) / analytic < 0.03
    assert graph.total_flops() > analytic  # biases, norms, softmax add a little


def test_graph_structure_and_param_annotation():
    graph = graph_for("gpt2-tiny")
    nodes = graph.nodes
    assert nodes[0].kind == "placeholder" and nodes[0].out_dtype == "int64" and nodes[0].out_shape == (1, T)
    assert nodes[-1].kind == "output"
    head = nodes[node_id(graph, "lm_head")]
    assert head.param_names == ("transformer.wte.weight",)  # tied: canonical name
    assert head.out_shape == (1, T, 256) and head.out_bytes == T * 256 * 4
    wte = nodes[node_id(graph, "transformer_wte")]
    assert wte.param_names == ("transformer.wte.weight",)
    names = graph.range_param_names(0, graph.num_nodes)
    assert len(names) == len(set(names))
    with torch.device("meta"):
        model = build_model("gpt2-tiny")
    assert set(names) == {n for n, _ in model.named_parameters()}
    # the tied weight is owned by two nodes: sum of param_bytes counts it twice
    total = sum(n.param_bytes for n in nodes)
    assert total == 4 * (model_info("gpt2-tiny").n_params + 256 * 128)
    assert all(tensor_only_cuts(graph))
    for e in graph.edges:
        assert e.bytes == nodes[e.src].out_bytes


def test_cut_at_block_boundary_is_the_residual_stream():
    graph = graph_for("gpt2-tiny")
    d = CONFIGS["gpt2-tiny"].n_embd
    cuts = graph.cut_bytes()
    for layer in (1, 2, 3):
        c = node_id(graph, f"transformer_h_{layer}_ln_1")
        assert cuts[c] == T * d * 4
    c = node_id(graph, "transformer_ln_f")
    assert cuts[c] == T * d * 4
    traced = trace_spec("gpt2-tiny")
    desc = describe_stage(
        traced, node_id(graph, "transformer_h_1_ln_1"), node_id(graph, "transformer_h_2_ln_1")
    )
    assert len(desc["inputs"]) == 1 and len(desc["outputs"]) == 1


def test_residual_edges_cross_cuts_inside_a_block():
    graph = graph_for("gpt2-tiny")
    d = CONFIGS["gpt2-tiny"].n_embd
    cuts = graph.cut_bytes()
    # before the attention output projection: the residual x and the attention output
    c = node_id(graph, "transformer_h_1_attn_c_proj")
    assert cuts[c] == 2 * T * d * 4
    # before the MLP output projection: the residual and the 4d hidden activation
    c = node_id(graph, "transformer_h_1_mlp_c_proj")
    assert cuts[c] == T * d * 4 + T * 4 * d * 4
    # every cut strictly inside block 1 carries the residual; only the one between the
    # attention's residual add and ln_2 carries nothing else
    lo, hi = node_id(graph, "transformer_h_1_ln_1"), node_id(graph, "transformer_h_2_ln_1")
    assert all(cuts[i] >= T * d * 4 for i in range(lo + 1, hi))
    assert [i for i in range(lo + 1, hi) if cuts[i] == T * d * 4] == [node_id(graph, "transformer_h_1_ln_2")]


def test_gpt2_xl_traces_on_meta_in_reasonable_time():
    t0 = time.perf_counter()
    graph = graph_for("gpt2-xl", seq_len=1024)
    assert time.perf_counter() - t0 < 60
    c = CONFIGS["gpt2-xl"]
    d, L = c.n_embd, c.n_layer
    analytic = 2 * 1024 * (L * 12 * d * d + c.vocab_size * d) + L * 4 * 1024 * 1024 * d
    assert abs(graph.total_flops() - analytic) / analytic < 0.03
    assert graph.cut_bytes()[node_id(graph, "transformer_h_24_ln_1")] == 1024 * d * 4
    # wte, wpe, 12 tensors per block, ln_f weight and bias; the tied head adds no name
    assert len(graph.range_param_names(0, graph.num_nodes)) == 4 + 12 * L
    assert graph_for("gpt2-xl", seq_len=1024) is graph  # cached


def test_resnet18_traces_with_standard_costs():
    graph = graph_for("resnet18")
    assert abs(graph.total_flops() - 2 * 1.819e9) / (2 * 1.819e9) < 0.02  # 1.82 GMACs per image
    assert all(tensor_only_cuts(graph))
    check_portable(trace_spec("resnet18"))
    targets = {n.target for n in graph.nodes}
    assert {"torch.nn.Conv2d", "torch.nn.BatchNorm2d", "torch.nn.functional.relu"} <= targets


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return x
        return -x


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.proj(x))


def test_untraceable_module_is_named():
    with pytest.raises(GraphError) as info:
        trace_model(Gated(), torch.zeros(1, 4))
    msg = str(info.value)
    assert "gate (Gate)" in msg and "x.sum() > 0" in msg


def test_sample_must_have_batch_one_and_tracing_keeps_batchnorm_stats():
    model = build_model("resnet18", vocab_size=10).train()
    with pytest.raises(GraphError, match="batch size 1"):
        trace_model(model, torch.zeros(2, 3, 32, 32))
    before = model.bn1.running_mean.clone()
    trace_model(model, torch.randn(1, 3, 64, 64) + 5)
    assert torch.equal(model.bn1.running_mean, before)
    assert model.training


class SizeUser(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        n = x.size(1)
        y = self.proj(x)
        return y.view(1, n, 4) * 2


def test_non_tensor_values_mark_cuts_unusable():
    traced = trace_model(SizeUser(), torch.zeros(1, 3, 4))
    ok = tensor_only_cuts(traced.graph)
    names = traced.node_names
    size_id = names.index("size")
    view_id = names.index("view")
    assert not any(ok[size_id + 1 : view_id + 1])
    assert ok[view_id + 1]
    with pytest.raises(GraphError, match="non-tensor value 'size'"):
        describe_stage(traced, 0, view_id)
