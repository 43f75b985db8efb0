"""Typed exceptions for everything a user or operator can cause.

Raised anywhere; mapped to an HTTP status and OpenAI error type at the server edge
(`http_status`, `error_type`), or to a one-line message on the CLI. Internal invariants
use asserts instead.
"""

from __future__ import annotations


class PagodaError(Exception):
    """Base class. `param` names the offending field when there is one."""

    http_status = 500
    error_type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class ConfigError(PagodaError, ValueError):
    """A bad engine/server setting: the message names the knob to change."""

    http_status = 500
    error_type = "ConfigError"


class ModelLoadError(ConfigError):
    """The model folder or file cannot be loaded (missing shard, unknown architecture...)."""


class InvalidRequest(PagodaError, ValueError):
    """A request or sampling parameter is out of range or malformed."""

    http_status = 400
    error_type = "BadRequestError"


class ContextLengthExceeded(InvalidRequest):
    """prompt + max_tokens does not fit in max_model_len."""


class EngineDead(PagodaError):
    """The engine loop has died; no request can be served."""

    http_status = 503
    error_type = "ServiceUnavailableError"


class ModelNotFound(InvalidRequest):
    """The request names a model this server does not serve."""

    http_status = 404
    error_type = "NotFoundError"


class Unauthorized(PagodaError):
    http_status = 401
    error_type = "AuthenticationError"


class Overloaded(PagodaError):
    """Too many requests are waiting; the client should retry later (503 + Retry-After)."""

    http_status = 503
    error_type = "ServiceUnavailableError"


class ShuttingDown(PagodaError):
    """The server is stopping and `--shutdown-timeout` ran out before this request finished (503 +
    Retry-After: another replica, or this one restarted, can serve it)."""

    http_status = 503
    error_type = "ServiceUnavailableError"


class RequestFailed(PagodaError):
    """The engine hit an error while processing this one request (finish_reason "error"); the
    engine and every other request carry on."""

    http_status = 500
    error_type = "InternalServerError"
