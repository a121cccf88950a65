"""One exception tree for Strata; every exception class of `strata/` is defined here.

    StrataError
    ├── ConfigError                     a configuration value is invalid (says what to change)
    ├── ModelLoadError                  a model file is missing or malformed (names file, field)
    │   ├── LoraError                   a LoRA adapter that does not fit the base (names it)
    │   └── ModelFetchError             the default model could not be downloaded
    ├── KVPayloadError                  a KV payload is not KV of the loaded model (or damaged)
    ├── RequestError                    the caller's mistake; maps to a 4xx
    │   ├── InvalidRequestError         400: a parameter is invalid or out of limits
    │   │   └── ContextLengthError      400: prompt (+ max_tokens) longer than the context
    │   ├── NotFoundError               404: what the request names does not exist
    │   │   ├── ModelNotFoundError      404: unknown model name (or version, or release)
    │   │   └── SessionNotFoundError    404: no such session for this tenant
    │   └── PayloadTooLargeError        413: body larger than the configured cap
    ├── ConflictError                   409: a compare-and-set lost (the record moved on)
    │   ├── KVPoolFullError             a prefill instance's shared-memory pool is full
    │   ├── SessionConflictError        another turn of the session was stored first
    │   └── ReleaseSupersededError      the stored release changed under its driver
    ├── StoreUnavailableError           503: a backing store cannot be reached or failed
    │   ├── SessionStoreUnavailableError    the session store
    │   ├── KVStoreUnavailableError     the KV block store (a miss for the caller)
    │   ├── PinStoreError               the session pin table
    │   ├── ResponseCacheError          the response cache
    │   ├── UsageStoreError             the usage and token-budget store
    │   └── RegistryError               the instance registry (or an unknown instance)
    ├── OverloadedError                 429/503: the waiting queue is full (carries retry_after_s)
    ├── EngineDeadError                 the engine loop died; the instance is unhealthy
    ├── RankFailedError                 a parallel rank died or a collective timed out: fatal,
    │                                   the instance restarts whole (its ranks no longer agree)
    ├── ShareFailedError                a rank could not run its share of one parallel step; the
    │                                   ranks still agree: the request at fault fails alone
    ├── RequestFailedError              500: the executor failed on this request alone
    ├── DeadlineExceededError           504: the request's own deadline passed; it was aborted
    └── ChatError                       `strata chat`: the server refused or is unreachable

Each HTTP-facing class says how it is answered (`status_code`, OpenAI `error_type`, and
`code`: OpenAI's short machine-readable string, or None); `strata.protocol.errors` turns any
exception into the one OpenAI error body. Expected per-request outcomes (abort, stop, length)
are data, not exceptions.
"""

from __future__ import annotations

from typing import Any


class StrataError(Exception):
    """Base class of every Strata error."""

    status_code = 500
    error_type = "internal_server_error"
    code: str | None = None


class ConfigError(StrataError, ValueError):
    """A configuration value is invalid."""


class ModelLoadError(StrataError):
    """A model file is missing or malformed."""


class LoraError(ModelLoadError):
    """A LoRA adapter that cannot be applied to the base model (the message names it)."""


class ModelFetchError(ModelLoadError):
    """The default model could not be fetched."""


class KVPayloadError(StrataError, ValueError):
    """A payload that is not KV of the loaded model (or is damaged); treated as a miss."""


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

    code = "context_length_exceeded"


class NotFoundError(RequestError):
    """What the request names does not exist."""

    status_code = 404
    error_type = "not_found_error"


class ModelNotFoundError(NotFoundError):
    """An unknown model name, version or release."""

    code = "model_not_found"


class SessionNotFoundError(NotFoundError):
    """No session with this id for this tenant (unknown, deleted or expired)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} does not exist (unknown, deleted or expired); "
                         "start it again with a first turn")
        self.session_id = session_id


class PayloadTooLargeError(RequestError):
    status_code = 413


class ConflictError(StrataError):
    """A compare-and-set lost: the record changed since it was read (or already exists)."""

    status_code = 409
    error_type = "conflict_error"


class KVPoolFullError(ConflictError):
    """A prefill instance's shared-memory KV pool cannot take a pull's blocks now (too few free
    slots, a payload larger than a slot, or no pool): the decode instance pulls the stream."""

    error_type = "kv_pool_full"


class SessionConflictError(ConflictError):
    """The session's revision is not the one the writer read; re-read and retry."""

    error_type = "session_conflict"

    def __init__(self, session_id: str, *, expected_revision: int, actual_revision: int) -> None:
        super().__init__(
            f"session {session_id!r} is at revision {actual_revision}, not {expected_revision}: "
            "another turn was stored first; read the session again and retry")
        self.session_id = session_id
        self.expected_revision = expected_revision
        self.actual_revision = actual_revision


