"""Every third-party import of megatron_geo/ and tools/ is declared in pyproject.toml: by the base dependencies, or
by the extra of the feature that uses it. A package that works only because something else happens to pull it in
(protobuf through wandb, for the tokenizer export) breaks the first install without that something."""

import ast
import functools
import importlib.metadata as md
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("megatron_geo", "tools")

# The extras each optional feature documents (README "Which library does what", pyproject comments): a file not
# listed may use the base dependencies only.
FEATURE_EXTRAS = {
    "megatron_geo/checkpoint/hf_io.py": {"hf"},
    "megatron_geo/checkpoint/hf_tokenizer.py": {"hf"},
    "megatron_geo/checkpoint/gguf.py": {"hf"},
    "megatron_geo/data/hf_tokenizer.py": {"hf"},
    "tools/convert_checkpoint.py": {"hf"},
    "megatron_geo/eval/hf_lm.py": {"hf", "eval"},
    "megatron_geo/eval/": {"eval"},
    "tools/eval_downstream.py": {"eval"},
    "megatron_geo/model/te.py": {"te"},
}


def _norm(name: str) -> str:
    """A distribution name in its normalised form (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> str:
    return _norm(re.match(r"[A-Za-z0-9_.\-]+", req.strip()).group(0))


@pytest.fixture(scope="module")
def declared():
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {k: {_req_name(r) for r in v} for k, v in proj.get("optional-dependencies", {}).items()}
    return {_req_name(r) for r in proj["dependencies"]}, extras, proj


def _first_party() -> set[str]:
    names = {"megatron_geo", "__future__"}
    names |= {p.stem for p in (ROOT / "tools").glob("*.py")}  # tools import their siblings (tools/verdict.py)
    return names


def _imports(tree: ast.AST) -> list[str]:
    """Absolute module names imported anywhere in ``tree``; for ``from X import Y`` both ``X`` and ``X.Y`` (Y may
    be a submodule)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
    return out


def _module_level_imports(tree: ast.Module) -> list[str]:
    """Top-level names a module imports unconditionally (not inside try, if or a function)."""
    out = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            out += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module.split(".")[0])
    return out


def _third_party(top: str) -> bool:
    return top not in sys.stdlib_module_names and top not in _first_party()


def _source_file(module: str) -> Path | None:
    """The .py file of a dotted submodule of an installed package, found without importing anything."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations or not rest:
        return None
    for base in spec.submodule_search_locations:
        path = Path(base, *rest[:-1], rest[-1] + ".py")
        if path.is_file():
            return path
    return None


@functools.cache
def _packages() -> dict[str, list[str]]:
    return md.packages_distributions()


def _distributions_of(top: str) -> set[str]:
    """Installed distributions providing import name ``top`` (the name itself when none is installed)."""
    return {_norm(d) for d in _packages().get(top, [])} or {_norm(top)}


@functools.cache
def _files_of(dist: str) -> frozenset[str]:
    """The files a distribution installed, relative to its site-packages folder."""
    return frozenset(str(f) for f in md.distribution(dist).files or ())


def _distribution_of_file(path: Path, top: str) -> str | None:
    """The distribution that installed ``path`` (a file of import package ``top``), if any."""
    base = Path(importlib.util.find_spec(top).submodule_search_locations[0]).parent
    rel = path.relative_to(base).as_posix()
    for dist in _packages().get(top, []):
        if rel in _files_of(dist):
            return _norm(dist)
    return None


@functools.cache
def _requirement_closure(dist: str) -> frozenset[str]:
    """``dist`` and everything it installs unconditionally (its requirements without an ``extra`` marker, and
    theirs, as far as they are installed)."""
    seen, todo = set(), [dist]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or ()
        except md.PackageNotFoundError:
            continue
        todo += [_req_name(r) for r in reqs if "extra" not in r.partition(";")[2]]
    return frozenset(seen)


def _allowed(rel: str, base: set[str], extras: dict[str, set[str]]) -> set[str]:
    names = set(base)
    for prefix, feature in FEATURE_EXTRAS.items():
        if rel == prefix or (prefix.endswith("/") and rel.startswith(prefix)):
            for extra in feature:
                names |= extras[extra]
    return names


def _scanned_files():
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def test_every_third_party_import_is_declared(declared):
    base, extras, _ = declared
    missing = []
    for rel, tree in _scanned_files():
        allowed = _allowed(rel, base, extras)
        for module in _imports(tree):
            top = module.split(".")[0]
            if module.count(".") == 0 and _third_party(top) and not _distributions_of(top) & allowed:
                missing.append(f"{rel}: import {top} ({', '.join(sorted(_distributions_of(top)))})")
    assert not missing, "undeclared dependencies:\n" + "\n".join(sorted(set(missing)))
    # the test extra (make install, make test) installs every optional feature the tests exercise
    assert extras["hf"] | extras["eval"] <= extras["test"], sorted((extras["hf"] | extras["eval"]) - extras["test"])


def test_what_imported_submodules_need_is_declared(declared):
    """``from sentencepiece import sentencepiece_model_pb2`` needs protobuf, an optional dependency of sentencepiece:
    whatever an imported third-party submodule imports unconditionally that its own distribution does not install
    is ours to declare."""
    base, extras, _ = declared
    # the scan finds the model module the tokenizer export imports, and protobuf as what that module needs
    path = _source_file("sentencepiece.sentencepiece_model_pb2")
    assert path is not None and "google" in _module_level_imports(ast.parse(path.read_text()))
    assert "protobuf" in _distributions_of("google") and "verdict" in _first_party()
    missing = []
    for rel, tree in _scanned_files():
        allowed = _allowed(rel, base, extras)
        for module in _imports(tree):
            top = module.split(".")[0]
            if "." not in module or not _third_party(top):
                continue
            path = _source_file(module)
            owner = path and _distribution_of_file(path, top)
            if not owner:
                continue
            required = _requirement_closure(owner)
            for needed in _module_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
                if needed in sys.stdlib_module_names or needed == top:
                    continue
                dists = _distributions_of(needed)
                if not dists & required and not dists & allowed:
                    missing.append(f"{rel}: {module} imports {needed} ({', '.join(sorted(dists))})")
    assert not missing, "undeclared indirect dependencies:\n" + "\n".join(sorted(set(missing)))


def test_the_hf_extra_declares_protobuf_new_enough_for_sentencepieces_generated_code(declared):
    """sentencepiece's generated model code refuses a protobuf runtime older than the protobuf that generated it."""
    _, _, proj = declared
    bounds = [r for r in proj["optional-dependencies"]["hf"] if _req_name(r) == "protobuf"]
    assert bounds, "the hf extra must declare protobuf (the tokenizer export reads the model with it)"
    low = re.search(r">=\s*([0-9][0-9.]*)", bounds[0])
    assert low, f"protobuf needs a lower bound: {bounds[0]!r}"
    spec = importlib.util.find_spec("sentencepiece")
    pb2 = Path(spec.origin).parent / "sentencepiece_model_pb2.py"
    gen = re.search(r"ValidateProtobufRuntimeVersion\(\s*[\w.]+,\s*(\d+),\s*(\d+),\s*(\d+)", pb2.read_text())
    if gen is None:
        pytest.skip("this sentencepiece's generated code does not check the protobuf version")
    assert tuple(int(x) for x in low.group(1).split(".")) >= tuple(int(x) for x in gen.groups()), (
        f"{bounds[0]} is older than the protobuf {'.'.join(gen.groups())} sentencepiece's model code was generated with"
    )
