"""No function or constructor of the package takes more than ``MAX_PARAMETERS`` parameters: related settings travel
as one config section or frozen dataclass instead. ``self`` / ``cls`` of a method are not counted; ``*args`` and
``**kwargs`` count one each. Read from the source with ``ast`` (nested functions and lambdas included), so nothing
is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_geo"
MAX_PARAMETERS = 8


def parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, in_class: bool) -> int:
    """Parameters of ``fn`` as a caller sees them: positional-only, positional, keyword-only, ``*args`` and
    ``**kwargs`` (one each); the first parameter of a method (``self`` / ``cls``) is left out, unless it is a
    staticmethod."""
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)]
    n = len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    static = isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and any(
        isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list
    )
    if in_class and not static and names and names[0] in ("self", "cls"):
        n -= 1
    return n


def signatures(source: str, filename: str) -> list[tuple[str, int]]:
    """``(qualified name, parameter count)`` of every function, method and lambda defined in ``source``."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.", True)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                out.append((f"{prefix}{child.name}", parameter_count(child, in_class)))
                visit(child, f"{prefix}{child.name}.", False)
            elif isinstance(child, ast.Lambda):
                out.append((f"{prefix}<lambda:{child.lineno}>", parameter_count(child, False)))
                visit(child, prefix, False)
            else:  # a statement of a class body (an ``if`` around methods) keeps them methods
                visit(child, prefix, in_class)

    visit(ast.parse(source, filename), "", False)
    return out


def test_the_counter_counts_what_a_caller_passes():
    src = (
        "def f(a, b, /, c, *args, d, e=1, **kw): pass\n"
        "class K:\n"
        "    def __init__(self, x, y): pass\n"
        "    @classmethod\n"
        "    def make(cls, x): pass\n"
        "    @staticmethod\n"
        "    def s(self, x): pass\n"
        "    def outer(self):\n"
        "        def inner(self, a): pass\n"
        "g = lambda p, q: p\n"
    )
    assert dict(signatures(src, "<test>")) == {
        "f": 7,
        "K.__init__": 2,
        "K.make": 1,
        "K.s": 2,
        "K.outer": 0,
        "K.outer.inner": 2,
        "<lambda:10>": 2,
    }


def test_no_function_of_the_package_takes_more_than_eight_parameters():
    files = sorted(PACKAGE.rglob("*.py"))
    assert files, f"no Python files under {PACKAGE}"
    too_long = [
        f"{path.relative_to(PACKAGE.parent)}::{name} takes {n} parameters"
        for path in files
        for name, n in signatures(path.read_text(encoding="utf-8"), str(path))
        if n > MAX_PARAMETERS
    ]
    assert not too_long, (
        f"{len(too_long)} function(s) take more than {MAX_PARAMETERS} parameters; group related settings in a "
        f"config section or a frozen dataclass:\n" + "\n".join(too_long)
    )
