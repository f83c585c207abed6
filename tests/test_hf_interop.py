"""Hugging Face interop (tools/convert_checkpoint.py --to hf / --from hf), checked against independent references:
transformers' own LlamaForCausalLM forward and tokenizer vs our model and SentencePiece tokenizer; the original
TP=2 x DP=2 checkpoint's tensors vs the round trip; a run resumed from the original checkpoint vs one resumed from
the imported checkpoint; and the tool's error paths (exit code 2, one line naming the value and the fix)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from ckpt_helpers import make_corpus, tiny_train_overrides, train_jobs  # noqa: E402
from dist_harness import run_distributed  # noqa: E402
from helpers import one_error_line  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# vocab 96 is padded to 128 at TP=2: the export must drop it; no validation passes (time)
EXTRA = ("model.make_vocab_size_divisible_by=64", "train.eval_batches=0")


def _tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint_tool", ROOT / "tools" / "convert_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TOOL = _tool()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A checkpoint saved at TP=2 x DP=2 after 2 steps (the run goes on to step 3) and its FP32 HF export."""
    d = tmp_path_factory.mktemp("hf")
    corpus = make_corpus(d / "corpus")
    run = d / "orig"
    run_distributed(
        train_jobs,
        4,
        [tiny_train_overrides(run, corpus, "train.steps=3", "checkpoint.interval=2", "parallel.tensor=2", *EXTRA)],
    )
    step2 = run / "checkpoints" / "step_00000002"
    assert json.loads((step2 / "meta.json").read_text())["tp_size"] == 2
    hf = d / "hf"
    assert TOOL.main([str(step2), str(hf), "--to", "hf", "--dtype", "fp32"]) == 0
    return {"dir": d, "corpus": corpus, "run": run, "step2": step2, "hf": hf, "state": TOOL.read_model_state(step2)}


def _ours(ckpt, tmp_path):
    """Our TP=1 model with the checkpoint's weights, through the consolidated file (the eval path)."""
    from megatron_geo.checkpoint import load_consolidated, save_consolidated
    from megatron_geo.checkpoint.consolidated import config_from_dict
    from megatron_geo.checkpoint.manager import read_meta

    cfg = config_from_dict(read_meta(ckpt["step2"])["config"])
    save_consolidated(tmp_path / "c.pt", cfg, ckpt["state"])
    return load_consolidated(tmp_path / "c.pt")


def _per_token(ours, hf, seqs: torch.Tensor) -> float:
    """Max |our per-token loss - transformers' per-token loss| over ``seqs`` ``[b, s + 1]``."""
    with torch.no_grad():
        a = ours(seqs[:, :-1], seqs[:, 1:])
        logits = hf(input_ids=seqs[:, :-1]).logits.float()
        b = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1), reduction="none")
    assert a.shape == seqs[:, 1:].shape and torch.isfinite(a).all()
    return float((a - b.view_as(a)).abs().max())


