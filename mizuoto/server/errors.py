"""The server's error type: an HTTP status, a one-line message and the request field it is about."""

from __future__ import annotations

from collections.abc import Iterable

from mizuoto.errors import (AudioError, DeadlineExceeded, InvalidRequest, MemoryBudgetError, MizuotoError, ModelBusy,
                            ModelLoadError, RequestTooLarge)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 409: "conflict_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error", 507: "insufficient_memory_error"}


class ApiError(Exception):
    """A failure that becomes an HTTP error response with a JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        # a lone surrogate a client sent cannot be encoded in the answer: escaped, never a 500
        self.message = " ".join(str(message).split()).encode("utf-8", "backslashreplace").decode()
        self.param = None if param is None else param.encode("utf-8", "backslashreplace").decode()
        self.headers = headers or {}

    def body(self, hide: Iterable[str] = ()) -> dict:
        """OpenAI-style error body: {"error": {"message", "type", "param", "code"}}, with each of the server's
        paths in `hide` (ServerState.private_paths) replaced in the message: a runtime error may name a directory."""
        message = self.message
        for path in hide:
            message = message.replace(path, "<server path>")
        return {"error": {"message": message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.status}}


def past_deadline() -> ApiError:
    """The 504 of a request that ran past its deadline (--request-timeout)."""
    return ApiError(504, "the request ran past its deadline and was cancelled")


def is_out_of_memory(e: BaseException) -> bool:
    """True for allocation failures of the host or an accelerator."""
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(e, (MemoryError, MemoryBudgetError)) or (bool(oom) and isinstance(e, oom)) \
        or "out of memory" in str(e).lower()


# A runtime error's request field (MizuotoError.field) -> the API's name for it
PARAMS = {"text": "input", "instruct": "instructions", "reference": "ref_audio", "source_audio": "source_audio",
          "voice": "voice", "mode": "voice", "speed": "speed", "stream": "stream_format", "seed": "seed",
          "options": "options"}


def from_exception(e: BaseException, param: str | None = None) -> ApiError:
    """Map a runtime exception to the HTTP error a client should see; its param is `param`, else the error's own field
    (`MizuotoError.field`, in the API's names)."""
    if isinstance(e, ApiError):
        return e
    if param is None and isinstance(e, MizuotoError) and e.field is not None:
        param = PARAMS.get(e.field, e.field)
    if isinstance(e, DeadlineExceeded):
        return past_deadline()
    if isinstance(e, RequestTooLarge):
        return ApiError(413, str(e), param or "input")
    if isinstance(e, ModelBusy):
        return ApiError(409, str(e), param or "model")
    if is_out_of_memory(e):
        return ApiError(507, f"out of memory: {e}" if str(e) else "out of memory while running the request")
    if isinstance(e, (InvalidRequest, AudioError)):
        return ApiError(400, str(e), param)
    if isinstance(e, ModelLoadError):
        return ApiError(400, str(e), param or "model")
    if isinstance(e, MizuotoError):
        return ApiError(500, str(e))
    return ApiError(500, f"internal error ({type(e).__name__}); see the server log")
