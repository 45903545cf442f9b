"""What lets the chat server face a network: the API key, origin checks, per-address caps, deadlines on slow
clients, and the uvicorn protocol settings behind them. app.py wires them in front of every route.

Why each check exists. Any web page the user visits can (1) open a WebSocket to 127.0.0.1 and read the replies
(browsers send the page's Origin but enforce nothing on sockets), (2) send a cross-site POST with a text/plain body,
which needs no CORS preflight, and (3) point its own DNS name at 127.0.0.1 (DNS rebinding), after which its
requests carry its own name as Host. So: a WebSocket or API request whose Origin is neither the page's own nor
loopback nor allowed is refused (403, before accept); an API POST must say Content-Type: application/json, which a
cross-site page cannot send without a preflight this server never answers (415); and Host must be an allowed name
(Starlette's TrustedHostMiddleware, 400). With ServeConfig.api_key, the API needs `Authorization: Bearer KEY` (401)
and a WebSocket sends the key in its first frame (websocket.py), or in that same header from a non-browser client.
"API" is every HTTP route but the page and /health (and the docs, when served): a route added later is guarded
without anyone remembering to.

Clients that hold resources: each address may hold max_connections_per_client requests and WebSockets at once
(ChatServer's max_connections is the cap for everyone together, and a body still arriving does not hold one of
those); a request body must arrive within body_timeout (408) and a request's headers within header_timeout
(HeaderDeadlineH11: uvicorn has no header deadline of its own, so a socket that never finishes its headers stays
open forever); every refused request costs its address rate_min_cost tokens of its rate limit.

Loopback addresses skip the per-address cap and the rate limit unless ServeConfig.limit_loopback. Behind a proxy
every client arrives from the proxy's address; X-Forwarded-For names the real one, but anyone can send that header,
so it is read only from the proxies in ServeConfig.forwarded_allow_ips (uvicorn's own handling, which trusts any
peer on 127.0.0.1, is turned off in app.uvicorn_config).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
from urllib.parse import urlsplit

import h11
from starlette.datastructures import Headers
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from flaxchat.serve.limits import is_loopback
from flaxchat.serve.openai_schema import openai_error
from flaxchat.serve.server import ChatServer, ClientError, error_event

# -----------------------------------------------------------------------------
# Keys and origins


def key_matches(given: str | None, key: str) -> bool:
    """Whether `given` is the key, in constant time: both are hashed first, so timing leaks neither content nor
    length."""
    if given is None:
        return False
    digest = lambda s: hashlib.sha256(s.encode("utf-8", "surrogatepass")).digest()
    return hmac.compare_digest(digest(given), digest(key))


def bearer(headers) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header, or None."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def authorized(key: str | None, headers) -> bool:
    return key is None or key_matches(bearer(headers), key)


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a browser page from `origin` may use the API: no Origin (not a browser), the page's own origin
    (Origin's host:port is the request's Host), a loopback origin, or one of `allowed` ("*": any)."""
    if origin is None:
        return True
    origin = origin.strip().lower().rstrip("/")
    if "*" in allowed or origin in allowed:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.hostname:  # "null" (sandboxed frames, files), extensions
        return False
    if host is not None and parts.netloc == host.strip().lower():
        return True
    return parts.hostname == "localhost" or is_loopback(parts.hostname)


def normalize_origins(origins) -> tuple[str, ...]:
    return tuple(o.strip().lower().rstrip("/") for o in origins if o.strip())


def normalize_hosts(hosts) -> tuple[str, ...]:
    """Host names as TrustedHostMiddleware compares them: lower case, IPv6 addresses in brackets, no port."""
    out = []
    for h in (h.strip().lower() for h in hosts):
        if h.count(":") > 1 and not h.startswith("["):
            h = f"[{h}]"
        elif h.count(":") == 1:
            h = h.split(":")[0]  # a port: any port is served
        if h:
            out.append(h)
    return tuple(out)


# -----------------------------------------------------------------------------
# The middleware

PUBLIC = ("/", "/health")  # the page and the health check; every other HTTP route is API (/ws checks its own key)
PUBLIC_WITH_DOCS = PUBLIC + ("/docs", "/openapi.json")


