"""Each of ``optimizer.muon_split``, ``optimizer.muon_ns_dtype``, ``train.param_dtype`` and ``geo.power`` is parsed
by exactly one function next to its owner; validation and every reader call that function.

The check reads the package source with ``ast``. A read of one of these settings (``<section>.<key>``, a local name
bound to such a read, or ``getattr(x, "<key>", ...)``) is allowed only

- inside the setting's parser,
- as an argument of a call to the parser,
- echoed in an f-string (a message that quotes the value as written),
- stored as written into an object's field (``spec.split = cfg.optimizer.muon_split``: the planner parses it) or
  as a value of a record (``{"param_dtype": cfg.train.param_dtype}`` in a report).

Anything else (a comparison with a literal, ``float()`` / ``str()``, a dict lookup, handing the text to another
function, a ``getattr`` default, a second table of choices) is a second parser and fails the test. So does a
``"bf16"`` -> ``torch.bfloat16`` mapping outside the dtype parsers and the places of other settings listed below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megatron_geo"

PARSERS = {
    # attribute: (section, the parser's module, the parser)
    "muon_split": ("optimizer", "megatron_geo/distributed/split_plan.py", "parse_muon_split"),
    "muon_ns_dtype": ("optimizer", "megatron_geo/optim/muon.py", "newton_schulz_dtype"),
    "param_dtype": ("train", "megatron_geo/model/llama.py", "param_dtype"),
    "power": ("geo", "megatron_geo/config/schema.py", "parse_power"),
}
# an attribute name that other objects use too is counted only on the config section (``cfg.geo.power``, a name
# bound to ``cfg.geo``, a parameter annotated with the section's class)
QUALIFIED = {"power": "GeoConfig"}

# files that map "bf16" to torch.bfloat16 for settings other than the dtype keys above
OTHER_BF16_MAPPINGS = {
    "megatron_geo/comm/formats.py": "comm.dtype (the registered wire formats)",
    "megatron_geo/comm/factory.py": "comm.dtype=bf16: the plain cast reducer",
    "megatron_geo/checkpoint/hf_io.py": "the Hugging Face export's --dtype",
    "megatron_geo/training/step.py": "train.autocast_dtype",
    "megatron_geo/comm/param_codec.py": "comm.param_gather=bf16 against the parsed parameter dtype",
}
DTYPE_PARSERS = {(PARSERS[k][1], PARSERS[k][2]) for k in ("muon_ns_dtype", "param_dtype")}


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}


class _Scopes(ast.NodeVisitor):
    """Parent links and the enclosing function (``None``: module level) of every node."""

    def __init__(self, tree: ast.AST):
        self.parent: dict[ast.AST, ast.AST] = {}
        self.scope: dict[ast.AST, ast.AST | None] = {}
        self._stack: list[ast.AST | None] = [None]
        self.visit(tree)

    def generic_visit(self, node):
        for child in ast.iter_child_nodes(node):
            self.parent[child] = node
            self.scope[child] = self._stack[-1]
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                self._stack.append(child)
                self.visit(child)
                self._stack.pop()
            else:
                self.visit(child)


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _section_names(scope: ast.AST | None, tree: ast.AST, section: str, cls: str) -> set[str]:
    """Names bound to ``<x>.<section>`` in ``scope`` (plain or tuple assignments) or annotated ``cls``."""
    body = scope if scope is not None else tree
    names = set()
    if isinstance(body, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = body.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs:
            if arg.annotation is not None and cls in ast.unparse(arg.annotation):
                names.add(arg.arg)
    for node in ast.walk(body):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = (
                    zip(target.elts, node.value.elts)
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                    else [(target, node.value)]
                )
                for t, v in pairs:
                    if isinstance(t, ast.Name) and isinstance(v, ast.Attribute) and v.attr == section:
                        names.add(t.id)
    return names


def _is_read(node: ast.AST, key: str, sc: _Scopes, tree: ast.AST) -> bool:
    if not (isinstance(node, ast.Attribute) and node.attr == key and isinstance(node.ctx, ast.Load)):
        return False
    if key not in QUALIFIED:
        return True
    section = PARSERS[key][0]
    base = node.value
    if isinstance(base, ast.Attribute) and base.attr == section:
        return True
    return isinstance(base, ast.Name) and base.id in _section_names(sc.scope[node], tree, section, QUALIFIED[key])


def _uses(node: ast.AST, key: str, sc: _Scopes, depth: int = 0) -> list[tuple[ast.AST, str]]:
    """``(node, why)`` for every use of the value read at ``node`` that interprets it outside the parser."""
    _, _, parser = PARSERS[key]
    parent = sc.parent[node]
    if isinstance(parent, ast.Call) and node in [*parent.args, *(k.value for k in parent.keywords)]:
        if _call_name(parent) == parser:
            return []
        return [(parent, f"handed to {_call_name(parent)}() instead of {parser}()")]
    if isinstance(parent, ast.keyword):
        call = sc.parent[parent]
        assert isinstance(call, ast.Call)
        return [] if _call_name(call) == parser else [(call, f"handed to {_call_name(call)}() instead of {parser}()")]
    if isinstance(parent, ast.FormattedValue):
        return []
    if isinstance(parent, ast.Dict) and node in parent.values:  # a record's value, as written (a report)
        return []
    targets: list[ast.AST] = []
    if isinstance(parent, ast.Assign) and parent.value is node:
        targets = list(parent.targets)
    elif isinstance(parent, ast.Tuple) and isinstance(sc.parent[parent], ast.Assign):
        assign = sc.parent[parent]
        i = parent.elts.index(node)
        targets = [t.elts[i] for t in assign.targets if isinstance(t, ast.Tuple) and len(t.elts) == len(parent.elts)]
    if targets:
        out: list[tuple[ast.AST, str]] = []
        for t in targets:
            if isinstance(t, ast.Attribute):  # carried as written into a field
                continue
            if isinstance(t, ast.Name) and depth < 3:  # a local alias: check its uses the same way
                scope = sc.scope[node]
                body = scope if scope is not None else sc.parent[node]
                for use in ast.walk(body):
                    if isinstance(use, ast.Name) and use.id == t.id and isinstance(use.ctx, ast.Load):
                        out += _uses(use, key, sc, depth + 1)
                continue
            out.append((t, "assigned to something that is neither a field nor a local name"))
        return out
    return [(parent, f"interpreted here ({type(parent).__name__})")]


def _enclosing_def(node: ast.AST, sc: _Scopes) -> str | None:
    scope = sc.scope.get(node)
    while isinstance(scope, ast.Lambda):
        scope = sc.scope.get(scope)
    return scope.name if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def second_parsers(sources: dict[str, str]) -> dict[str, list[str]]:
    """Per key, ``path:line: why`` of every place that interprets it outside its parser."""
    found: dict[str, list[str]] = {key: [] for key in PARSERS}
    for path, text in sources.items():
        tree = ast.parse(text, path)
        sc = _Scopes(tree)
        for key, (section, module, parser) in PARSERS.items():
            for node in ast.walk(tree):
                if path == module and _enclosing_def(node, sc) == parser:
                    continue
                if _is_read(node, key, sc, tree):
                    found[key] += [f"{path}:{n.lineno}: {why}" for n, why in _uses(node, key, sc)]
                elif (
                    isinstance(node, ast.Call)
                    and _call_name(node) == "getattr"
                    and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value == key
                    and (key not in QUALIFIED or section in ast.unparse(node.args[0]))
                ):
                    found[key].append(f"{path}:{node.lineno}: getattr(..., {key!r}) (a default of its own)")
                elif isinstance(node, ast.Dict):
                    for k, v in zip(node.keys, node.values):
                        if (
                            isinstance(k, ast.Tuple)
                            and [ast.literal_eval(e) if isinstance(e, ast.Constant) else None for e in k.elts]
                            == [section, key]
                            and isinstance(v, (ast.Tuple, ast.List, ast.Set))
                        ):
                            found[key].append(f"{path}:{k.lineno}: a second table of choices")
    return found


def bf16_mappings(sources: dict[str, str]) -> list[str]:
    """``path:function`` of every function (or module body) that holds both ``"bf16"`` and ``torch.bfloat16``."""
    out = []
    for path, text in sources.items():
        tree = ast.parse(text, path)
        scopes: list[tuple[str, ast.AST]] = [("<module>", tree)]
        scopes += [(n.name, n) for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for name, scope in scopes:
            nodes = (
                [
                    n
                    for stmt in tree.body
                    if not isinstance(stmt, (ast.FunctionDef, ast.ClassDef))
                    for n in ast.walk(stmt)
                ]
                if name == "<module>"
                else list(ast.walk(scope))
            )
            has_text = any(isinstance(n, ast.Constant) and n.value == "bf16" for n in nodes)
            has_dtype = any(isinstance(n, ast.Attribute) and n.attr == "bfloat16" for n in nodes)
            if has_text and has_dtype:
                out.append(f"{path}:{name}")
    return out


def test_each_setting_is_parsed_by_its_one_parser():
    found = second_parsers(_sources())
    assert found == {key: [] for key in PARSERS}, "\n".join(line for lines in found.values() for line in lines)


def test_each_parser_is_defined_once_and_validation_calls_it():
    sources = _sources()
    defs: dict[str, list[str]] = {parser: [] for _, _, parser in PARSERS.values()}
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in defs:
                defs[node.name].append(path)
    assert defs == {parser: [module] for _, module, parser in PARSERS.values()}
    validate = ast.parse(sources["megatron_geo/training/validate.py"])
    called = {_call_name(n) for n in ast.walk(validate) if isinstance(n, ast.Call)}
    assert {parser for _, _, parser in PARSERS.values()} <= called


def test_bf16_is_mapped_to_torch_bfloat16_only_by_the_dtype_parsers():
    allowed = {f"{module}:{parser}" for module, parser in DTYPE_PARSERS}
    extra = [m for m in bf16_mappings(_sources()) if m not in allowed and m.split(":")[0] not in OTHER_BF16_MAPPINGS]
    assert extra == [], extra


@pytest.mark.parametrize(
    "path,code,key",
    [
        (
            "m.py",
            'def f(cfg):\n    return torch.bfloat16 if cfg.train.param_dtype == "bf16" else torch.float32\n',
            "param_dtype",
        ),
        ("m.py", 'def f(cfg):\n    return str(getattr(cfg.optimizer, "muon_split", "off"))\n', "muon_split"),
        ("m.py", 'C = {("optimizer", "muon_ns_dtype"): ("auto", "bf16", "fp32")}\n', "muon_ns_dtype"),
        ("m.py", "def f(c):\n    return build_muon([], ns_dtype=c.muon_ns_dtype)\n", "muon_ns_dtype"),
        ("m.py", "def f(cfg):\n    c, g = cfg.comm, cfg.geo\n    p = g.power\n    return float(p)\n", "power"),
        ("m.py", 'def f(geo: GeoConfig):\n    return geo.power == "auto"\n', "power"),
        (
            "megatron_geo/model/llama.py",
            "def other(train):\n    return {'bf16': 2}[train.param_dtype]\n",
            "param_dtype",
        ),
    ],
)
def test_a_second_parser_is_found(path, code, key):
    assert second_parsers({path: code})[key], code


@pytest.mark.parametrize(
    "code",
    [
        "def f(cfg):\n    return parse_muon_split(cfg.optimizer.muon_split)\n",
        "def f(cfg, spec):\n    s = cfg.optimizer.muon_split\n    parse_muon_split(s)\n    spec.split = s\n",
        'def f(g):\n    print(f"geo.power={g.power}")\n    return parse_power(g.power)\n',
        "def f(self):\n    return self.power == 'auto'\n",  # not a config section: an already parsed value
    ],
)
def test_the_allowed_reads_pass(code):
    assert second_parsers({"m.py": code}) == {key: [] for key in PARSERS}, code


def test_resume_compares_geo_power_by_its_parsed_value():
    """A checkpoint's ``geo.power`` in another spelling (an older release stored the number 0.5) is the same value;
    a different power is still refused."""
    from megatron_geo.checkpoint.resume_changes import check_resume_changes
    from megatron_geo.config import ConfigError, config_to_dict, load_config

    def cfg(*extra):
        return load_config([], ["comm.dtype=fp8_e4m3", "comm.transform=geo", *extra])

    saved = config_to_dict(cfg())
    for old in (0.5, "0.50", "5e-1"):
        saved["geo"]["power"] = old
        assert check_resume_changes(saved, cfg(), 10, "resume") == [], old
    with pytest.raises(ConfigError, match=r"geo.power changed on resume: 0.5 -> 0.25"):
        check_resume_changes(saved, cfg("geo.power=0.25"), 10, "resume")
