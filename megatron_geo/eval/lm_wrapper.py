"""lm-evaluation-harness (``lm_eval``) model wrapper around a TP=1 :class:`~megatron_geo.model.llama.Llama`.

Scoring follows how the model was trained: every document in the training stream is followed by the
tokenizer's EOS piece (``megatron_geo.data.corpus``), so a request is scored after an EOS prefix (the
document boundary), the way GPT-2-style models are scored by lm-eval.

- ``loglikelihood((context, continuation))``: trailing spaces of the context move to the continuation,
  ``whole = encode(context + continuation)``, ``ctx = encode(context)`` and the continuation tokens are
  ``whole[n:]`` with ``n`` = the length of the common prefix of ``ctx`` and ``whole`` (always
  ``len(ctx)`` unless a BPE merge spans the boundary; at least one continuation token). The log-probability
  is ``sum_i log softmax(logits[t_i - 1])[t_i]`` over the continuation tokens (natural log, FP32), with the
  input left-truncated to ``seq_length + 1`` tokens; ``is_greedy`` is whether every continuation token is
  the argmax. (SentencePiece adds a dummy-prefix space to every encoded string, so encoding the
  continuation on its own would give different tokens.)
- ``loglikelihood_rolling((text,))``: the sum of the log-probabilities of all tokens of ``text``, in
  windows of ``seq_length`` predicted tokens (``lm_eval.utils.get_rolling_token_windows``, EOS prefix).
- ``generate_until((context, gen_kwargs))``: greedy decoding (no sampling; a request asking for sampling
  is decoded greedily with a warning) of up to ``max_gen_toks`` tokens, stopped at EOS or at the first
  ``until`` string, which is cut off.

Logits come from the model's own modules (embedding, blocks, final norm, output layer); the padded
vocabulary columns are excluded (set to -inf) as in the training loss.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from ..data.hf_tokenizer import HFTokenizer
from ..data.tokenizer import Tokenizer
from ..model.llama import Llama

log = logging.getLogger(__name__)


@torch.no_grad()
def llama_hidden(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """Final-norm hidden states ``[b, s, hidden]`` of a TP=1 Llama for ``tokens`` int64 ``[b, s]``.
    Raises ValueError for a tensor-parallel model."""
    if dist.get_world_size(model.tp_group) != 1:
        raise ValueError("the lm-eval wrapper needs a TP=1 model (load one with load_consolidated)")
    x = model.embed(tokens)
    for block in model.layers:
        x = block(x, model.rope_cos, model.rope_sin)
    return model.norm(x)


@torch.no_grad()
def llama_logits(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token logits float32 ``[b, s, vocab_size]`` (padded vocabulary columns dropped)."""
    return output_logits(model, llama_hidden(model, tokens))


@torch.no_grad()
def output_logits(model: Llama, hidden: torch.Tensor) -> torch.Tensor:
    """Output layer on final-norm hidden states ``[..., hidden]`` -> float32 ``[..., vocab_size]``."""
    return model.output(hidden)[..., : model.cfg.vocab_size].float()


