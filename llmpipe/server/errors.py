"""OpenAI-shaped error bodies, and the status each kind of failure gets.

Every error is `{"error": {"message", "type", "param", "code"}}`: `param` names the request field at
fault (`messages[0].role`), `code` is a string as OpenAI uses them (or null). Client mistakes are 4xx;
only the server's own faults are 5xx.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from llmpipe.errors import InvalidRequestError, LLMPipeError
from llmpipe.lora.served import AdapterNotFoundError
from llmpipe.server.async_engine import UnavailableError

logger = logging.getLogger(__name__)

# status → (type, default code)
ERROR_KINDS = {
    400: ("invalid_request_error", "invalid_value"),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    500: ("server_error", None),
    503: ("server_error", "service_unavailable"),
}
# pydantic's error types → OpenAI's codes (any other type: "invalid_value")
VALIDATION_CODES = {
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
    "json_invalid": "invalid_json",
}
_TYPE_ERRORS = ("_type", "_parsing", "literal_error", "union_type")


class ModelNotFoundError(LLMPipeError):
    """The request names a model this server does not serve (404, code model_not_found)."""


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind, default_code = ERROR_KINDS.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    return {"error": {"message": message, "type": kind, "param": param, "code": code or default_code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def status_of(err: LLMPipeError) -> int:
    if isinstance(err, AdapterNotFoundError):
        return 404
    if isinstance(err, InvalidRequestError):
        return 400
    if isinstance(err, ModelNotFoundError):
        return 404
    if isinstance(err, UnavailableError):
        return 503
    return 500


def llmpipe_error_body(err: LLMPipeError) -> dict:
    """The body for an error llmpipe raised on purpose (also sent as a stream's error event)."""
    if isinstance(err, AdapterNotFoundError):
        return error_body(404, str(err), err.param, err.code)
    if isinstance(err, InvalidRequestError):
        return error_body(400, str(err), err.param, err.code)
    if isinstance(err, ModelNotFoundError):
        return error_body(404, str(err), "model", "model_not_found")
    return error_body(status_of(err), str(err))


def field_path(loc: tuple) -> str:
    """pydantic's location → OpenAI's param: ('messages', 0, 'role') → 'messages[0].role'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "body":
            path += f".{part}" if path else str(part)
    return path


def validation_body(errors: list[dict]) -> dict:
    """'temperature: Input should be a valid number' — the field and pydantic's rule, OpenAI-shaped."""
    first = errors[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", first["msg"])
        return error_body(400, f"malformed JSON body: {reason}", None, "invalid_json")
    parts = [f"{field_path(e['loc']) or 'body'}: {e['msg']}" for e in errors[:3]]
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return error_body(400, "; ".join(parts) + more, field_path(first["loc"]) or None, _code(first["type"]))


def _code(pydantic_type: str) -> str:
    if pydantic_type in VALIDATION_CODES:
        return VALIDATION_CODES[pydantic_type]
    return "invalid_type" if pydantic_type.endswith(_TYPE_ERRORS) else "invalid_value"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_body(list(err.errors())), status_code=400)

    @app.exception_handler(ValidationError)
    async def _invalid_body(request: Request, err: ValidationError) -> JSONResponse:
        return JSONResponse(validation_body(err.errors(include_url=False)), status_code=400)

    @app.exception_handler(LLMPipeError)
    async def _llmpipe(request: Request, err: LLMPipeError) -> JSONResponse:
        status = status_of(err)
        if status == 500:
            logger.error("request failed: %s", err)
        return JSONResponse(llmpipe_error_body(err), status_code=status)

    @app.exception_handler(RecursionError)
    async def _too_deep(request: Request, err: RecursionError) -> JSONResponse:
        # Bodies are capped in depth before anything recurses over them (input_processor.MAX_JSON_DEPTH),
        # so this is a request nested past some other code's reach: still the request's shape, not a fault.
        logger.warning("a request to %s recursed too deep: %s", request.url.path, err)
        return error_response(400, "the request is nested too deeply to process", code="invalid_value")

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException) -> JSONResponse:
        response = error_response(err.status_code, str(err.detail))
        response.headers.update(err.headers or {})  # 405's Allow (RFC 9110), 401's WWW-Authenticate
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        return error_response(500, f"the server failed this request ({type(err).__name__}); see the server log")