class ReleaseSupersededError(ConflictError):
    """The stored release is no longer the one its driver read (a CAS lost, or a poll saw a
    newer revision); `release` is the stored record (a `strata.registry.models.Release`)."""

    def __init__(self, release: Any) -> None:
        super().__init__(f"release {release.release_id} changed: now {release.state}, "
                         f"owner {release.owner!r}")
        self.release = release


class StoreUnavailableError(StrataError):
    """A backing store (sessions, KV, pins, response cache, registry) failed."""

    status_code = 503
    error_type = "service_unavailable_error"


class SessionStoreUnavailableError(StoreUnavailableError):
    """The backend of the session store failed (connection lost, disk error)."""


class KVStoreUnavailableError(StoreUnavailableError):
    """The KV store cannot be reached; the caller treats it as a miss (fetch) or a skip (put)."""


class PinStoreError(StoreUnavailableError):
    """The pin store could not be reached or answered an error."""


class ResponseCacheError(StoreUnavailableError):
    """The response cache's backend could not be reached or answered an error."""


class UsageStoreError(StoreUnavailableError):
    """The usage store (tenants' counts and token budgets) could not be reached or failed."""


class RegistryError(StoreUnavailableError):
    """An instance is unknown to the registry, or the registry backend failed."""


class OverloadedError(StrataError):
    """The instance cannot take more work now."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0, status_code: int = 429) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.status_code = status_code
        self.error_type = "overloaded_error" if status_code == 429 else "service_unavailable_error"


class EngineDeadError(StrataError):
    """The engine loop has stopped after an internal failure."""

    status_code = 503
    error_type = "service_unavailable_error"


class RankFailedError(StrataError):
    """A rank of a tensor- or pipeline-parallel instance died, or a collective timed out.

    `rank` is the rank blamed (-1 when unknown). Fatal: the ranks no longer agree on where they
    are, so the instance stops and its launcher restarts it whole."""

    def __init__(self, message: str, *, rank: int = -1) -> None:
        super().__init__(message)
        self.rank = rank


class ShareFailedError(StrataError):
    """A rank of a tensor-parallel instance could not run its share of one step, and made the
    collectives it still owed on a placeholder, so the ranks still agree on where they are. The
    step's results are void; the engine runs its sequences again in halves
    (strata/engine/isolation.py) until the one at fault fails alone. `ranks` are the ranks that
    could not run their share."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


class RequestFailedError(StrataError):
    """The executor failed on this request's sequence alone (strata/engine/isolation.py); the
    request ended with finish_reason "error" and the instance goes on."""

    status_code = 500
    error_type = "internal_server_error"


class DeadlineExceededError(StrataError):
    """The request's deadline (`X-Strata-Timeout-S` or the body's `timeout`) passed before its
    answer was whole; its engine requests were aborted. 504, as gRPC maps DEADLINE_EXCEEDED: the
    server gave up waiting on the work, not on the client (408); never retried (the
    `x-should-retry: false` header tells the openai client so: a retry would miss it again)."""

    status_code = 504
    error_type = "timeout_error"
    code = "deadline_exceeded"


class ChatError(StrataError):
    """`strata chat`: the server refused a message or could not be reached; says why."""


__all__ = [
    "ChatError",
    "ConfigError",
    "ConflictError",
    "LoraError",
    "ContextLengthError",
    "DeadlineExceededError",
    "EngineDeadError",
    "InvalidRequestError",
    "KVPayloadError",
    "KVPoolFullError",
    "KVStoreUnavailableError",
    "ModelFetchError",
    "ModelLoadError",
    "ModelNotFoundError",
    "NotFoundError",
    "OverloadedError",
    "PayloadTooLargeError",
    "PinStoreError",
    "RankFailedError",
    "RegistryError",
    "ReleaseSupersededError",
    "RequestError",
    "RequestFailedError",
    "ResponseCacheError",
    "SessionConflictError",
    "SessionNotFoundError",
    "SessionStoreUnavailableError",
    "ShareFailedError",
    "StoreUnavailableError",
    "StrataError",
    "UsageStoreError",
]
