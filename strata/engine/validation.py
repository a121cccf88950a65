"""What the engine refuses before a request is queued: requests that can never run (an empty
prompt, token ids outside the vocabulary, more tokens than the context or the whole KV cache)
a resumed request whose tokens already end it, and, while the waiting queue is full, any
request."""

from __future__ import annotations

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.request import Request
from strata.errors import ContextLengthError, InvalidRequestError, OverloadedError


def check_request(request: Request, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                  vocab_size: int | None, *, num_waiting: int) -> None:
    """Raise the error the caller should see for `request`; return if it may be queued."""
    num_prompt = request.num_prompt_tokens
    max_len = scheduler_config.max_model_len
    if num_prompt == 0:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if vocab_size is not None and not all(
        0 <= t < vocab_size for t in request.prompt_token_ids
    ):
        raise InvalidRequestError(
            f"prompt token ids must be in [0, {vocab_size})", param="prompt"
        )
    if vocab_size is not None and not all(
        0 <= t < vocab_size for t, _ in request.sampling_params.logit_bias
    ):
        raise InvalidRequestError(
            f"logit_bias token ids must be in [0, {vocab_size})", param="logit_bias"
        )
    if request.is_pooling:
        _check_pooled(request, cache_config, max_len, scheduler_config.max_num_batched_tokens)
    elif num_prompt >= max_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_len} tokens, but the prompt has "
            f"{num_prompt} tokens (leave room for at least one generated token)",
            param="messages",
        )
    if not request.is_pooling and num_prompt + request.sampling_params.max_tokens > max_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_len} tokens; the prompt has "
            f"{num_prompt} tokens and max_tokens is {request.sampling_params.max_tokens} "
            f"({num_prompt + request.sampling_params.max_tokens} in total). Lower max_tokens "
            "or shorten the prompt.",
            param="max_tokens",
        )
    if request.output_token_ids:
        _check_resumed(request, vocab_size)
    num_blocks_needed = -(-(request.num_tokens + 1) // cache_config.block_size)
    if num_blocks_needed > cache_config.num_blocks:
        raise ContextLengthError(
            f"the prompt needs {num_blocks_needed} KV blocks but the cache holds only "
            f"{cache_config.num_blocks}; raise --kv-cache-gb",
            param="prompt",
        )
    if num_waiting >= scheduler_config.max_waiting:
        raise OverloadedError(
            f"the waiting queue is full ({scheduler_config.max_waiting} requests)"
        )

def _check_pooled(request: Request, cache_config: CacheConfig, max_len: int,
                  max_step_tokens: int) -> None:
    """A pooling request reads its whole input in one step: it fits the model's positions and
    a step's token budget, and no prefix hit may skip part of it."""
    if request.num_prompt_tokens > min(max_len, max_step_tokens):
        what = "maximum input length" if max_len <= max_step_tokens else "step token budget"
        raise ContextLengthError(
            f"This model's {what} is {min(max_len, max_step_tokens)} tokens, but the input has "
            f"{request.num_prompt_tokens} tokens", param="input")
    if cache_config.enable_prefix_caching:
        raise InvalidRequestError("a pooling request needs an engine without prefix caching",
                                  param="input")


def _check_resumed(request: Request, vocab_size: int | None) -> None:
    """A resumed request (tokens generated elsewhere) must be one that had not finished."""
    params, outputs = request.sampling_params, request.output_token_ids
    if vocab_size is not None and not all(0 <= t < vocab_size for t in outputs):
        raise InvalidRequestError(
            f"output token ids must be in [0, {vocab_size})", param="output_token_ids")
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos
                                          else set(request.eos_token_ids))
    if len(outputs) >= params.max_tokens or any(t in stops for t in outputs):
        raise InvalidRequestError("the generated tokens of a resumed request already end "
                                  "it (max_tokens or a stop token)", param="output_token_ids")


__all__ = ["check_request"]
