"""The keys with a fixed set of values are ``Literal`` fields of the schema: every listed value loads, any other is
refused as the config is read (naming the file or override, the key, the value and the choices), and a config
changed in code is refused by validation with the same message."""

import ast
import re
import typing
from pathlib import Path

import pytest

from megatron_geo.config import Config, ConfigError, load_config
from megatron_geo.config.checks import check_choices, choice_fields, choices_of
from megatron_geo.config.schema import CommConfig, TrainConfig

CHOICES = choice_fields()
IDS = [f"{sec}.{key}" for sec, key, _ in CHOICES]


def test_the_literal_fields_are_read_from_the_schema():
    hints = {(sec, key): typing.get_type_hints(type(getattr(Config(), sec)))[key] for sec, key, _ in CHOICES}
    assert all(typing.get_origin(t) is typing.Literal for t in hints.values())
    assert {(sec, key): values for sec, key, values in CHOICES} == {k: typing.get_args(t) for k, t in hints.items()}
    assert len(CHOICES) == 24 and ("comm", "scaling", ("tensor", "block")) in CHOICES
    # the keys with a parser of their own are plain strings
    for cls, key in ((TrainConfig, "param_dtype"), (CommConfig, "dtype"), (CommConfig, "param_gather")):
        assert typing.get_type_hints(cls)[key] is str
        with pytest.raises(TypeError, match="not a Literal field"):
            choices_of(cls, key)


@pytest.mark.parametrize("sec,key,values", CHOICES, ids=IDS)
def test_every_choice_loads_and_any_other_value_is_refused_at_load(tmp_path, sec, key, values):
    for v in values:
        assert getattr(getattr(load_config([], [f"{sec}.{key}={v}"]), sec), key) == v
        f = tmp_path / "c.yaml"
        f.write_text(f"{sec}:\n  {key}: '{v}'\n")
        assert getattr(getattr(load_config([str(f)]), sec), key) == v
    choices = ", ".join(values)
    with pytest.raises(ConfigError) as e:
        load_config([], [f"{sec}.{key}=bogus"])
    assert str(e.value) == f"override: {sec}.{key}='bogus' is not supported; choose one of {choices}"
    f = tmp_path / "bad.yaml"
    f.write_text(f"{sec}:\n  {key}: {values[0]}_x\n")
    with pytest.raises(ConfigError, match=re.escape(f"{f}: {sec}.{key}='{values[0]}_x' is not supported")):
        load_config([str(f)])


@pytest.mark.parametrize("sec,key,values", CHOICES, ids=IDS)
def test_a_value_set_in_code_is_refused_by_check_choices(sec, key, values):
    cfg = Config()
    check_choices(cfg)
    setattr(getattr(cfg, sec), key, "bogus")
    with pytest.raises(ConfigError, match=re.escape(f"{sec}.{key}='bogus' is not supported; choose one of ")):
        check_choices(cfg)


@pytest.mark.parametrize(
    "override,message",
    [
        ("comm.scaling=blocks", "override: comm.scaling='blocks' is not supported; choose one of tensor, block"),
        (
            "comm.transform=rotate",
            "override: comm.transform='rotate' is not supported; choose one of none, hadamard, geo",
        ),
        (
            "train.lr_decay_style=wsd",
            "override: train.lr_decay_style='wsd' is not supported; choose one of cosine, linear, constant",
        ),
        (
            "optimizer.name=sgd",
            "override: optimizer.name='sgd' is not supported; choose one of adamw, muon",
        ),
        (
            "parallel.overlap_param_gather=maybe",
            "override: parallel.overlap_param_gather='maybe' is not supported; choose one of auto, true, false",
        ),
    ],
)
def test_the_message_names_the_key_the_value_and_the_choices(override, message):
    with pytest.raises(ConfigError) as e:
        load_config([], [override])
    assert str(e.value) == message


