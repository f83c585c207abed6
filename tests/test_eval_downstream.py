"""Consolidated checkpoints and the lm-eval wrapper: round trip and bad files; loglikelihoods, greedy
tokens and rolling loglikelihoods against the model's own per-token loss (vocab-parallel cross entropy,
an independent path from the wrapper's log-softmax); the eval tool end to end on a local task."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from megatron_geo.checkpoint import load_consolidated, save_consolidated  # noqa: E402
from megatron_geo.checkpoint.consolidated import CheckpointError, _tp1_group, expected_shapes, tokenizer_path  # noqa: E402
from megatron_geo.config import load_config  # noqa: E402
from megatron_geo.data.tokenizer import Tokenizer, train_tokenizer  # noqa: E402
from megatron_geo.model.llama import Llama  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORDS = [
    "the",
    "king",
    "is",
    "dead",
    "long",
    "live",
    "the",
    "queen",
    "a",
    "horse",
    "my",
    "kingdom",
    "for",
    "a",
    "horse",
    "to",
    "be",
    "or",
    "not",
    "to",
    "be",
    "that",
    "is",
    "the",
    "question",
    "all",
    "the",
    "world",
    "is",
    "a",
    "stage",
    "and",
    "all",
    "the",
    "men",
    "and",
    "women",
    "merely",
    "players",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("evalck")
    g = torch.Generator().manual_seed(0)
    lines = [
        " ".join(WORDS[i] for i in torch.randint(len(WORDS), (12,), generator=g).tolist()).capitalize() + "."
        for _ in range(300)
    ]
    (d / "text.txt").write_text("\n".join(lines) + "\n")
    tok_path = train_tokenizer([str(d / "text.txt")], str(d / "tok"), vocab_size=120)
    tok = Tokenizer(tok_path)
    cfg = load_config(
        [],
        [
            f"model.vocab_size={tok.vocab_size}",
            "model.hidden_size=32",
            "model.num_layers=2",
            "model.num_attention_heads=4",
            "model.num_kv_heads=2",
            "model.ffn_hidden_size=64",
            "model.seq_length=32",
            "model.make_vocab_size_divisible_by=64",
            "train.seed=7",
        ],
    )
    model = Llama(cfg.model, _tp1_group(), 7)
    with torch.no_grad():  # a sharper-than-init model so that choices differ clearly
        for p in model.parameters():
            p.mul_(3.0)
    ckpt = save_consolidated(d / "a.pt", cfg, model.state_dict(), tok_path)
    return {"dir": d, "cfg": cfg, "model": model.eval(), "tok": tok, "tok_path": tok_path, "ckpt": ckpt}


def direct_logprob(model, tok, context: str, continuation: str) -> float:
    """-sum of the model's per-token loss over the continuation tokens, EOS-prefixed input."""
    ctx = tok.encode(context)
    whole = tok.encode(context + continuation)
    assert whole[: len(ctx)] == ctx, "test strings must tokenize with the context as a prefix"
    ids = torch.tensor([[tok.eod_id] + whole])
    with torch.no_grad():
        loss = model(ids[:, :-1], ids[:, 1:])[0]
    return -float(loss[len(ctx) :].sum())


# -- consolidated checkpoint ---------------------------------------------------------------------------
def test_expected_shapes_match_the_model(setup):
    assert {k: tuple(v.shape) for k, v in setup["model"].state_dict().items()} == expected_shapes(setup["cfg"].model)


