"""The chat server's app: the FastAPI routes, wired to the modules that speak each protocol, and the ways to run it.

Routes
    GET  /                      the chat page (ui.html: one file, nothing external, works offline)
    GET  /health                {"status": "ok", "slots", "active", "queued", "utilisation" (active / slots),
                                 "connections", counters...}; only {"status": "ok"} without the key, when one is set
    GET  /metrics               Prometheus: requests, tokens, latencies, queue, rows, prefix reuse       (metrics.py)
    GET  /v1/models             OpenAI model list (one model)
    POST /v1/chat/completions   OpenAI chat completions, streamed or not                      (openai.py)
    POST /v1/completions        OpenAI legacy completions; logprobs of generated and (echo) prompt tokens (openai.py)
    POST /tokenize, /detokenize vLLM's tokenizer routes (lm-evaluation-harness's tokenizer_backend=remote) (tokenize.py)
    GET  /tokenizer_info        the tokenizer's BOS / EOS / special tokens and context length, as vLLM's (tokenize.py)
    WS   /ws                    the chat page's protocol                                       (websocket.py)
    GET  /docs, /openapi.json   only with ServeConfig.api_docs

In front of every route (security.py): the Host allow-list, the Origin check, the API key, JSON-only POSTs, the
per-address cap and the request body deadline; X-Forwarded-For is read only from ServeConfig.forwarded_allow_ips.

Where each piece lives: server.py holds the settings (ServeConfig) and the state every route shares (ChatServer:
the scheduler, prompt rendering, sampling defaults, the limits); limits.py the per-client rate limit; websocket.py
the WebSocket protocol and each connection's conversation; openai.py the OpenAI-compatible HTTP API; security.py
the checks that let the server face a network.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import threading
import time

import uvicorn
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import HTMLResponse, Response
from starlette.middleware.trustedhost import TrustedHostMiddleware
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from flaxchat.generate.scheduler import Scheduler
from flaxchat.serve.openai import completions, holding_connection, legacy_completions
from flaxchat.serve.security import CuttingWebSocket, Guard, authorized, http_protocol
from flaxchat.serve.server import ChatServer, ServeConfig, error_event
from flaxchat.serve.tokenize import tokenizer_routes
from flaxchat.serve.websocket import ChatSession

# -----------------------------------------------------------------------------
# The app


def load_page() -> str:
    return importlib.resources.files("flaxchat.serve").joinpath("ui.html").read_text(encoding="utf-8")


def create_app(
    scheduler: Scheduler, tokenizer, config: ServeConfig | None = None, own_scheduler: bool = True
) -> FastAPI:
    """The FastAPI app around a scheduler. The app starts the scheduler's thread, and closes it on shutdown
    when it owns it (several apps, e.g. with different limits, may share one scheduler)."""
    server = ChatServer(scheduler, tokenizer, config or ServeConfig())
    page = load_page()

    async def lifespan(app):
        scheduler.start()
        yield
        if own_scheduler:
            await asyncio.to_thread(scheduler.close)

    c = server.config
    docs = dict(docs_url="/docs", openapi_url="/openapi.json") if c.api_docs else dict(docs_url=None, openapi_url=None)
    app = FastAPI(title="flaxchat", lifespan=lifespan, redoc_url=None, **docs)
    app.state.chat = server
    app.add_middleware(Guard, server=server)  # each add wraps the ones before: the proxy's address is read first
    if c.allowed_hosts is not None:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(c.allowed_hosts), www_redirect=False)
    if c.forwarded_allow_ips:
        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=list(c.forwarded_allow_ips))

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health(request: Request):
        if not authorized(c.api_key, request.headers):
            return {"status": "ok"}
        stats = scheduler.stats()
        return {
            "status": "ok",
            "model": c.model_name,
            "connections": server.connections,
            "utilisation": round(stats["active"] / stats["slots"], 3),
            "closed_sockets": dict(server.closed),
            **stats,
        }

    @app.get("/metrics")
    async def metrics():
        body, content_type = server.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": server.config.model_name, "object": "model", "created": 0, "owned_by": "flaxchat"}],
        }

    app.post("/v1/chat/completions")(holding_connection(server, completions))
    app.post("/v1/completions")(holding_connection(server, legacy_completions))
    tokenizer_routes(app, server)

    @app.websocket("/ws")
    async def chat_socket(ws: WebSocket):
        await ws.accept()
        if not server.acquire():
            await ws.send_text(
                json.dumps(
                    error_event("too_many_connections", "the server is at its connection limit; try again later")
                )
            )
            await ws.close(code=1013)
            return
        try:
            await ChatSession(server, ws, ws.client.host if ws.client else "unknown").run()
        finally:
            server.release()

    return app


# -----------------------------------------------------------------------------
# Running it


def uvicorn_config(app, host: str, port: int, config: ServeConfig | None = None, **kwargs) -> uvicorn.Config:
    """uvicorn settings for the app: WebSocket frames a little over the message limit are still read (and answered
    with message_too_large); far larger ones are cut off by uvicorn itself. Request headers have a deadline
    (security.HeaderDeadlineH11), and uvicorn's own X-Forwarded-For handling is off: it trusts any peer on
    127.0.0.1, and the app reads that header itself, from ServeConfig.forwarded_allow_ips only."""
    c = config or app.state.chat.config
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=http_protocol(c.header_timeout),
        ws=CuttingWebSocket,
        ws_max_size=4 * c.max_message_bytes + 4096,
        proxy_headers=False,
        timeout_keep_alive=5,
        log_level="warning",
        timeout_graceful_shutdown=5,
        **kwargs,
    )


class BackgroundServer:
    """uvicorn on a background thread (tests, load tests): `with BackgroundServer(app) as url: ...`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.server = uvicorn.Server(uvicorn_config(app, host, port))
        self.thread = threading.Thread(target=self.server.run, name="flaxchat-uvicorn", daemon=True)
        self.url = ""

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the chat server did not start")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
