"""Errors as OpenAI shapes them: `{"error": {"message", "type", "param", "code"}}` with the HTTP status."""
from __future__ import annotations

from starlette.responses import JSONResponse

from ..protocol import clean_error

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 408: "timeout", 409: "invalid_request_error", 413: "invalid_request_error",
         503: "server_error", 504: "timeout"}


class APIError(Exception):
    """A request that gets an error answer: its status, one-line message, and OpenAI's `param` and `code`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        return error_body(self.status, str(self), self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": clean_error(message), "type": TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def invalid(message: str, param: str | None = None) -> APIError:
    """400: the request is wrong, as `message` says."""
    return APIError(400, message, param=param)


def not_found(kind: str, object_id: str) -> APIError:
    return APIError(404, f"no {kind} {object_id!r}", code="not_found")
