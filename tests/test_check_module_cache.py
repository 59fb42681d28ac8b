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
