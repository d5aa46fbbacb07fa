"""Errors the router reports to clients, each with its HTTP status and OpenAI error type.

::

    RouterError
    ├── InvalidRequestError        400 invalid_request_error (names the field in ``param``)
    │   └── ContextLengthError     400 (prompt + max_tokens over the model's limit)
    ├── PriorityNotAllowedError    403 permission_error (the API key may not ask for it)
    ├── ModelNotFoundError         404 not_found_error
    ├── TooManyRequestsError       429 rate_limit_error
    ├── ServiceUnavailableError    503 service_unavailable (with Retry-After)
    │   ├── NoEngineError          no live engine serves the model
    │   └── TokenizerUnavailableError
    └── EngineFailedError          an engine failed the request after it was admitted

They map onto HTTP only in ``api/app.py``; the rest of the router raises them as values.
"""

from __future__ import annotations

from typing import Any


class RouterError(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequestError(RouterError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    def __init__(self, prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens, but the request asks for "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
            "completion). Please shorten the prompt or lower max_tokens.",
            param="max_tokens" if prompt_tokens < max_model_len else "messages",
            code="context_length_exceeded",
        )


class PriorityNotAllowedError(RouterError):
    status_code = 403
    error_type = "permission_error"

    def __init__(self, key: str, asked: int, allowed: int) -> None:
        super().__init__(
            f"API key {key!r} may not ask for priority {asked}: its most urgent is {allowed} "
            "(lower is more urgent; a key's line in the keys file grants it with priority=-N)",
            param="priority",
            code="priority_not_allowed",
        )


class ModelNotFoundError(RouterError):
    status_code = 404
    error_type = "not_found_error"

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__(
            f"The model {model!r} does not exist. Served models: {', '.join(served) or 'none'}.",
            param="model",
            code="model_not_found",
        )


class TooManyRequestsError(RouterError):
    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, code: str, retry_after_s: int | None = None) -> None:
        super().__init__(message, code=code)
        # Seconds the client should wait (the ``Retry-After`` header); None: the router's default.
        self.retry_after_s = retry_after_s


class ServiceUnavailableError(RouterError):
    status_code = 503
    error_type = "service_unavailable"
    retry_after_s = 1


class NoEngineError(ServiceUnavailableError):
    def __init__(self, model: str) -> None:
        super().__init__(f"No engine is serving model {model!r} right now; retry later.", code="no_engine")


class TokenizerUnavailableError(ServiceUnavailableError):
    pass


class EngineFailedError(RouterError):
    """An engine ended a request with an error; ``code`` is the engine's error code."""

    status_code = 502
    error_type = "engine_error"
