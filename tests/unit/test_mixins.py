"""The classes split across modules as mixins (`LaneDispatcher`, `InferenceService`):
a mixin declares what it needs of its class with stubs that raise NotImplementedError,
and a stub found first in the method order would hide the real method. Every name the
class resolves must reach a real one, whatever order its bases are listed in."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from blazar.dataplane.dispatcher import LaneDispatcher
from blazar.dataplane.inference import InferenceService


def _is_stub(function: object) -> bool:
    """Whether `function`'s body is only `raise NotImplementedError` (a docstring aside)."""
    try:
        source = textwrap.dedent(inspect.getsource(function))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return False
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    body = [
        s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
    ]
    return (
        len(body) == 1
        and isinstance(body[0], ast.Raise)
        and isinstance(body[0].exc, ast.Name)
        and body[0].exc.id == "NotImplementedError"
    )


@pytest.mark.parametrize("cls", [LaneDispatcher, InferenceService], ids=lambda c: c.__name__)
def test_no_stub_hides_the_real_method(cls: type) -> None:
    stubs = {
        name
        for klass in cls.__mro__
        for name, value in vars(klass).items()
        if inspect.isfunction(value) and _is_stub(value)
    }
    assert stubs, "the mixins declare what they need: nothing to check means this test is stale"
    hidden = sorted(name for name in stubs if _is_stub(getattr(cls, name)))
    assert not hidden, f"{cls.__name__} resolves these to a mixin's stub: {hidden}"