def test_round_trip_and_tokenizer(setup, tmp_path):
    cfg, model = load_consolidated(setup["ckpt"])
    assert cfg == setup["cfg"]
    for (k, a), (k2, b) in zip(setup["model"].state_dict().items(), model.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    assert tokenizer_path(setup["ckpt"]) == str(Path(setup["tok_path"]).resolve())
    # the embedded bytes are used when the original file is gone
    moved = tmp_path / "moved.pt"
    payload = torch.load(setup["ckpt"], weights_only=True)
    payload["tokenizer_model"] = str(tmp_path / "gone.model")
    torch.save(payload, moved)
    p = tokenizer_path(moved)
    assert p != payload["tokenizer_model"] and Path(p).read_bytes() == Path(setup["tok_path"]).read_bytes()


def test_unpadded_vocab_rows_are_padded(setup, tmp_path):
    v = setup["cfg"].model.vocab_size
    state = {
        k: (t[:v].clone() if k in ("embed.weight", "output.weight") else t)
        for k, t in setup["model"].state_dict().items()
    }
    save_consolidated(tmp_path / "u.pt", setup["cfg"], state)
    _, m = load_consolidated(tmp_path / "u.pt")
    e = m.state_dict()["embed.weight"]
    assert torch.equal(e[:v], state["embed.weight"]) and e.shape[0] == 128 and not e[v:].any()


def test_bad_checkpoints(setup, tmp_path):
    with pytest.raises(CheckpointError, match="nope.pt' not found"):
        load_consolidated(tmp_path / "nope.pt")
    with pytest.raises(CheckpointError, match="is a folder"):
        load_consolidated(tmp_path)
    (tmp_path / "t.pt").write_text("hello")
    with pytest.raises(CheckpointError, match="not a readable consolidated checkpoint"):
        load_consolidated(tmp_path / "t.pt")
    torch.save({"model": {}}, tmp_path / "f.pt")
    with pytest.raises(CheckpointError, match="format None"):
        load_consolidated(tmp_path / "f.pt")
    payload = torch.load(setup["ckpt"], weights_only=True)
    payload["config"]["model"]["ffn_hidden_size"] = 96  # weights no longer fit the config
    torch.save(payload, tmp_path / "s.pt")
    with pytest.raises(CheckpointError, match=r"gate_proj.weight' has shape \(64, 32\).*\(96, 32\)"):
        load_consolidated(tmp_path / "s.pt")
    half = {k: (t[: t.shape[0] // 2] if t.ndim == 2 else t) for k, t in setup["model"].state_dict().items()}
    with pytest.raises(CheckpointError, match="tensor-parallel shard"):
        save_consolidated(tmp_path / "h.pt", setup["cfg"], half)
    assert not (tmp_path / "h.pt").exists()


# -- the lm-eval wrapper -------------------------------------------------------------------------------
class _Req:
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def lm(setup):
    from megatron_geo.eval.lm_wrapper import MegatronGeoLM

    return MegatronGeoLM(setup["model"], setup["tok"], batch_size=3)


PAIRS = [
    ("The king is", " dead."),
    ("To be or not", " to be"),
    ("A horse", " my kingdom for a horse."),
    ("All the world is a", " stage"),
    ("The queen", " is dead long live the king."),
    ("That", " is"),
]


def test_loglikelihood_matches_direct_computation(setup, lm):
    got = lm.loglikelihood([_Req(c, x) for c, x in PAIRS])
    for (c, x), (lp, _) in zip(PAIRS, got):
        assert lp == pytest.approx(direct_logprob(setup["model"], setup["tok"], c, x), abs=2e-4)
    # a trailing space of the context moves to the continuation: same text, same score
    ((lp2, _),) = lm.loglikelihood([_Req("The king is ", "dead.")])
    assert lp2 == pytest.approx(got[0][0], abs=2e-4)


def test_is_greedy_against_argmin_of_the_loss(setup, lm):
    model, tok = setup["model"], setup["tok"]
    ids = [tok.eod_id] + tok.encode("The king is")
    inp = torch.tensor([ids])
    with torch.no_grad():  # loss of every candidate next token at the last position
        losses = torch.stack([model(inp, torch.full_like(inp, v))[0, -1] for v in range(tok.vocab_size)])
    best = int(losses.argmin())
    cont_text = tok.decode(tok.encode("The king is") + [best])[len(tok.decode(tok.encode("The king is"))) :]
    pairs = [(ids, [best]), (ids, [(best + 1) % tok.vocab_size])]
    (lp, greedy), (lp_other, greedy_other) = lm.score_tokens(pairs)
    assert greedy and not greedy_other
    assert lp == pytest.approx(-float(losses[best]), abs=2e-4)
    assert lp_other == pytest.approx(-float(losses[(best + 1) % tok.vocab_size]), abs=2e-4)
    # greedy generation's first token is the same argmin
    assert lm.greedy("The king is", 1) == cont_text


def test_generate_until_cuts_at_stop_string(lm):
    full = lm.generate_until([_Req("The king", {"until": [], "max_gen_toks": 8})])[0]
    assert len(full) > 0
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = lm.generate_until([_Req("The king", {"until": [stop], "max_gen_toks": 8})])[0]
    assert cut == full[: full.find(stop)]


def test_loglikelihood_rolling(setup, lm):
    model, tok = setup["model"], setup["tok"]
    short = "The king is dead."
    ids = torch.tensor([[tok.eod_id] + tok.encode(short)])
    with torch.no_grad():
        ref = -float(model(ids[:, :-1], ids[:, 1:]).sum())
    assert lm.loglikelihood_rolling([_Req(short)])[0] == pytest.approx(ref, abs=2e-4)
    # longer than seq_length (32): every token scored once -> at least as many terms, finite and negative
    long = " ".join(["to be or not to be that is the question"] * 8)
    n = len(tok.encode(long))
    assert n > 32
    total = lm.loglikelihood_rolling([_Req(long)])[0]
    assert total < 0 and total == pytest.approx(total)
    # the first window is the prefix-conditioned score of the first 32 tokens
    first = torch.tensor([[tok.eod_id] + tok.encode(long)[:32]])
    with torch.no_grad():
        first_lp = -float(model(first[:, :-1], first[:, 1:]).sum())
    assert total < first_lp


# -- the tool end to end on a local multiple-choice task ------------------------------------------------
ITEMS = [
    {"question": "The king is", "choices": ["dead.", "a horse.", "the stage."], "label": 0},
    {"question": "To be or not to", "choices": ["be", "horse", "queen"], "label": 0},
    {"question": "A horse, a horse, my", "choices": ["kingdom", "players", "question"], "label": 0},
    {"question": "All the world is a", "choices": ["stage", "king", "women"], "label": 0},
    {"question": "Long live the", "choices": ["queen", "is", "merely"], "label": 1},
]


def test_eval_tool_end_to_end(setup, tmp_path):
    data = tmp_path / "items.json"
    data.write_text("\n".join(json.dumps(i) for i in ITEMS) + "\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "local_mc.yaml").write_text(
        "task: local_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n"
    )
    # a second checkpoint: another seed's weights under another label
    cfg2 = load_config(
        [],
        [
            f"{k}={v}"
            for k, v in (
                ("model.vocab_size", setup["cfg"].model.vocab_size),
                ("model.hidden_size", 32),
                ("model.num_layers", 2),
                ("model.num_attention_heads", 4),
                ("model.num_kv_heads", 2),
                ("model.ffn_hidden_size", 64),
                ("model.seq_length", 32),
                ("train.seed", 8),
            )
        ],
    )
    m2 = Llama(cfg2.model, _tp1_group(), 8)
    with torch.no_grad():
        for p in m2.parameters():
            p.mul_(3.0)
    ck2 = save_consolidated(tmp_path / "b.pt", cfg2, m2.state_dict(), setup["tok_path"])

    def direct_acc(model):
        hits = 0
        for it in ITEMS:  # lm-eval: continuation = target_delimiter " " + choice
            scores = [direct_logprob(model, setup["tok"], it["question"], " " + c) for c in it["choices"]]
            hits += int(max(range(len(scores)), key=scores.__getitem__) == it["label"])
        return hits / len(ITEMS)

    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "hf"),
        "PYTHONPATH": str(REPO),
    }
    out = tmp_path / "out"
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "eval_downstream.py"),
            str(setup["ckpt"]),
            str(ck2),
            "--tasks",
            "local_mc",
            "--include-path",
            str(tasks),
            "--no-default-tasks",
            "--labels",
            "a,b",
            "--baseline",
            "a",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    j = json.loads((out / "eval.json").read_text())
    acc_a, acc_b = direct_acc(setup["model"]), direct_acc(m2)
    ev = {e["label"]: e for e in j["evaluations"]}
    assert ev["a"]["metrics"]["local_mc"]["acc"] == pytest.approx(acc_a)
    assert ev["b"]["metrics"]["local_mc"]["acc"] == pytest.approx(acc_b)
    assert ev["a"]["n_samples"]["local_mc"] == len(ITEMS)
    assert j["summary"]["table"]["b"]["local_mc"]["delta"] == pytest.approx(acc_b - acc_a)
    md = (out / "eval.md").read_text()
    assert "local_mc (acc)" in md and f"{acc_a:.4f}" in md

    # bad input: a missing checkpoint and an unknown task are one error line each
    res = subprocess.run(
        [sys.executable, str(REPO / "tools" / "eval_downstream.py"), str(tmp_path / "no.pt")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert res.returncode == 2 and "no.pt' not found" in res.stderr


def test_summary_mean_std_delta():
    from megatron_geo.eval.downstream import summarize

    ev = [
        {"label": "bf16", "seed": s, "metrics": {"t": {"acc": v, "acc_stderr": 0.1}}} for s, v in ((1, 0.5), (2, 0.7))
    ]
    ev += [{"label": "fp8", "seed": s, "metrics": {"t": {"acc": v}}} for s, v in ((1, 0.4), (2, 0.6), (3, 0.8))]
    s = summarize(ev)
    assert s["baseline"] == "bf16" and s["metric"]["t"] == "acc"
    assert s["table"]["bf16"]["t"]["mean"] == pytest.approx(0.6)
    assert s["table"]["bf16"]["t"]["std"] == pytest.approx(0.1414213, abs=1e-6)
    assert s["table"]["fp8"]["t"]["std"] == pytest.approx(0.2) and s["table"]["fp8"]["t"]["delta"] == pytest.approx(0.0)


def test_unreachable_hub_switches_to_offline_at_once(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_downstream_tool", REPO / "tools" / "eval_downstream.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(tool, "hub_reachable", lambda: False)
    assert "offline mode" in tool.go_offline_if_unreachable()
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert tool.go_offline_if_unreachable() is None  # the user's (or our) offline choice stands
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setattr(tool, "hub_reachable", lambda: True)
    assert tool.go_offline_if_unreachable() is None and "HF_HUB_OFFLINE" not in os.environ
