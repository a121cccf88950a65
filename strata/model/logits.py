"""Logits processors, batched: each one touches only the rows that ask for it, with tensor ops
whose size is the number of ids involved (prompt and output tokens, biased ids), never a Python
loop over the vocabulary.

Order, as Hugging Face's `generate` applies the processors it shares with us:
logit_bias (HF `SequenceBiasLogitsProcessor` with one-token sequences) -> repetition_penalty
(`RepetitionPenaltyLogitsProcessor`, over prompt and output tokens) -> presence/frequency
penalties (OpenAI's, over output tokens; HF has none) -> the allowed-token mask of a structured
output constraint -> min_tokens (`MinNewTokensLengthLogitsProcessor`: EOS and stop token ids
masked until `min_tokens` tokens exist). The constraint's mask wins over min_tokens: when a
grammar allows only EOS, EOS stays allowed, so an output never leaves its grammar.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from strata.engine.request import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenMask:
    """Tokens that rows of the batch may not sample: `disallowed` (R, vocab) is true there;
    `rows` (long, R) says which rows, None when it covers every row in order."""

    disallowed: Tensor
    rows: Tensor | None = None


def process_logits(logits: Tensor, params: Sequence[SamplingParams],
                   outputs: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]],
                   eos_token_ids: Sequence[Sequence[int]], mask: TokenMask | None = None) -> None:
    """Process float32 `logits` (rows, vocab) in place: no copy of the whole batch."""
    _logit_bias(logits, params)
    _repetition_penalty(logits, params, outputs, prompts)
    _presence_frequency(logits, params, outputs)
    if mask is not None:
        _apply_mask(logits, mask)
    _min_tokens(logits, params, outputs, eos_token_ids)


def _apply_mask(logits: Tensor, mask: TokenMask) -> None:
    if mask.rows is None:
        logits.masked_fill_(mask.disallowed, float("-inf"))
    else:
        logits[mask.rows] = logits[mask.rows].masked_fill_(mask.disallowed, float("-inf"))


def _index(values: list[int], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _logit_bias(logits: Tensor, params: Sequence[SamplingParams]) -> None:
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return
    pairs = [(r, t, b) for r in rows for t, b in params[r].logit_bias]
    device = logits.device
    row_ids, token_ids = _index([p[0] for p in pairs], device), _index([p[1] for p in pairs],
                                                                       device)
    bias = torch.tensor([p[2] for p in pairs], dtype=logits.dtype, device=device)
    logits.index_put_((row_ids, token_ids), bias, accumulate=True)


def _flat_tokens(rows: list[int], seqs: Sequence[Sequence[Sequence[int]]],
                 device: torch.device) -> tuple[Tensor, Tensor]:
    """(position in `rows`, token id) of every token of every listed sequence of each row."""
    parts = [torch.as_tensor(list(s), dtype=torch.long) for r in rows for s in seqs[r]]
    lengths = torch.tensor([sum(len(s) for s in seqs[r]) for r in rows], dtype=torch.long)
    tokens = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
    owners = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    return owners.to(device), tokens.to(device)


def _repetition_penalty(logits: Tensor, params: Sequence[SamplingParams],
                        outputs: Sequence[Sequence[int]],
                        prompts: Sequence[Sequence[int]]) -> None:
    """HF's rule over every token seen (prompt and output): positive logits divided by the
    penalty, negative ones multiplied by it."""
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return
    seqs = [(prompts[i], outputs[i]) for i in range(len(params))]
    owners, tokens = _flat_tokens(rows, seqs, logits.device)
    seen = torch.zeros((len(rows), logits.shape[-1]), dtype=torch.bool, device=logits.device)
    seen[owners, tokens] = True
    index = _index(rows, logits.device)
    penalty = torch.tensor([params[i].repetition_penalty for i in rows], dtype=logits.dtype,
                           device=logits.device)[:, None]
    sub = logits[index]
    penalised = torch.where(sub < 0, sub * penalty, sub / penalty)
    logits[index] = torch.where(seen, penalised, sub)


def _presence_frequency(logits: Tensor, params: Sequence[SamplingParams],
                        outputs: Sequence[Sequence[int]]) -> None:
    """OpenAI's penalties over the generated tokens only: frequency x count + presence."""
    rows = [i for i, p in enumerate(params)
            if (p.presence_penalty or p.frequency_penalty) and outputs[i]]
    if not rows:
        return
    vocab = logits.shape[-1]
    owners, tokens = _flat_tokens(rows, [(o,) for o in outputs], logits.device)
    counts = torch.bincount(owners * vocab + tokens, minlength=len(rows) * vocab)
    counts = counts.view(len(rows), vocab).to(logits.dtype)
    device = logits.device
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=device)
    presence = torch.tensor([params[i].presence_penalty for i in rows], device=device)
    penalty = freq[:, None] * counts + presence[:, None] * (counts > 0)
    index = _index(rows, device)
    logits[index] -= penalty.to(logits.dtype)


def _min_tokens(logits: Tensor, params: Sequence[SamplingParams],
                outputs: Sequence[Sequence[int]], eos: Sequence[Sequence[int]]) -> None:
    """EOS and stop token ids get -inf while a row has fewer than `min_tokens` outputs, unless
    nothing else would be left (a constraint that allows only EOS)."""
    rows = [i for i, p in enumerate(params) if len(outputs[i]) < p.min_tokens]
    blocked = [(r, t) for r, i in enumerate(rows) for t in (*eos[i], *params[i].stop_token_ids)]
    if not blocked:
        return
    device = logits.device
    index = _index(rows, device)
    sub = logits[index]
    held = sub.index_put((_index([b[0] for b in blocked], device),
                          _index([b[1] for b in blocked], device)),
                         torch.tensor(float("-inf"), device=device))
    keeps_some = torch.isfinite(held).any(dim=-1)
    logits[index] = torch.where(keeps_some[:, None], held, sub)


__all__ = ["TokenMask", "process_logits"]