def test_export_loads_in_transformers_with_our_losses_and_token_ids(ckpt, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from megatron_geo.data import Tokenizer

    cfg, ours = _ours(ckpt, tmp_path)
    hc = AutoConfig.from_pretrained(ckpt["hf"])
    assert (hc.vocab_size, hc.num_key_value_heads, hc.tie_word_embeddings) == (96, 2, False)
    assert ours.padded_vocab == 128 and hc.rms_norm_eps == cfg.model.norm_eps
    # transformers 4.x reads rope_theta from the top level only (5.x also from rope_parameters)
    assert json.loads((ckpt["hf"] / "config.json").read_text())["rope_theta"] == cfg.model.rope_theta
    hf = AutoModelForCausalLM.from_pretrained(ckpt["hf"]).eval()  # FP32: the folder's dtype
    assert hf.lm_head.weight.dtype == torch.float32
    g = torch.Generator().manual_seed(3)
    rand = _per_token(ours, hf, torch.randint(0, 96, (4, cfg.model.seq_length + 1), generator=g))

    ours_tok = Tokenizer(cfg.data.tokenizer_model)
    hf_tok = AutoTokenizer.from_pretrained(ckpt["hf"])
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.unk_token_id) == (1, 2, 0)
    lines = (Path(cfg.data.tokenizer_model).parent / "text.txt").read_text().splitlines()[500:540]
    odd = [
        " leading space",
        "two  spaces\n\nand lines",
        "unseen chars: üñ ☃",
        "",
        "x\n",
        "alpha12345",
        "<s> </s> <unk> as text",
    ]  # ordinary pieces to SentencePiece, so not the special tokens here either
    for text in lines + odd:
        assert hf_tok(text)["input_ids"] == ours_tok.encode(text), text
    stream = [t for line in lines for t in [ours_tok.eod_id] + ours_tok.encode(line)]
    n = cfg.model.seq_length + 1
    corpus = torch.tensor(stream[: len(stream) // n * n]).view(-1, n)
    text = _per_token(ours, hf, corpus)
    print(
        f"\nmax |per-token loss difference| vs transformers: random tokens {rand:.2e}, corpus text {text:.2e} "
        f"({corpus.shape[0]} x {n - 1} tokens)"
    )
    assert rand <= 1e-5 and text <= 1e-5


def test_round_trip_is_bitwise_and_bf16_shards(ckpt, tmp_path):
    from safetensors.torch import load_file

    imported = tmp_path / "imported"
    assert TOOL.main([str(ckpt["hf"]), str(imported), "--from", "hf"]) == 0
    back = TOOL.read_model_state(imported)
    assert back.keys() == ckpt["state"].keys()
    for name, t in ckpt["state"].items():
        assert torch.equal(back[name], t), name
    # BF16, sharded above a small limit: the shards hold exactly the FP32 export rounded to BF16
    out = tmp_path / "bf16"
    assert TOOL.main([str(ckpt["step2"]), str(out), "--to", "hf", "--max-shard-size", "40KB", "--no-tokenizer"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) > 1 and not (out / "tokenizer.json").exists()
    fp32 = load_file(str(ckpt["hf"] / "model.safetensors"))
    bf16 = {k: v for s in shards for k, v in load_file(str(out / s)).items()}
    assert bf16.keys() == fp32.keys() == index.keys()
    for k, v in fp32.items():
        assert bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], v.to(torch.bfloat16)), k
    assert json.loads((out / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_run_resumed_from_the_imported_checkpoint_continues_with_the_same_loss(ckpt, tmp_path):
    imported = tmp_path / "imported"
    assert TOOL.main([str(ckpt["hf"]), str(imported), "--from", "hf", "--force"]) == 0
    meta = json.loads((imported / "meta.json").read_text())
    assert (meta["step"], meta["consumed_samples"], meta["tp_size"]) == (0, 0, 1)
    assert "model:\n  hidden_size: 32\n" in (imported / "model.yaml").read_text()
    # position the imported checkpoint at the original's step so that both runs read the same next batch
    orig = json.loads((ckpt["step2"] / "meta.json").read_text())
    meta.update(step=orig["step"], consumed_samples=orig["consumed_samples"])
    (imported / "meta.json").write_text(json.dumps(meta))
    common = ("train.steps=3", "checkpoint.save_at_end=false", *EXTRA)
    run_distributed(
        train_jobs,
        1,
        [
            tiny_train_overrides(tmp_path / "from_hf", ckpt["corpus"], f"checkpoint.load={imported}", *common),
            tiny_train_overrides(tmp_path / "from_orig", ckpt["corpus"], f"checkpoint.load={ckpt['step2']}", *common),
        ],
    )
    from_hf, from_orig, straight = (
        _losses(tmp_path / "from_hf"),
        _losses(tmp_path / "from_orig"),
        _losses(ckpt["run"]),
    )
    print(
        f"\nstep 3 loss: resumed from the HF import {from_hf[3]!r}, from the original checkpoint {from_orig[3]!r}, "
        f"the original TP=2 x DP=2 run {straight[3]!r}"
    )
    assert list(from_hf) == [3] and from_hf[3] == from_orig[3]  # same layout (DP=1): bitwise
    assert from_hf[3] == pytest.approx(straight[3], rel=1e-6)  # the TP=2 x DP=2 run: fp32 reduction order aside


def _hf_folder(tmp_path: Path, ckpt, name: str, config_edit=None, drop=(), add=None) -> Path:
    """A copy of the exported folder with ``config.json`` edited and tensors dropped or added."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / name
    shutil.copytree(ckpt["hf"], d)
    if config_edit:
        c = json.loads((d / "config.json").read_text())
        config_edit(c)
        (d / "config.json").write_text(json.dumps(c))
    if drop or add:
        t = {k: v for k, v in load_file(str(d / "model.safetensors")).items() if k not in drop}
        save_file({**t, **(add or {})}, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_error_paths_name_the_value_and_the_fix(ckpt, tmp_path, capsys):
    def err(*argv) -> str:
        return one_error_line(TOOL, capsys, *argv)

    out = tmp_path / "out"
    assert "is not a folder" in err(tmp_path / "nope", out, "--from", "hf")
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in err(tmp_path / "empty", out, "--from", "hf")
    cases = [
        ("bias", lambda c: c.update(attention_bias=True), "attention_bias=True is not supported"),
        ("scaled", lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling="),
        ("yarn", lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_parameters="),
        ("mistral", lambda c: c.update(model_type="mistral"), "model_type='mistral' is not supported"),
        ("act", lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        ("gqa", lambda c: c.update(num_key_value_heads=3), "num_key_value_heads=3 is not supported"),
    ]
    for name, edit, want in cases:
        msg = err(_hf_folder(tmp_path, ckpt, name, edit), out, "--from", "hf")
        assert want in msg and "megatron_geo's Llama needs" in msg, msg
    tied = _hf_folder(tmp_path, ckpt, "tied", lambda c: c.update(tie_word_embeddings=True))
    assert "lm_head.weight differs from model.embed_tokens.weight" in err(tied, out, "--from", "hf")
    assert "'lm_head.weight' is missing" in err(
        _hf_folder(tmp_path, ckpt, "nohead", drop=("lm_head.weight",)), out, "--from", "hf"
    )
    biased = _hf_folder(tmp_path, ckpt, "bias_t", add={"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)})
    assert "biases (model.layers.0.self_attn.q_proj.bias" in err(biased, out, "--from", "hf")
    noweights = _hf_folder(tmp_path, ckpt, "noweights")
    (noweights / "model.safetensors").rename(noweights / "pytorch_model.bin")
    msg = err(noweights, out, "--from", "hf")
    assert "has no model.safetensors" in msg and "pytorch_model.bin" in msg and "safe_serialization" in msg
    truncated = _hf_folder(tmp_path, ckpt, "truncated")
    (truncated / "model.safetensors").write_bytes((truncated / "model.safetensors").read_bytes()[:5000])
    assert "could not be read" in err(truncated, out, "--from", "hf")
    nan = _hf_folder(tmp_path, ckpt, "nan", add={"model.norm.weight": torch.full((32,), float("nan"))})
    assert "'model.norm.weight' holds NaN or inf" in err(nan, out, "--from", "hf")
    assert "--dtype apply to an export" in err(ckpt["hf"], out, "--from", "hf", "--dtype", "fp32")
    assert "--tokenizer and --no-tokenizer" in err(
        ckpt["step2"], out, "--to", "hf", "--tokenizer", "t.model", "--no-tokenizer"
    )
    assert "the current folder or above it" in err(ckpt["step2"], ".", "--to", "hf")
    assert "where checkpoint pruning would delete it" in err(ckpt["step2"], ckpt["step2"].parent / "x", "--to", "hf")
    assert not out.exists()  # nothing was written by the failures
    # a non-empty output is kept unless --force
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "is not empty; choose a new folder or pass --force" in err(ckpt["step2"], out, "--to", "hf")
    assert "is not empty" in err(ckpt["hf"], out, "--from", "hf")
    assert (out / "keep.txt").read_text() == "mine"
    assert "is or contains the input" in err(ckpt["hf"], ckpt["hf"], "--from", "hf", "--force")
    assert "is or contains the input" in err(ckpt["step2"], ckpt["run"], "--to", "hf", "--force")
    assert (ckpt["hf"] / "model.safetensors").is_file() and ckpt["step2"].is_dir()
    assert "--from hf and --to hf" in err(ckpt["hf"], out, "--from", "hf", "--to", "hf")
    other = tmp_path / "other_tok"
    msg = err(
        ckpt["step2"],
        tmp_path / "o4",
        "--to",
        "hf",
        "--tokenizer",
        make_corpus(other, vocab_size=100)[3].split("=", 1)[1],
    )
    assert "has 100 pieces but the model has model.vocab_size=96" in msg and not (tmp_path / "o4").exists()
    assert "--config applies to --from hf" in err(ckpt["step2"], tmp_path / "o3", "--to", "hf", "--config", "x.yaml")
    assert "holds no complete checkpoint" in err(tmp_path / "empty", tmp_path / "o2", "--to", "hf")
    with pytest.raises(SystemExit) as e:
        TOOL.main([str(ckpt["step2"]), str(out), "--to", "hf", "--dtype", "fp8"])
    assert e.value.code == 2


MC_ITEMS = [  # the corpus' words; the right choice is the more frequent continuation pattern or arbitrary
    {"question": "alpha12 beta3", "choices": [" gamma4", " zeta19", " omega"], "label": 0},
    {"question": "kappa26 alpha16 lambda31", "choices": [" kappa19", " theta", " delta7 sigma2"], "label": 1},
    {"question": "sigma8 beta39 ", "choices": ["sigma34", "zeta9", "lambda"], "label": 2},
    {"question": "omega", "choices": ["1", "22", "3 beta"], "label": 0},
]


def test_eval_downstream_scores_the_hf_folder_like_the_consolidated_checkpoint(ckpt, tmp_path):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from megatron_geo.checkpoint import save_consolidated
    from megatron_geo.checkpoint.consolidated import config_from_dict
    from megatron_geo.checkpoint.manager import read_meta
    from megatron_geo.eval.downstream import EvalSettings, _our_lm, evaluate_checkpoint
    from megatron_geo.eval.hf_lm import load_hf_lm

    cfg = config_from_dict(read_meta(ckpt["step2"])["config"])
    pt = save_consolidated(tmp_path / "m.pt", cfg, ckpt["state"], cfg.data.tokenizer_model)
    ours, hf = _our_lm(str(pt), None, 4, "cpu")[2], load_hf_lm(ckpt["hf"], 4)
    pairs = [(it["question"], c) for it in MC_ITEMS for c in it["choices"]] + [("", "alpha1 beta2")]
    reqs = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    a, b = ours.loglikelihood(reqs), hf.loglikelihood(reqs)
    diff = max(abs(x[0] - y[0]) for x, y in zip(a, b))
    print(f"\nlm-eval loglikelihoods, our wrapper vs lm-eval's hf model: max difference {diff:.2e}")
    assert diff <= 1e-4 and [x[1] for x in a] == [y[1] for y in b]
    assert len({round(x[0], 3) for x in a}) > len(pairs) // 2  # distinct scores: the comparison can fail
    # the tool's evaluation function on the HF folder, on a local task: our wrapper's accuracy
    data = tmp_path / "items.json"
    data.write_text("\n".join(json.dumps(i) for i in MC_ITEMS) + "\n")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "corpus_mc.yaml").write_text(
        f"task: corpus_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'target_delimiter: ""\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n'
    )
    kw = dict(tasks=["corpus_mc"], settings=EvalSettings(include_path=str(tasks), include_defaults=False, batch_size=4))
    e_hf = evaluate_checkpoint(str(ckpt["hf"]), **kw)
    scores, i = [], 0  # our wrapper's accuracy from its loglikelihoods above (the requests lm-eval makes)
    for it in MC_ITEMS:
        s = [x[0] for x in a[i : i + len(it["choices"])]]
        scores.append(float(s.index(max(s)) == it["label"]))
        i += len(it["choices"])
    assert e_hf["metrics"]["corpus_mc"]["acc"] == pytest.approx(sum(scores) / len(scores))
    assert e_hf["label"] == "hf" and e_hf["seed"] is None and e_hf["n_samples"]["corpus_mc"] == len(MC_ITEMS)
    with pytest.raises(ValueError, match="--tokenizer applies to consolidated checkpoints"):
        evaluate_checkpoint(str(ckpt["hf"]), tokenizer=cfg.data.tokenizer_model, **kw)


def test_import_of_a_model_written_by_transformers_gives_its_losses(tmp_path):
    """The import direction on its own: a Llama that transformers built and saved (its own init, GQA, another
    rope_theta and eps) has, after --from hf, our per-token losses equal to transformers' forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_geo.checkpoint import load_consolidated, save_consolidated
    from megatron_geo.checkpoint.consolidated import config_from_dict

    torch.manual_seed(0)
    hc = LlamaConfig(
        vocab_size=77,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=24,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(hc).eval()
    hf.save_pretrained(tmp_path / "theirs")
    assert TOOL.main([str(tmp_path / "theirs"), str(tmp_path / "ck"), "--from", "hf"]) == 0
    cfg = config_from_dict(json.loads((tmp_path / "ck" / "meta.json").read_text())["config"])
    m = cfg.model
    assert (m.vocab_size, m.num_kv_heads, m.seq_length, m.norm_eps, m.rope_theta) == (77, 2, 24, 1e-6, 500000.0)
    save_consolidated(tmp_path / "c.pt", cfg, TOOL.read_model_state(tmp_path / "ck"))
    _, ours = load_consolidated(tmp_path / "c.pt")
    diff = _per_token(ours, hf, torch.randint(0, 77, (3, 25), generator=torch.Generator().manual_seed(1)))
    print(f"\nimported transformers model: max |per-token loss difference| {diff:.2e}")
    assert diff <= 1e-5


def test_tokenizer_with_byte_fallback_and_an_unsupported_one(tmp_path):
    """A byte-fallback model (our default from 1,024 pieces): the same ids as SentencePiece, unseen characters as
    byte pieces; a unigram model is one clear error."""
    import random

    from transformers import AutoTokenizer

    from megatron_geo.checkpoint.hf import HFConversionError
    from megatron_geo.checkpoint.hf_tokenizer import save_hf_tokenizer
    from megatron_geo.data import Tokenizer, train_tokenizer

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(1, 8))) for _ in range(2000)]
    lines = [" ".join(rng.choice(words) + rng.choice(["", ",", ".", " 42"]) for _ in range(12)) for _ in range(2000)]
    (tmp_path / "t.txt").write_text("\n".join(lines))
    model = train_tokenizer([str(tmp_path / "t.txt")], str(tmp_path / "bf"), vocab_size=1100)
    save_hf_tokenizer(model, tmp_path / "hf")
    ours, hf = Tokenizer(model), AutoTokenizer.from_pretrained(tmp_path / "hf")
    texts = lines[:50] + ["  café ☃ naïve\n\tend ", "ÿ€𝄞", " x"]
    for text in texts:
        assert hf(text)["input_ids"] == ours.encode(text), text
    assert hf.decode(ours.encode("café ☃")) == ours.decode(ours.encode("café ☃")) == "café ☃"
    uni = train_tokenizer([str(tmp_path / "t.txt")], str(tmp_path / "uni"), vocab_size=300, model_type="unigram")
    with pytest.raises(HFConversionError, match=r"trainer_spec.model_type=1 is not supported .* --no-tokenizer"):
        save_hf_tokenizer(uni, tmp_path / "hf2")


def test_training_and_eval_paths_never_import_transformers():
    import subprocess
    import sys

    code = (
        "import sys, megatron_geo.training.trainer, megatron_geo.checkpoint, megatron_geo.checkpoint.hf, "
        "megatron_geo.eval.downstream, megatron_geo.eval.hf_lm; "
        "print(sorted({'transformers', 'safetensors', 'tokenizers'} & set(sys.modules)))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr[-2000:]


def test_an_imported_model_starts_with_any_optimizer(tmp_path):
    """An import holds no optimizer state, so a run may start it with another optimizer than the config the
    import was written with (a note, not an error); a checkpoint with optimizer state still refuses."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_geo.checkpoint.manager import check_compatible, read_meta
    from megatron_geo.config import ConfigError, load_config

    hc = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4)
    LlamaForCausalLM(hc).save_pretrained(tmp_path / "theirs")
    assert TOOL.main([str(tmp_path / "theirs"), str(tmp_path / "ck"), "--from", "hf"]) == 0
    meta = read_meta(tmp_path / "ck")
    meta["path"] = str(tmp_path / "ck")
    assert meta["config"]["optimizer"]["name"] == "adamw"
    model = [f"model.{k}={v}" for k, v in meta["config"]["model"].items()]
    _, notes = check_compatible(meta, load_config([], [*model, "optimizer.name=muon"]), 2, 1)
    assert any("optimizer.name adamw -> muon" in n and "no optimizer state" in n for n in notes), notes
    meta["path"] = None  # unknown contents: the strict answer
    with pytest.raises(ConfigError, match="the optimizer state cannot be converted"):
        check_compatible(meta, load_config([], [*model, "optimizer.name=muon"]), 2, 1)