def test_an_empty_choice_is_refused_and_null_is_the_default(tmp_path):
    with pytest.raises(ConfigError, match=r"override: comm\.scaling: empty value; .* null for the default \(tensor\)"):
        load_config([], ["comm.scaling="])
    assert load_config([], ["comm.scaling=block", "comm.scaling=null"]).comm.scaling == "tensor"


@pytest.mark.parametrize("key", ["parallel.overlap_param_gather", "comm.compile"])
def test_auto_true_false_keys_take_yaml_booleans(tmp_path, key):
    sec, name = key.split(".")
    for written, value in (("true", "true"), ("False", "false"), ("yes", "true"), ("off", "false"), ("auto", "auto")):
        f = tmp_path / "c.yaml"
        f.write_text(f"{sec}:\n  {name}: {written}\n")
        assert getattr(getattr(load_config([str(f)]), sec), name) == value, written
        assert getattr(getattr(load_config([], [f"{key}={written}"]), sec), name) == value, written
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}='2' is not supported; choose one of auto, true, false"):
        load_config([], [f"{key}=2"])


# -- one list of choices ---------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "megatron_geo" / "config" / "schema.py"


def _sources() -> list[Path]:
    """The project's Python outside the tests: the package, tools, benchmarks and the entry points."""
    files = [*ROOT.glob("*.py")]
    for folder in ("megatron_geo", "tools", "benchmarks"):
        files += (ROOT / folder).rglob("*.py")
    return sorted(files)


def restated_choices(path: str, text: str) -> list[str]:
    """``path:line: key`` of every tuple, list or set of strings (or the keys of a dict) equal, as a set, to the
    choices of a ``Literal`` field of the schema (``("tensor", "block")``, in any order)."""
    sets: dict[frozenset, str] = {}
    for sec, key, values in CHOICES:  # two keys may share their values (auto, true, false)
        sets[frozenset(values)] = " / ".join(filter(None, (sets.get(frozenset(values)), f"{sec}.{key}")))
    out = []
    for node in ast.walk(ast.parse(text, path)):
        elts = (
            node.elts
            if isinstance(node, (ast.Tuple, ast.List, ast.Set))
            else [k for k in node.keys if k is not None]
            if isinstance(node, ast.Dict)
            else None
        )
        if not elts or not all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts):
            continue
        key = sets.get(frozenset(e.value for e in elts))
        if key is not None:
            out.append(f"{path}:{node.lineno}: {key}")
    return out


def test_no_module_but_the_schema_lists_the_choices_of_a_literal_key():
    found = [
        hit
        for p in _sources()
        if p != SCHEMA
        for hit in restated_choices(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"))
    ]
    assert found == [], "read them with megatron_geo.config.checks.choices_of:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "code",
    [
        'SCALINGS = ("tensor", "block")\n',
        'def f(c):\n    return c.rounding in ["stochastic", "nearest"]\n',
        'TABLE = {"fp32_sum": 0, "wire_sum": 1}\n',
        'p.add_argument("--order", choices={"megatron", "stream"})\n',
    ],
)
def test_a_restated_list_of_choices_is_found(code):
    assert restated_choices("m.py", code), code


def test_the_schema_writes_each_list_of_choices_once():
    text = SCHEMA.read_text(encoding="utf-8")
    found = restated_choices("schema.py", text)
    assert len(found) == len(CHOICES) and 'scaling: Literal["tensor", "block"] = "tensor"' in text, found


def test_the_configuration_doc_names_every_choice():
    """docs/configuration.md's row of each ``Literal`` key names every value the schema allows."""
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    sections = {m.group(1): m.group(2) for m in re.finditer(r"^## `(\w+)`.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)}
    missing = []
    for sec, key, values in CHOICES:
        row = next((ln for ln in sections.get(sec, "").splitlines() if ln.startswith(f"| `{key}` |")), "")
        cells = "|".join(row.split("|")[2:])
        missing += [f"{sec}.{key}={v}" for v in values if not re.search(rf"(?<![\w.]){re.escape(v)}(?!\w)", cells)]
    assert missing == [], missing