class MegatronGeoLM(LM):
    """lm-eval ``LM`` over our Llama and its tokenizer (SentencePiece, or a Hugging Face tokenizer).

    Args:
        model: TP=1 Llama (eval mode is set here).
        tokenizer: the tokenizer the model was trained with (its vocab must equal ``model.cfg.vocab_size``).
        batch_size: sequences per forward pass for loglikelihood requests.
        device: where inputs go (the model's device by default).
    """

    def __init__(self, model: Llama, tokenizer: Tokenizer | HFTokenizer, batch_size: int = 8, device=None):
        super().__init__()
        if tokenizer.vocab_size != model.cfg.vocab_size:
            raise ValueError(
                f"tokenizer '{tokenizer.model_path}' has {tokenizer.vocab_size} pieces but the model was "
                f"built for model.vocab_size={model.cfg.vocab_size}; pass the training tokenizer"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.model, self.tok, self.batch_size = model.eval(), tokenizer, batch_size
        self._device = torch.device(device) if device else next(model.parameters()).device
        self.max_length = model.cfg.seq_length
        self.prefix_id = tokenizer.eod_id
        self._warned_sampling = False

    # -- token-level scoring --------------------------------------------------------------------------
    @torch.no_grad()
    def score_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(sum log p(cont | ctx), all greedy)`` for each ``(ctx, cont)`` token-id pair; ``ctx`` must be
        non-empty. The input ``ctx + cont`` is left-truncated to ``seq_length + 1`` tokens."""
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            seqs, conts = [], []
            for i in idx:
                ctx, cont = pairs[i]
                if not ctx or not cont:
                    raise ValueError("score_tokens: context and continuation must both be non-empty")
                full = (ctx + cont)[-(self.max_length + 1) :]
                seqs.append(full[:-1])
                conts.append(cont[-(len(full) - 1) :] if len(cont) >= len(full) else cont)
            width = max(len(s) for s in seqs)
            inp = torch.zeros(len(seqs), width, dtype=torch.long)
            for j, s in enumerate(seqs):
                inp[j, : len(s)] = torch.tensor(s)
            hidden = llama_hidden(self.model, inp.to(self._device))
            for j, i in enumerate(idx):
                n, c = len(seqs[j]), torch.tensor(conts[j])
                # only the positions that predict the continuation tokens go through the output layer
                lp = torch.log_softmax(output_logits(self.model, hidden[j, n - len(c) : n]), dim=-1).cpu()
                out[i] = (float(lp.gather(1, c[:, None]).sum()), bool((lp.argmax(-1) == c).all()))
        return out  # type: ignore[return-value]

    def split_request(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids ``(ctx, cont)`` of a loglikelihood request (see the module docstring); ``ctx`` starts
        with the EOS prefix."""
        stripped = context.rstrip(" ")
        continuation = context[len(stripped) :] + continuation
        whole = self.tok.encode(stripped + continuation)
        ctx = self.tok.encode(stripped) if stripped else []
        n = 0
        while n < min(len(ctx), len(whole) - 1) and ctx[n] == whole[n]:
            n += 1
        return [self.prefix_id] + whole[:n], whole[n:]

    # -- lm-eval interface -----------------------------------------------------------------------------
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [self.split_request(*r.args) for r in requests]
        res = self.score_tokens(pairs)
        for r, v in zip(requests, res):
            self.cache_hook.add_partial("loglikelihood", r.args, v)
        return res

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for r in requests:
            (text,) = r.args
            ids = self.tok.encode(text)
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(ids, self.prefix_id, self.max_length, context_len=1)
            ]
            total = sum(lp for lp, _ in self.score_tokens(windows)) if windows else 0.0
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests) -> list[str]:
        out = []
        for r in requests:
            context, kwargs = r.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            if (kwargs.get("do_sample") or kwargs.get("temperature", 0.0)) and not self._warned_sampling:
                log.warning("generate_until: sampling was requested; this wrapper decodes greedily")
                self._warned_sampling = True
            text = self.greedy(context, max_new, until)
            self.cache_hook.add_partial("generate_until", (context, r.args[1]), text)
            out.append(text)
        return out

    @torch.no_grad()
    def greedy(self, context: str, max_new_tokens: int, until: Iterable[str] = ()) -> str:
        """Greedy continuation of ``context`` (at most ``max_new_tokens`` tokens), cut at the first
        ``until`` string and stopped at EOS. The context is left-truncated to leave room for the output."""
        until = list(until)
        ctx = self.tok.encode(context) if context else []
        ids = [self.prefix_id] + ctx
        base = self.tok.decode(ctx)
        new: list[int] = []
        text = ""
        for _ in range(max_new_tokens):
            window = (ids + new)[-self.max_length :]
            hidden = llama_hidden(self.model, torch.tensor([window], device=self._device))
            nxt = int(output_logits(self.model, hidden[0, -1]).argmax())
            if nxt == self.prefix_id:
                break
            new.append(nxt)
            # decode with the context: SentencePiece drops the leading space of a string's first piece
            full = self.tok.decode(ctx + new)
            text = full[len(base) :] if full.startswith(base) else self.tok.decode(new)
            hits = [text.find(u) for u in until if u and u in text]
            if hits:
                return text[: min(hits)]
        return text
