"""HTTP errors in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``.

Owns the mapping from every failure the server can see to a status code: bad input of any kind (body
that is not JSON or not UTF-8, wrong types, out-of-range values, unknown model, prompt too long) is a 400,
a missing or wrong API key a 401, an unknown route or model a 404, a body over the size limit a 413, a
full queue a 429 (with ``Retry-After``), an engine that is gone a 503 ``engine_unavailable``. A 500 means
a bug in the server and is still answered in the same format.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("flashinfra.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable"}


class APIError(Exception):
    """An error answered to the client as-is (status, message, offending parameter)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code if code is not None else str(status)}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _describe_validation(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic/FastAPI errors -> one readable message and the first offending parameter."""
    parts, param = [], None
    for err in errors[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        where = ".".join(loc) or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    if len(errors) > 5:
        parts.append(f"... and {len(errors) - 5} more")
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response(400, "request body is not valid JSON")
        message, param = _describe_validation(list(errors))
        return error_response(400, message, param)

    @app.exception_handler(ValidationError)
    async def _model_validation(request: Request, exc: ValidationError):
        message, param = _describe_validation(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        # FastAPI answers a body it cannot decode (e.g. invalid UTF-8) with a bare HTTPException(400).
        message = exc.detail if isinstance(exc.detail, str) else "invalid request"
        if status == 400 and message == "There was an error parsing the body":
            message = "request body could not be parsed (it must be UTF-8 encoded JSON)"
        return error_response(status, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}")
