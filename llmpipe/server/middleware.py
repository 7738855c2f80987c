"""ASGI guards that run before routing: the body's size and time limits (413, 408) and the API key (401).
Their errors have OpenAI's shape, or Anthropic's on the Messages API's paths."""

from __future__ import annotations

import asyncio
import hmac

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmpipe.server import anthropic
from llmpipe.server.errors import error_response

# Paths that need no API key: the liveness probe and the playground page (which asks for the key).
# The API description (/openapi.json, /docs) needs it like every API route.
OPEN_PATHS = frozenset({"/health", "/"})


def refusal(scope: Scope, status: int, message: str) -> Response:
    if scope["path"].startswith(anthropic.PATH):
        return anthropic.error_response(status, message)
    return error_response(status, message)


class BodyLimit:
    """Reads the whole body up front (refusing one over max_bytes, or one that has not all arrived
    within timeout seconds), then replays it to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit():
            return await refusal(scope, 400, "Content-Length must be a number of bytes")(scope, receive, send)
        if int(length) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        body, more = bytearray(), True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                message = f"the request body did not arrive within {self.timeout:g} s"
                return await refusal(scope, 408, message)(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._too_large(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect notice
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body is over the limit of {self.max_bytes} bytes"
        await refusal(scope, 413, message)(scope, receive, send)


class ApiKey:
    """The key check, in constant time, on every path but OPEN_PATHS: OpenAI's `Authorization: Bearer <key>`
    header or Anthropic's `x-api-key: <key>`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.bearer = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
            key = hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)
            if not (bearer or key):
                message = "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
                return await refusal(scope, 401, message)(scope, receive, send)
        await self.app(scope, receive, send)
