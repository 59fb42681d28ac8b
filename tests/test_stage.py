"""Remote autodiff, in process: a model split into portable stages, rebuilt from msgpack
descriptions, run as a chain with tensors detached between stages, must give the same
loss and parameter gradients as single-process autograd of the whole model."""

from __future__ import annotations

import itertools

import msgpack
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusionnode.errors import GraphError, ProtocolError
from fusionnode.graph.portable import check_portable, describe_stage
from fusionnode.graph.trace import TracedModel, trace_model
from fusionnode.models import build_model
from fusionnode.runtime.stage import StageModule, StageRunner

torch.set_num_threads(1)

T = 32  # tokens per sample
V = 256  # gpt2-tiny vocabulary
REL_TOL = 1e-5  # fp32, relative to the reference gradient's norm


@pytest.fixture(scope="module")
def tiny() -> tuple[nn.Module, TracedModel]:
    torch.manual_seed(0)
    model = build_model("gpt2-tiny")
    return model, trace_model(model, torch.zeros(1, T, dtype=torch.long), "gpt2-tiny")


def node_id(traced: TracedModel, name: str) -> int:
    return traced.node_names.index(name)


def split_points(traced: TracedModel, n_stages: int) -> list[int]:
    n = traced.graph.num_nodes
    if n_stages == 3:  # at block boundaries
        return [0, node_id(traced, "transformer_h_1_ln_1"), node_id(traced, "transformer_h_3_ln_1"), n]
    # awkward cuts: after the integer positions (only int64 tensors cross), inside a block
    # (residual + attention output cross), and a one-op stage (the residual is relayed through it)
    return [
        0,
        node_id(traced, "transformer_wte"),
        node_id(traced, "transformer_h_1_attn_c_proj"),
        node_id(traced, "transformer_h_1_attn_resid_dropout"),
        n,
    ]


def build_stages(model: nn.Module, traced: TracedModel, bounds: list[int]) -> list[StageRunner]:
    state = model.state_dict()
    runners = []
    for lo, hi in itertools.pairwise(bounds):
        wire = msgpack.unpackb(msgpack.packb(describe_stage(traced, lo, hi)))
        values = {name: state[name].detach().clone() for name in [*wire["params"], *wire["buffers"]]}
        runners.append(StageRunner(StageModule.from_description(wire, values), max_in_flight=8))
    return runners


def wire_copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


