"""The server's limits: who may ask (an API key), and how much one client may hold.

    RequireApiKey          every route but /health, /metrics and the page's files needs
                           `Authorization: Bearer KEY` (401)
    read_body              application/json only (415), at most N bytes (413, refused before it is
                           read), within T seconds (408); a client that leaves mid-upload is one log line
    H11WithHeadTimeout     uvicorn's h11 protocol with a deadline for each request's line and headers

With uvicorn's keep-alive timeout and its concurrency limit (a 503), these bound what a
client can hold: a connection, a handler, memory, a place in the log. Each limit is a flag
of `nanopaged serve` (serve.py). docs/08_server.md, "Limits and access control".
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanopaged.entrypoints.openai.protocol import OpenAIError

logger = logging.getLogger("nanopaged.entrypoints.serve")
OPEN_PATHS = ("/health", "/metrics")     # probes and scrapers carry no key (vLLM leaves them open too)


@dataclass(frozen=True)
class BodyLimits:
    """How much, and how slowly, a client may send one request body (serve.py has the defaults)."""
    max_bytes: int
    timeout_s: float


class ClientLeft(Exception):
    """The client hung up while sending its body: nobody to answer, nothing was queued."""


# ---- who may ask ------------------------------------------------------------------------------
class RequireApiKey:
    """ASGI middleware: a request for any path but `open_paths` (OPEN_PATHS; app.py adds the page's static
    files, frontend.py) must carry `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`), else it
    is a 401 with OpenAI's error body, before any route (or body) is read."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...] = OPEN_PATHS) -> None:
        self.app, self.open_paths = app, open_paths
        self.key_digest = hashlib.sha256(api_key.encode("utf-8")).digest()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or self.authorized(Headers(scope=scope)):
            await self.app(scope, receive, send)
            return
        error = OpenAIError("a missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                            "(or 'x-api-key: <key>') with the key the server was started with", status=401,
                            code="invalid_api_key")
        await JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(
            scope, receive, send)

    def authorized(self, headers: Headers) -> bool:
        """`Authorization: Bearer KEY` (OpenAI's clients), or `x-api-key: KEY` (Anthropic's)."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        bearer = self.matches(token) and scheme.lower() == "bearer"
        return self.matches(headers.get("x-api-key")) or bearer

    def matches(self, token: str | None) -> bool:
        if token is None:
            return False
        # Digests are all 32 bytes, so compare_digest takes the same time whatever the key's
        # length and wherever a guess first differs: timing tells an attacker nothing.
        digest = hashlib.sha256(token.encode("latin-1")).digest()   # the header's own bytes
        return hmac.compare_digest(digest, self.key_digest)


# ---- how much one request may send -------------------------------------------------------------
async def read_body(request: Request, limits: BodyLimits) -> bytes:
    """A JSON request's whole body, or the error that stops reading it."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        # A browser page may POST text/plain (or no type) to any address without asking first
        # (no CORS preflight); insisting on JSON keeps other sites' pages off this server.
        raise OpenAIError(f"the request body must be sent as Content-Type: application/json, got "
                          f"{media_type or 'no Content-Type'!r}", status=415)
    declared = request.headers.get("content-length")   # h11 has checked that it is a number
    if declared is not None and int(declared) > limits.max_bytes:
        raise _too_large(int(declared), limits.max_bytes)    # refused before a byte of it is read
    try:
        return await asyncio.wait_for(_read_at_most(request, limits.max_bytes), limits.timeout_s)
    except asyncio.TimeoutError:
        raise OpenAIError(f"the request body did not arrive within {limits.timeout_s:g} s "
                          "(--timeout-request-body)", status=408,
                          headers={"Connection": "close"}) from None
    except ClientDisconnect:
        client = request.client
        raise ClientLeft(f"{client.host}:{client.port}" if client else "a client") from None


async def _read_at_most(request: Request, max_bytes: int) -> bytes:
    """The body as it streams in, counted: a chunked upload declares no length up front."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes, so_far=True)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int, so_far: bool = False) -> OpenAIError:
    return OpenAIError(f"the request body is {'over ' if so_far else ''}{size} bytes; at most {max_bytes} "
                       "are accepted (--max-request-body-bytes)", status=413)


def log_client_left(error: ClientLeft) -> None:
    """One line, no traceback: a hang-up is the client's business, and must not flood the log."""
    logger.warning("%s hung up while sending its request body; nothing was queued", error)


# ---- how long a connection may take -----------------------------------------------------------
class H11WithHeadTimeout(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for each request's head (its line and headers).

    uvicorn has none: a client that sends a header byte a minute holds its connection, and a
    file descriptor, for ever. The clock starts when a connection opens and, on a kept-alive
    one, at the first byte after a response (uvicorn's keep-alive timeout covers the silence
    before it); if no new request's head is complete by then, the connection is closed. The
    unread rest of a refused body (a 413) counts against the same clock, so draining it is
    bounded too. `with_head_timeout` makes the class for one server's timeout."""
    head_timeout_s = 10.0
    head_deadline: asyncio.TimerHandle | None = None
    head_of = None                       # the cycle (request) that was current when the clock started

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._start_clock()

    def data_received(self, data: bytes) -> None:
        if self.head_deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._start_clock()          # the first byte after a response
        super().data_received(data)
        if self.head_deadline is not None and self.cycle is not self.head_of:
            self._stop_clock()           # a new request's head is complete

    def connection_lost(self, exc) -> None:
        self._stop_clock()
        super().connection_lost(exc)

    def _start_clock(self) -> None:
        self.head_of = self.cycle
        self.head_deadline = self.loop.call_later(self.head_timeout_s, self._head_too_slow)

    def _stop_clock(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _head_too_slow(self) -> None:
        self.head_deadline = None
        if self.cycle is self.head_of and not self.transport.is_closing():
            self.transport.close()       # quietly, as uvicorn closes an idle keep-alive connection


def with_head_timeout(seconds: float) -> type[H11WithHeadTimeout]:
    """H11WithHeadTimeout for one server (uvicorn makes one protocol object per connection)."""
    return type("H11WithHeadTimeout", (H11WithHeadTimeout,), {"head_timeout_s": seconds})
