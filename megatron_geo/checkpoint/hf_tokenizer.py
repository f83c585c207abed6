"""Our SentencePiece model as a Hugging Face fast tokenizer that gives the same token ids.

``transformers``' own ``LlamaTokenizer`` rebuilds its backend with a ``Metaspace`` pre-tokenizer and
``byte_fallback=True``; on our models that changes ids (a leading space loses SentencePiece's dummy
prefix, and without byte pieces unknown characters vanish instead of becoming ``<unk>``). So the
``tokenizers`` pipeline is built from the model proto the way SentencePiece encodes: the BPE vocabulary
and merges in piece-score order, ``<unk>`` fused, byte fallback as trained, ``▁`` prepended once and
spaces replaced by ``▁`` (normalizer), the one-character user-defined pieces (``"\\n"``) left as plain
vocabulary pieces (no merge contains them, so BPE keeps them whole as SentencePiece does), and saved
as a ``PreTrainedTokenizerFast`` (like Meta's Llama 3 exports).

No special token is added on encode (training documents are ``encode(text) + [eos]``, without BOS):
``AutoTokenizer.from_pretrained(folder)(text).input_ids == Tokenizer(model).encode(text)``. Text that
contains a special token's string (``"</s>"``) maps to that special token in transformers, as usual there.
"""

from __future__ import annotations

from pathlib import Path

from .hf import HFConversionError

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_BPE = 2


def _read_proto(model_path: str):
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    try:
        proto.ParseFromString(Path(model_path).read_bytes())
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise HFConversionError(
            f"tokenizer '{model_path}' is not a SentencePiece model ({type(e).__name__}); pass "
            f"--tokenizer PATH.model or --no-tokenizer"
        ) from None
    if not proto.pieces:
        raise HFConversionError(
            f"tokenizer '{model_path}' is not a SentencePiece model (no pieces); pass "
            f"--tokenizer PATH.model or --no-tokenizer"
        )
    return proto


def _check_supported(proto, model_path: str) -> None:
    ts, ns = proto.trainer_spec, proto.normalizer_spec

    def bad(field, value, need):
        raise HFConversionError(
            f"tokenizer '{model_path}': {field}={value!r} is not supported by the Hugging Face "
            f"export (needs {need}, as tools/train_tokenizer.py trains); pass --no-tokenizer "
            f"to export the model alone"
        )

    if ts.model_type != _BPE:
        bad("trainer_spec.model_type", ts.model_type, "2 (BPE)")
    if ns.precompiled_charsmap:
        bad("normalizer_spec.name", ns.name, "'identity'")
    if ns.remove_extra_whitespaces:
        bad("normalizer_spec.remove_extra_whitespaces", True, "false")
    if ts.treat_whitespace_as_suffix:
        bad("trainer_spec.treat_whitespace_as_suffix", True, "false")
    if not ns.escape_whitespaces:
        bad("normalizer_spec.escape_whitespaces", False, "true")
    kinds = [p.type for p in proto.pieces]
    long_user = [p.piece for p in proto.pieces if p.type == _USER_DEFINED and len(p.piece) > 1]
    if long_user:  # single characters stay plain BPE pieces (no merge can absorb them); longer ones could split
        bad("user-defined piece", long_user[0], "user-defined pieces of one character (like '\\n')")
    if kinds.count(_UNKNOWN) != 1:
        bad("unk piece count", kinds.count(_UNKNOWN), "exactly one <unk> piece")


def _merges(pieces: list[tuple[str, int]]) -> list[tuple[str, str]]:
    """BPE merges in SentencePiece's order: by the merged piece's rank (its id; pieces are stored by
    descending score), then the shorter left part (``transformers.convert_slow_tokenizer``'s rule)."""
    normal = {p: i for i, (p, kind) in enumerate(pieces) if kind == _NORMAL}
    out = []
    for piece, i in normal.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        splits = sorted(
            (lr for lr in splits if lr[0] in normal and lr[1] in normal), key=lambda lr: (normal[lr[0]], normal[lr[1]])
        )
        out += [(left, right, i) for left, right in splits]
    out.sort(key=lambda m: (m[2], len(m[0]), len(m[1])))
    return [(left, right) for left, right, _ in out]


def build_fast_tokenizer(model_path: str, model_max_length: int | None = None):
    """A ``transformers.PreTrainedTokenizerFast`` equivalent to the SentencePiece model at ``model_path``.

    Special tokens: ``unk_token``/``bos_token``/``eos_token`` are the model's unk/bos/eos pieces (ids as in the
    model); no pad token; nothing is added on encode.

    Raises:
        HFConversionError: not a SentencePiece model, or one the export cannot reproduce (not BPE, a
            normalization other than identity, extra-whitespace removal, ...), naming the field.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    proto = _read_proto(model_path)
    _check_supported(proto, model_path)
    pieces = [(p.piece, p.type) for p in proto.pieces]
    vocab = {p: i for i, (p, _) in enumerate(pieces)}
    unk = next(p for p, kind in pieces if kind == _UNKNOWN)
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=_merges(pieces),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=bool(proto.trainer_spec.byte_fallback),
        )
    )
    norm = [normalizers.Prepend("▁")] if proto.normalizer_spec.add_dummy_prefix else []
    tok.normalizer = normalizers.Sequence(norm + [normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if proto.normalizer_spec.add_dummy_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)
    tok.add_special_tokens(
        [AddedToken(p, special=True, normalized=False) for p, kind in pieces if kind in (_UNKNOWN, _CONTROL)]
    )
    ts = proto.trainer_spec

    def piece(i):
        return pieces[i][0] if 0 <= i < len(pieces) else None

    kwargs = {"model_max_length": model_max_length} if model_max_length else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=unk,
        bos_token=piece(ts.bos_id),
        eos_token=piece(ts.eos_id),
        clean_up_tokenization_spaces=False,
        **kwargs,
    )


def save_hf_tokenizer(
    model_path: str, out_dir: Path, model_max_length: int | None = None, vocab_size: int | None = None
) -> list[str]:
    """Write ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` (as the installed
    transformers writes them) and a copy of the SentencePiece model as ``tokenizer.model`` into ``out_dir``.
    Returns the file names written. Raises HFConversionError as :func:`build_fast_tokenizer`, and when the
    model has other than ``vocab_size`` pieces (the model's vocabulary; None: not checked)."""
    import json
    import shutil

    tok = build_fast_tokenizer(model_path, model_max_length)
    if vocab_size is not None and len(tok) != vocab_size:
        raise HFConversionError(
            f"tokenizer '{model_path}' has {len(tok)} pieces but the model has model.vocab_size="
            f"{vocab_size}; pass the tokenizer the run trained with (--tokenizer PATH) or "
            f"--no-tokenizer"
        )
    files = [Path(f).name for f in tok.save_pretrained(str(out_dir))]
    cfg_file = Path(out_dir) / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_file.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name every transformers version resolves
    # the text "<s>" is three ordinary pieces to SentencePiece (training); without this transformers would
    # match it as the special token
    tok_cfg["split_special_tokens"] = True
    cfg_file.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    shutil.copyfile(model_path, Path(out_dir) / "tokenizer.model")
    return sorted(set(files) | {"tokenizer.model"})