def run_chain(runners: list[StageRunner], batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Forward every micro-batch through the chain, then backward them all (GPipe order).
    Each stage receives exactly what its predecessor sent: neighbours only."""
    scale = 1.0 / len(batches)
    losses = []
    for mb, (x, y) in enumerate(batches):
        acts = {"input_ids": x}
        for r in runners[:-1]:
            assert set(r.module.input_names) == set(acts)
            acts = r.forward(mb, wire_copy(acts))
        assert set(runners[-1].module.input_names) == set(acts)
        losses.append(runners[-1].forward_loss(mb, wire_copy(acts), y, loss_scale=scale))
    for mb in range(len(batches)):
        grads = runners[-1].backward_loss(mb)
        for r in reversed(runners[:-1]):
            assert set(grads) <= set(r.module.output_names)
            grads = r.backward(mb, wire_copy(grads))
        assert grads == {}  # token ids get no gradient
    return losses


def summed_grads(runners: list[StageRunner]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in runners:
        for name, p in r.module.named_stage_parameters().items():
            assert p.grad is not None, name
            out[name] = out[name] + p.grad if name in out else p.grad.clone()
    return out


def reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = F.cross_entropy(model(x).view(-1, V), y.view(-1))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_grads_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(ref)
    for name, g in ref.items():
        err = (got[name] - g).norm() / g.norm().clamp_min(1e-30)
        assert err < REL_TOL, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("n_stages", [3, 4])
def test_split_stages_match_single_process_autograd(tiny, n_stages):
    model, traced = tiny
    bounds = split_points(traced, n_stages)
    runners = build_stages(model, traced, bounds)
    if n_stages == 4:
        # the one-op stage relays the residual stream: it is both its input and its output
        relay = runners[2].module
        assert set(relay.input_names) & set(relay.output_names)
        # the first stage only computes integer positions: no parameters, no floating output
        assert runners[0].module.named_stage_parameters() == {}
        assert runners[0].module.output_names == ["input_ids", "sub"]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (4, T), generator=g)
    y = torch.randint(0, V, (4, T), generator=g)
    ref_loss, ref_grads = reference(model, x, y)
    (loss,) = run_chain(runners, [(x, y)])
    assert abs(loss - ref_loss) < 1e-5 * ref_loss
    got = summed_grads(runners)
    # the tied embedding: one stage embeds with it, the last stage projects with it
    holders = [
        i for i, r in enumerate(runners) if "transformer.wte.weight" in r.module.named_stage_parameters()
    ]
    first = 1 if n_stages == 4 else 0
    assert holders == [first, len(runners) - 1]
    assert_grads_close(got, ref_grads)
    assert all(r.in_flight == [] for r in runners)


def test_accumulated_micro_batches_equal_full_batch(tiny):
    model, traced = tiny
    runners = build_stages(model, traced, split_points(traced, 4))
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, V, (8, T), generator=g)
    y = torch.randint(0, V, (8, T), generator=g)
    ref_loss, ref_grads = reference(model, x, y)
    batches = list(zip(x.chunk(4), y.chunk(4), strict=True))
    losses = run_chain(runners, batches)
    assert abs(sum(losses) / 4 - ref_loss) < 1e-5 * ref_loss
    assert_grads_close(summed_grads(runners), ref_grads)


def test_resnet_stages_match_including_batchnorm_stats():
    torch.manual_seed(0)
    model = build_model("resnet18", vocab_size=10).train()
    traced = trace_model(model, torch.zeros(1, 3, 64, 64))
    n = traced.graph.num_nodes
    bounds = [0, node_id(traced, "layer2_0_conv1"), node_id(traced, "layer3_1_conv2"), n]
    runners = build_stages(model, traced, bounds)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([3, 7])
    acts = {"x": x}
    for r in runners[:-1]:
        acts = r.forward(0, wire_copy(acts), requires_grad_inputs=r is not runners[0])
    loss = runners[-1].forward_loss(0, wire_copy(acts), y)
    grads = runners[-1].backward_loss(0)
    for r in reversed(runners[:-1]):
        grads = r.backward(0, wire_copy(grads))
    assert grads == {}  # the first stage's image input was not differentiated
    model.zero_grad()
    ref = F.cross_entropy(model(x), y)
    ref.backward()
    assert abs(loss - ref.item()) < 1e-5 * ref.item()
    assert_grads_close(summed_grads(runners), {k: p.grad for k, p in model.named_parameters()})
    state = model.state_dict()
    for r in runners:
        for name, b in r.module.named_stage_buffers().items():
            assert torch.allclose(b, state[name].to(b.dtype), rtol=1e-5, atol=1e-6), name


def test_unused_output_gradient_and_in_flight_limit(tiny):
    model, traced = tiny
    lo = node_id(traced, "transformer_h_1_ln_1")
    hi = node_id(traced, "transformer_h_1_attn_c_proj")
    desc = describe_stage(traced, lo, hi)
    state = model.state_dict()
    stage = StageModule.from_description(desc, {k: state[k].clone() for k in desc["params"]})
    assert len(stage.output_names) == 2  # residual + attention output
    runner = StageRunner(stage, max_in_flight=2)
    inputs = {stage.input_names[0]: torch.randn(1, T, 128)}
    outs = runner.forward(0, inputs)
    runner.forward(1, inputs)
    with pytest.raises(RuntimeError, match="in flight"):
        runner.forward(2, inputs)
    with pytest.raises(ValueError, match="already in flight"):
        runner.forward(1, inputs)
    # only the residual gets a gradient downstream: it passes straight through
    resid, attn = stage.output_names
    grads = runner.backward(0, {resid: torch.ones_like(outs[resid]), attn: None})
    assert torch.equal(grads[stage.input_names[0]], torch.ones(1, T, 128))
    grads = runner.backward(1, {})
    assert torch.equal(grads[stage.input_names[0]], torch.zeros(1, T, 128))
    assert runner.in_flight == []
    runner.forward(3, inputs)
    with pytest.raises(ProtocolError, match="gradient of"):
        runner.backward(3, {resid: torch.ones(1)})  # no broadcasting of gradients
    runner.drop(3)
    assert runner.in_flight == []


def test_pass_through_inputs_and_gradients_the_worker_sends(tiny):
    """What the worker relies on: an input that only crosses the stage is sent on and its
    gradient comes straight back; an input without a gradient is left out (not zeros) when
    zero_unused_grads is off; a float gradient of another precision is cast, not refused."""
    model, traced = tiny
    lo = node_id(traced, "transformer_h_1_ln_1")
    hi = node_id(traced, "transformer_h_1_attn_c_proj")
    desc = describe_stage(traced, lo, hi)
    state = model.state_dict()
    stage = StageModule.from_description(desc, {k: state[k].clone() for k in desc["params"]})
    runner = StageRunner(stage, max_in_flight=2, passthrough=["relayed"], zero_unused_grads=False)
    x, relayed = torch.randn(1, T, 128), torch.randn(1, T, 7)
    outs = runner.forward(0, {stage.input_names[0]: x, "relayed": relayed})
    assert set(outs) == {*stage.output_names, "relayed"}
    assert torch.equal(outs["relayed"], relayed)
    resid, attn = stage.output_names
    grads = runner.backward(0, {"relayed": torch.full((1, T, 7), 2.0), attn: None})
    assert set(grads) == {"relayed"}  # the stage's own input got no gradient: left out
    assert torch.equal(grads["relayed"], torch.full((1, T, 7), 2.0))
    runner.forward(1, {stage.input_names[0]: x})
    grads = runner.backward(1, {resid: torch.ones(1, T, 128, dtype=torch.float64)})
    assert grads[stage.input_names[0]].dtype == torch.float32
    assert torch.equal(grads[stage.input_names[0]], torch.ones(1, T, 128))
    with pytest.raises(ProtocolError, match="differ from the expected"):
        runner.forward(2, {stage.input_names[0]: x, "stray": x})
    assert runner.in_flight == []


class Exotic(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return torch.special.erfcx(self.proj(x))


def test_op_outside_allowlist_is_refused(tiny):
    traced = trace_model(Exotic(), torch.zeros(1, 4))
    with pytest.raises(GraphError, match=r"erfcx is not in the portable allowlist"):
        check_portable(traced)
    _, tiny_traced = tiny
    desc = msgpack.unpackb(msgpack.packb(describe_stage(tiny_traced, 0, 5)))
    forged = dict(
        desc, nodes=[*desc["nodes"][:-1], dict(desc["nodes"][-1], op="call_function", target="os.system")]
    )
    with pytest.raises(GraphError, match=r"'os\.system' is not in this worker's allowlist"):
        StageModule.from_description(forged)
    forged = dict(
        desc,
        nodes=[
            *desc["nodes"],
            {
                "name": "evil",
                "op": "call_method",
                "target": "__reduce__",
                "args": [{"ref": "sub"}],
                "kwargs": {},
            },
        ],
    )
    with pytest.raises(GraphError, match="'__reduce__' is not in the allowlist"):
        StageModule.from_description(forged)
    forged = dict(desc, version=2)
    with pytest.raises(GraphError, match="version"):
        StageModule.from_description(forged)


def test_parameters_are_validated_exactly(tiny):
    model, traced = tiny
    desc = describe_stage(traced, 0, node_id(traced, "transformer_h_0_ln_1"))
    state = model.state_dict()
    good = {k: state[k].clone() for k in desc["params"]}
    assert set(good) == {"transformer.wte.weight", "transformer.wpe.weight"}
    stage = StageModule.from_description(desc, good)
    assert torch.equal(
        stage.named_stage_parameters()["transformer.wpe.weight"], state["transformer.wpe.weight"]
    )
    with pytest.raises(ProtocolError, match=r"expected shape \[128, 128\] float32, got \[128, 127\]"):
        StageModule.from_description(desc, dict(good, **{"transformer.wpe.weight": torch.zeros(128, 127)}))
    with pytest.raises(ProtocolError, match="expected shape"):  # a 1-element tensor never broadcasts
        StageModule.from_description(desc, dict(good, **{"transformer.wpe.weight": torch.zeros(1)}))
    with pytest.raises(ProtocolError, match=r"float32, got .* float64"):
        StageModule.from_description(
            desc, dict(good, **{"transformer.wpe.weight": torch.zeros(128, 128, dtype=torch.float64)})
        )
    with pytest.raises(ProtocolError, match="missing"):
        StageModule.from_description(desc, {"transformer.wte.weight": good["transformer.wte.weight"]})
    with pytest.raises(ProtocolError, match="unexpected"):
        StageModule.from_description(desc, dict(good, extra=torch.zeros(1)))
    with pytest.raises(ProtocolError, match="stage inputs"):
        stage({"wrong": torch.zeros(1, T, dtype=torch.long)})


def test_a_bad_state_set_leaves_the_bound_module_untouched():
    """`bind_state` checks the whole set before it writes anything (review8 L5): a set with a name
    missing or unexpected, or one tensor of the wrong shape or dtype, changes neither the module's
    buffers (batch-norm statistics here) nor its parameters."""
    torch.manual_seed(0)
    model = build_model("resnet18", vocab_size=10).train()
    traced = trace_model(model, torch.zeros(1, 3, 64, 64))
    desc = describe_stage(traced, 0, node_id(traced, "layer1_0_conv1"))
    state = model.state_dict()
    names = [*desc["params"], *desc["buffers"]]
    stage = StageModule.from_description(desc, {n: state[n].detach().clone() for n in names})
    buffers = {n: b.clone() for n, b in stage.named_stage_buffers().items()}
    assert buffers and any(b.is_floating_point() for b in buffers.values())
    params = {n: p.data_ptr() for n, p in stage.named_stage_parameters().items()}
    new = {n: state[n].detach().clone() + 1 for n in names}  # every value differs from the bound one
    param, buffer = next(iter(desc["params"])), next(iter(buffers))
    bad_sets = [
        ({n: v for n, v in new.items() if n != param}, "missing"),
        ({n: v for n, v in new.items() if n != buffer}, "missing"),
        ({**new, "extra": torch.zeros(1)}, "unexpected"),
        ({**new, param: torch.zeros(1)}, "expected shape"),
        ({**new, buffer: new[buffer].double()}, "float64"),
    ]
    for bad, says in bad_sets:
        with pytest.raises(ProtocolError, match=says):
            stage.bind_state(bad)
        for n, b in stage.named_stage_buffers().items():
            assert torch.equal(b, buffers[n]), (says, n)
        assert {n: p.data_ptr() for n, p in stage.named_stage_parameters().items()} == params, says
    stage.bind_state(new)  # a good set: parameters bound, buffers copied
    for n, b in stage.named_stage_buffers().items():
        assert torch.equal(b, new[n]) and b.data_ptr() != new[n].data_ptr()
    assert all(p.data_ptr() == new[n].data_ptr() for n, p in stage.named_stage_parameters().items())