class Guard:
    """ASGI middleware in front of every route: origin, key and content type checks, the per-address cap, and the
    request body read within body_timeout. A refusal answers in the protocol's own way (an OpenAI-shaped error
    for HTTP; 403 before accept, or an error frame and close 1013, for a WebSocket) and costs its client."""

    def __init__(self, app, server: ChatServer):
        self.app, self.server = app, server
        self.open: collections.Counter = collections.Counter()  # requests and WebSockets in flight, per address

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        client = scope["client"][0] if scope.get("client") else "unknown"
        refusal = self.check(scope, client)
        if refusal is not None:
            self.server.charge_refusal(client)
            return await self.refuse(refusal, scope, receive, send)
        self.open[client] += 1
        try:
            if scope["type"] == "http" and scope["method"] == "POST":
                try:
                    receive = await self.read_body(receive)
                except ClientError as e:
                    self.server.charge_refusal(client)
                    return await self.refuse(e, scope, receive, send)
                if receive is None:  # the client left before its body arrived
                    return
                send = self.charging_refusals(send, client)
            await self.app(scope, receive, send)
        finally:
            self.open[client] -= 1
            if not self.open[client]:
                del self.open[client]

    def check(self, scope, client: str) -> ClientError | None:
        c, headers = self.server.config, Headers(scope=scope)
        websocket = scope["type"] == "websocket"
        api = not websocket and scope["path"] not in (PUBLIC_WITH_DOCS if c.api_docs else PUBLIC)
        origin = headers.get("origin")
        if (websocket or api) and not origin_allowed(origin, headers.get("host"), c.allowed_origins):
            return ClientError("forbidden_origin", f"pages from {origin[:100]!r} may not use this server", 403)
        if api and not authorized(c.api_key, headers):
            return ClientError("invalid_api_key", "this server needs its API key: Authorization: Bearer KEY", 401)
        if api and scope["method"] == "POST":
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type != "application/json":
                return ClientError(
                    "unsupported_media_type", "send a JSON body with Content-Type: application/json", 415
                )
        if self.server.limits_apply(client) and self.open[client] >= c.max_connections_per_client:
            return ClientError(
                "too_many_connections", f"this address holds {c.max_connections_per_client} connections already", 429
            )
        return None

    async def refuse(self, e: ClientError, scope, receive, send) -> None:
        if scope["type"] == "websocket":
            if e.reason == "forbidden_origin":
                return await send({"type": "websocket.close", "code": 1008})  # before accept: the handshake gets 403
            await receive()  # websocket.connect
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.send", "text": json.dumps(error_event(e.reason, e.message))})
            return await send({"type": "websocket.close", "code": 1013})
        response = openai_error(e)
        if e.status == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        if e.status in (408, 413):
            response.headers["Connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)

    async def read_body(self, receive):
        """The request body, read within body_timeout and refused past max_message_bytes, as a `receive` that hands
        it to the route in one message (and then reports the client leaving, as the real one does); None when the
        client left first."""
        c, body, more = self.server.config, bytearray(), True
        try:
            async with asyncio.timeout(c.body_timeout):
                while more:
                    message = await receive()
                    if message["type"] != "http.request":
                        return None
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                    if len(body) > c.max_message_bytes:
                        raise ClientError("message_too_large", f"request body is over {c.max_message_bytes} bytes", 413)
        except TimeoutError:
            raise ClientError(
                "request_timeout", f"the request body did not arrive within {c.body_timeout:g} s", 408
            ) from None
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return replay

    def charging_refusals(self, send, client: str):
        """`send`, charging the client rate_min_cost when a route refuses its request (429s charge themselves)."""

        async def watched(message):
            if message["type"] == "http.response.start" and 400 <= message["status"] < 500 and message["status"] != 429:
                self.server.charge_refusal(client)
            await send(message)

        return watched


# -----------------------------------------------------------------------------
# uvicorn protocols with deadlines


HEADERS_TOO_SLOW = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"content-length: 31\r\n\r\nthe request headers were late\r\n"
)


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for each request's headers: `header_timeout` seconds from the
    connection opening or the last response ending (uvicorn's keep-alive timer stops at the first byte, and none
    runs before a connection's first request, so a client that drips its headers, or sends nothing, would hold the
    socket forever). A keep-alive connection idle that long is closed too, as its keep-alive timer would."""

    header_timeout = 10.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.arm_header_deadline()

    def connection_lost(self, exc) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
        super().connection_lost(exc)

    def arm_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
        self.header_deadline = self.loop.call_later(self.header_timeout, self.headers_late)

    def headers_late(self) -> None:
        self.header_deadline = None
        if self.transport.is_closing() or self.transport.get_protocol() is not self:  # closed, or now a WebSocket
            return
        if self.conn.their_state is h11.IDLE:  # still no complete request line and headers
            if self.conn.trailing_data[0]:  # part of a request came: say why (a silent socket is just closed)
                self.transport.write(HEADERS_TOO_SLOW)
            self.transport.close()


def http_protocol(header_timeout: float) -> type:
    """HeaderDeadlineH11 with this deadline, for uvicorn.Config(http=...)."""
    return type("HeaderDeadlineH11", (HeaderDeadlineH11,), {"header_timeout": header_timeout})


class CuttingWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol, cutting the socket `linger` seconds after the app has finished with it:
    uvicorn closes it by flushing what is buffered first, which never ends for a client that stopped reading."""

    linger = 10.0

    async def run_asgi(self) -> None:
        await super().run_asgi()
        self.loop.call_later(self.linger, self.transport.abort)
