"""One exception tree for Strata.

    StrataError
    ├── ConfigError                 a configuration value is invalid (says what to change)
    ├── ModelLoadError              a model file is missing or malformed (names file, field)
    │   └── ModelFetchError         the default model could not be downloaded
    ├── RequestError                the caller's mistake; maps to a 4xx
    │   ├── InvalidRequestError     400: a parameter is invalid or out of limits
    │   │   └── ContextLengthError  400: prompt (+ max_tokens) longer than the context
    │   ├── ModelNotFoundError      404: unknown model name
    │   └── PayloadTooLargeError    413: body larger than the configured cap
    ├── OverloadedError             429/503: the waiting queue is full (carries retry_after_s)
    ├── EngineDeadError             the engine loop died; the instance is unhealthy
    └── RankFailedError             a parallel rank died or a collective timed out; the
                                    instance must restart (its ranks no longer agree)

Expected per-request outcomes (abort, stop, length) are data, not exceptions.
"""

from __future__ import annotations


class StrataError(Exception):
    """Base class of every Strata error."""


class ConfigError(StrataError, ValueError):
    """A configuration value is invalid."""


class ModelLoadError(StrataError):
    """A model file is missing or malformed."""


class ModelFetchError(ModelLoadError):
    """The default model could not be fetched."""


class RequestError(StrataError):
    """A request is invalid; the caller can fix it."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(RequestError, ValueError):
    """A parameter is invalid or beyond a configured limit."""


class ContextLengthError(InvalidRequestError):
    """The prompt, or prompt plus max_tokens, does not fit in the context."""


class ModelNotFoundError(RequestError):
    status_code = 404
    error_type = "not_found_error"


class PayloadTooLargeError(RequestError):
    status_code = 413
    error_type = "invalid_request_error"


class OverloadedError(StrataError):
    """The instance cannot take more work now."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0, status_code: int = 429) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.status_code = status_code


class EngineDeadError(StrataError):
    """The engine loop has stopped after an internal failure."""


class RankFailedError(StrataError):
    """A rank of a tensor- or pipeline-parallel instance died, or a collective timed out.

    `rank` is the rank blamed (-1 when unknown). Fatal: the ranks no longer agree on where they
    are, so the instance stops and its launcher restarts it whole."""

    def __init__(self, message: str, *, rank: int = -1) -> None:
        super().__init__(message)
        self.rank = rank


__all__ = [
    "ConfigError",
    "ContextLengthError",
    "EngineDeadError",
    "InvalidRequestError",
    "ModelFetchError",
    "ModelLoadError",
    "ModelNotFoundError",
    "OverloadedError",
    "PayloadTooLargeError",
    "RankFailedError",
    "RequestError",
    "StrataError",
]
