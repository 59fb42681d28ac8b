"""The check process keeps each stage's module across steps, keyed by the stage's description too: a job
id names a spec, so the same spec run again on other cuts (the testbed's configurations) must not
check a stage with the module of an earlier cut (it raised 'stage state mismatch' / KeyError)."""

from __future__ import annotations

from fusionnode.graph.portable import describe_stage
from fusionnode.graph.trace import trace_spec
from fusionnode.models import build_model
from fusionnode.train import checks


def test_a_new_cut_under_the_same_job_id_rebuilds_the_stage_module():
    traced = trace_spec("gpt2-tiny", seq_len=16)
    state = build_model("gpt2-tiny").state_dict()  # the trace holds meta tensors

    def stage(hi: int) -> tuple[dict, dict]:
        from fusionnode.runtime.stage import StageModule

        desc = describe_stage(traced, 0, hi)
        names = StageModule.from_description(desc).state_names()
        return {"stage": 0, "description": desc}, {n: state[n].detach().clone() for n in names}

    checks._child_modules.clear()
    a46, mine46 = stage(46)
    first = checks._child_module("job", a46, mine46)
    assert checks._child_module("job", a46, mine46) is first  # kept across steps
    a52, mine52 = stage(52)  # same job id, same stage number, another cut
    second = checks._child_module("job", a52, mine52)
    assert second is not first and set(second.state_names()) == set(mine52)
    assert set(second.output_names) != set(first.output_names)
    assert len(checks._child_modules) == 1  # the earlier cut's module is dropped
    checks._child_module("other", a46, mine46)
    assert [k[0] for k in checks._child_modules] == ["other"]


def test_a_kept_module_takes_each_checks_parameters_without_a_copy():
    import pytest
    import torch

    from fusionnode.errors import FusionNodeError
    from fusionnode.runtime.stage import StageModule

    traced = trace_spec("gpt2-tiny", seq_len=16)
    state = build_model("gpt2-tiny").state_dict()
    desc = describe_stage(traced, 0, 46)
    names = StageModule.from_description(desc).state_names()
    a = {"stage": 0, "description": desc}
    checks._child_modules.clear()
    first = {n: state[n].detach().clone() for n in names}
    module = checks._child_module("job", a, first)
    second = {n: t + 1.0 for n, t in first.items()}  # the next check's values (its own buffer)
    assert checks._child_module("job", a, second) is module
    for name, p in module.named_stage_parameters().items():
        assert p.data_ptr() == second[name].data_ptr()  # bound, not copied
        assert torch.equal(p.detach(), second[name])
    tokens = torch.randint(0, 256, (2, 16))
    out = module({module.input_names[0]: tokens})
    ref = StageModule.from_description(desc)
    ref.load_state(second)
    want = ref({ref.input_names[0]: tokens})
    assert all(torch.equal(out[k], want[k]) for k in want)
    wrong = dict(second)
    wrong[names[0]] = torch.zeros(3)
    with pytest.raises(FusionNodeError):
        module.bind_state(wrong)
    with pytest.raises(FusionNodeError, match="missing"):
        module.bind_state({n: t for n, t in second.items() if n != names[0]})
