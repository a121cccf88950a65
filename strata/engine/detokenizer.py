"""Incremental detokenization and stop conditions.

Text is released only when it is final: never in the middle of a multi-byte character, and
never a tail that could still grow into a stop string (held back until decided).

A resumed request (one that arrives with tokens generated elsewhere, `Request.output_token_ids`,
see strata/gateway/upstream/resume.py) is replayed token by token through the same steps, so the
text already released and the text held back are exactly what the first engine had: a stop string
that straddles the hand-over is found, and no character is sent twice or lost.
"""

from __future__ import annotations

from strata.engine.executor import TokenDecoder
from strata.engine.request import Request, RequestStatus

_PROMPT_CONTEXT_TOKENS = 5  # earlier tokens decoded alongside, for tokenizers with leading spaces


class IncrementalDetokenizer:
    def __init__(self, decoder: TokenDecoder, request: Request) -> None:
        self._decoder = decoder
        self._stops = request.sampling_params.stop
        self._holdback = max((len(s) for s in self._stops), default=1) - 1
        self._tokens = request.prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""
        self.matched_stop: str | None = None
        self._num_emitted = 0
        self._searched = 0  # text before this offset is never searched for stop strings
        min_tokens = request.sampling_params.min_tokens
        for i, token_id in enumerate(request.output_token_ids):  # resumed: replay what was sent
            if self.add_token(token_id, match_stops=i + 1 >= min_tokens) is not None:
                break
            self.take_new_text(finished=False)

    def add_token(self, token_id: int, *, match_stops: bool = True) -> str | None:
        """Append a token; returns the stop string if the text now contains one (text added
        while `match_stops` is false is never searched: min_tokens)."""
        self._tokens.append(token_id)
        prefix = self._decoder.decode(self._tokens[self._prefix_offset : self._read_offset])
        full = self._decoder.decode(self._tokens[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        search_from = max(len(self.text) - self._holdback, 0)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        if not match_stops:
            self._searched = len(self.text)
            return None
        return self._find_stop(max(search_from, self._searched))

    def _find_stop(self, search_from: int) -> str | None:
        for stop in self._stops:
            idx = self.text.find(stop, search_from)
            if idx >= 0:
                self.text = self.text[:idx]
                self.matched_stop = stop
                return stop
        return None

    @property
    def released(self) -> str:
        """The text `take_new_text` has returned so far."""
        return self.text[: self._num_emitted]

    def flush(self) -> None:
        """At the end, release a trailing partial character as the replacement char."""
        tail = self._decoder.decode(self._tokens[self._prefix_offset :])
        prefix = self._decoder.decode(self._tokens[self._prefix_offset : self._read_offset])
        if len(tail) > len(prefix):
            self.text += tail[len(prefix) :]
            self._prefix_offset = self._read_offset = len(self._tokens)

    def take_new_text(self, finished: bool) -> str:
        """The text that became final since the last call."""
        end = len(self.text) if finished else max(len(self.text) - self._holdback, 0)
        if end <= self._num_emitted:
            return ""
        new = self.text[self._num_emitted : end]
        self._num_emitted = end
        return new


def released_text(decoder: TokenDecoder, request: Request) -> str:
    """The text a stream has released for `request.output_token_ids` (the tokens a resumed
    request arrives with): what the engine that generated them sent, token by token."""
    return IncrementalDetokenizer(decoder, request).released


def final_text(decoder: TokenDecoder, request: Request, *, stopped_by_token: bool) -> str:
    """The whole text of a request that finished with `request.output_token_ids`: a stop token's
    text (EOS, `stop_token_ids`) is not shown, a stop string cuts the text, the last partial
    character is flushed."""
    token_ids = request.output_token_ids
    detok = IncrementalDetokenizer(decoder, _without_outputs(request))
    for token_id in token_ids[:-1] if stopped_by_token else token_ids:
        if detok.add_token(token_id) is not None:
            return detok.text
    detok.flush()
    return detok.text


def _without_outputs(request: Request) -> Request:
    return Request(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                   sampling_params=request.sampling_params)


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """Token-level stop conditions, checked after the token was appended."""
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return _length_stop(request, max_model_len)
    if not params.ignore_eos and token_id in request.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if token_id in params.stop_token_ids:
        request.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED
    return _length_stop(request, max_model_len)


def _length_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    if (request.num_output_tokens >= request.sampling_params.max_tokens
            or request.num_tokens >= max_model_len):
        return RequestStatus.FINISHED_LENGTH
    return None
