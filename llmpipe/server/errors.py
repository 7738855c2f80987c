"""OpenAI-style error bodies, and the status each kind of failure gets.

Client mistakes are 4xx with a message that names the field; only the server's own faults are 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from llmpipe.errors import InvalidRequestError, LLMPipeError
from llmpipe.server.async_engine import UnavailableError

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


class ModelNotFoundError(LLMPipeError):
    pass


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def status_of(err: LLMPipeError) -> int:
    if isinstance(err, InvalidRequestError):
        return 400
    if isinstance(err, ModelNotFoundError):
        return 404
    if isinstance(err, UnavailableError):
        return 503
    return 500


def validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """'temperature: Input should be a valid number' — the field path and pydantic's rule."""
    errors = err.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return f"malformed JSON body: {errors[0].get('ctx', {}).get('error', errors[0]['msg'])}", None
    parts, first = [], None
    for e in errors[:3]:
        path = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        first = first or path or None
        parts.append(f"{path or 'body'}: {e['msg']}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more, first


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = validation_message(err)
        return error_response(400, message, param)

    @app.exception_handler(LLMPipeError)
    async def _llmpipe(request: Request, err: LLMPipeError) -> JSONResponse:
        status = status_of(err)
        if status == 500:
            logger.error("request failed: %s", err)
        return error_response(status, str(err))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail))

