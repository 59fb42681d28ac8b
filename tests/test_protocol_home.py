"""The job protocol has one home: every RPC name and tensor kind is spelled in fusionnode/wire/job.py
and nowhere else in fusionnode/ (checked from the source with ast, so it stays true)."""

from __future__ import annotations

import ast
from pathlib import Path

from fusionnode.wire.job import Rpc, TensorKind

ROOT = Path(__file__).resolve().parents[1] / "fusionnode"
HOME = ROOT / "wire" / "job.py"
# kinds that are ordinary words elsewhere ("params" of a description, "input" of a model): a literal
# of these is a protocol spelling only where a kind goes (see PROTOCOL_POSITIONS)
COMMON_WORDS = {
    TensorKind.INPUT,
    TensorKind.TARGET,
    TensorKind.PARAMS,
    TensorKind.ACT,
    TensorKind.GRAD,
    TensorKind.PUSH,
}
# call -> index of the argument that is an RPC name or a tensor kind
PROTOCOL_POSITIONS = {
    "tensor_message": 0,
    "TensorMessage": 0,
    "from_tensors": 0,
    "on_data": 0,
    "add_rpc": 0,
    "serve": 1,
    "call": 1,  # transport.call(peer, method, ...) and job.call(transport, peer, method, ...) below
}


def _literals(tree: ast.AST) -> list[tuple[str, int]]:
    """String constants that are not docstrings, with their line."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        (node.value, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _protocol_literals(tree: ast.AST) -> list[tuple[str, int]]:
    """String literals where an RPC name or a tensor kind goes: the method or kind argument of the
    calls above, `kind=`/`recall=` keywords, and the first element of a mailbox key."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _call_name(node)
        args = list(node.args)
        idx = PROTOCOL_POSITIONS.get(name)
        if (
            name == "call"
            and isinstance(node.func, ast.Attribute)
            and getattr(node.func.value, "id", "") == "jp"
        ):
            idx = 2
        if idx is not None and len(args) > idx:
            args = [args[idx]]
        elif name == "get" and args and isinstance(args[0], ast.Tuple) and args[0].elts:
            args = [args[0].elts[0]]  # mailbox.get((kind, job, step, mb, stage), ...)
        else:
            args = []
        args += [k.value for k in node.keywords if k.arg in ("kind", "recall", "method")]
        out += [(a.value, a.lineno) for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return out


def _sources() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if p != HOME)


def test_every_name_is_spelled_in_the_home_module():
    home = {s for s, _ in _literals(ast.parse(HOME.read_text()))}
    assert home >= Rpc.ALL and home >= TensorKind.ALL


def test_no_other_module_spells_an_rpc_name_or_a_distinctive_tensor_kind():
    names = Rpc.ALL | (TensorKind.ALL - COMMON_WORDS)
    found = [
        f"{path.relative_to(ROOT.parent)}:{line}: {value!r}"
        for path in _sources()
        for value, line in _literals(ast.parse(path.read_text()))
        if value in names
    ]
    assert not found, "use the constants of fusionnode/wire/job.py:\n" + "\n".join(found)


def test_no_other_module_puts_a_string_literal_where_a_method_or_kind_goes():
    found = [
        f"{path.relative_to(ROOT.parent)}:{line}: {value!r}"
        for path in _sources()
        for value, line in _protocol_literals(ast.parse(path.read_text()))
        if value in Rpc.ALL | TensorKind.ALL
    ]
    assert not found, "use the constants of fusionnode/wire/job.py:\n" + "\n".join(found)


def test_the_checks_see_a_stray_spelling():
    """The checks above can fail: a module that spells a kind and a method itself is caught."""
    stray = ast.parse(
        "t.call(p, 'job.step', {})\n"
        "tensor_message('act', {}, {})\n"
        "mailbox.get(('grad', j, s, m, st), 1.0, sender=p)\n"
        "x = {'params': 1}\n"
    )
    assert {v for v, _ in _protocol_literals(stray)} == {"job.step", "act", "grad"}
    assert "job.step" in {v for v, _ in _literals(stray)}
