"""Batched next-token sampling in torch.

Order of operations per row: the logits processors of `logits.py` (logit_bias, repetition,
presence and frequency penalties, a constraint's allowed tokens, min_tokens) -> greedy argmax
when temperature is 0, else temperature -> top-k -> top-p -> draw. Logprobs are always those of
the raw model logits, before processors and temperature.

Reproducibility: a seeded row draws its noise from a generator seeded with a mix of (seed, number
of tokens generated so far) and nothing else, so its tokens do not depend on its batch neighbours
and survive preemption. Unseeded rows share one generator.
"""

from __future__ import annotations

import torch
from torch import Tensor

from strata.engine.executor import SampledToken
from strata.engine.request import Logprob, SamplingParams
from strata.model.logits import TokenMask, process_logits

_MASK63 = (1 << 63) - 1


def seed_for_step(seed: int, num_generated: int) -> int:
    """A 63-bit generator seed that depends only on (seed, num_generated)."""
    x = (seed * 0x9E3779B97F4A7C15 + num_generated * 0xBF58476D1CE4E5B9 + 1) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 29)) & _MASK63


class Sampler:
    """Picks one token per row of a (rows, vocab) logits tensor."""

    def __init__(self, device: str = "cpu", seed: int | None = None) -> None:
        self.device = device
        self._generator = torch.Generator(device=device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def sample(self, logits: Tensor, params: list[SamplingParams],
               output_token_ids: list[list[int]], *,
               prompt_token_ids: list[list[int]] | None = None,
               eos_token_ids: list[tuple[int, ...]] | None = None,
               mask: TokenMask | None = None,
               may_modify_logits: bool = False) -> list[SampledToken]:
        """One `SampledToken` per row; `output_token_ids[i]` are row i's generated tokens,
        `prompt_token_ids[i]` its prompt (repetition penalty), `eos_token_ids[i]` what
        min_tokens holds back besides its stop token ids; `mask` the constraints' masks.
        With `may_modify_logits` the processors work on `logits` itself, not on a copy."""
        logits = logits.float()
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = logits[torch.tensor(lp_rows, device=logits.device)] if lp_rows else None
        if mask is None and all(p.is_greedy and not p.has_processors for p in params):
            token_ids = logits.argmax(dim=-1)
        else:
            no_ids: list[list[int]] = [[] for _ in params]
            if not may_modify_logits:
                logits = logits.clone()
            process_logits(logits, params, output_token_ids, prompt_token_ids or no_ids,
                           eos_token_ids or no_ids, mask)
            token_ids = self._choose(logits, params, output_token_ids)
        logprobs = _logprobs(raw, lp_rows, token_ids, params)
        return [SampledToken(t, lp) for t, lp in zip(token_ids.tolist(), logprobs, strict=True)]

    def _choose(self, logits: Tensor, params: list[SamplingParams],
                outputs: list[list[int]]) -> Tensor:
        token_ids = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not rows:
            return token_ids
        index = torch.tensor(rows, device=logits.device)
        picked = [params[i] for i in rows]
        temps = torch.tensor([p.temperature for p in picked], device=logits.device)
        scaled = _filter_top_k_top_p(logits[index] / temps[:, None], picked)
        probs = scaled.softmax(dim=-1)
        noise = self._exponential_noise(probs, picked, [len(outputs[i]) for i in rows])
        token_ids[index] = (probs / noise).argmax(dim=-1)
        return token_ids

    def _exponential_noise(self, probs: Tensor, params: list[SamplingParams],
                           num_generated: list[int]) -> Tensor:
        # argmax(p / q) with q ~ Exp(1) draws from p (the exponential race).
        noise = torch.empty_like(probs).exponential_(generator=self._generator)
        for row, (p, n) in enumerate(zip(params, num_generated, strict=True)):
            if p.seed is not None:
                gen = torch.Generator(device=probs.device).manual_seed(seed_for_step(p.seed, n))
                noise[row].exponential_(generator=gen)
        return noise.clamp_min_(1e-20)


def _filter_top_k_top_p(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """Set to -inf what top-k (0 or -1 = off), then top-p over what remains, excludes."""
    if all(p.top_k <= 0 and p.top_p >= 1.0 for p in params):
        return logits
    vocab = logits.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    # top_p == 1 keeps all: 2.0 is out of reach even with cumsum rounding above 1.
    ps = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]
    top_k = torch.tensor(ks, device=logits.device)
    top_p = torch.tensor(ps, device=logits.device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # the first token always stays
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _logprobs(raw: Tensor | None, rows: list[int], token_ids: Tensor,
              params: list[SamplingParams]) -> list[Logprob | None]:
    """`raw`: the unprocessed logits of `rows`, the rows that asked for logprobs."""
    result: list[Logprob | None] = [None] * len(params)
    if raw is None:
        return result
    index = torch.tensor(rows, device=raw.device)
    log_probs = torch.log_softmax(raw, dim=-1)
    chosen_ids = token_ids[index]
    chosen = log_probs.gather(1, chosen_ids[:, None])[:, 0].tolist()
    chosen_list = chosen_ids.tolist()
    max_top = min(max(params[i].logprobs or 0 for i in rows), raw.shape[-1])
    top_values, top_ids = log_probs.topk(max_top, dim=-1)
    values, ids = top_values.tolist(), top_ids.tolist()
    for r, i in enumerate(rows):
        n = params[i].logprobs or 0
        top = list(zip(ids[r][:n], values[r][:n], strict=True))
        result[i] = Logprob(chosen_list[r], chosen[r], top)
    return result
