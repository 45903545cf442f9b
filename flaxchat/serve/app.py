"""The chat server: one page (ui.html), a WebSocket chat protocol, and an OpenAI-compatible HTTP API.

Every generation goes through one `flaxchat.generate.scheduler.Scheduler` (continuous batching over N KV-cache slots);
this module only speaks the protocols, keeps each WebSocket's conversation, and enforces the limits.

Routes
    GET  /                      the chat page
    GET  /health                {"status": "ok", "slots", "active", "queued", "utilisation" (active / slots),
                                 "connections", counters...}
    GET  /v1/models             OpenAI model list (one model)
    POST /v1/chat/completions   OpenAI chat completions; "stream": true answers with server-sent events
    POST /v1/completions        OpenAI legacy completions ("stream": true streams one prompt); echo + logprobs +
                                max_tokens 0 scores a prompt
    WS   /ws                    the chat protocol below

WebSocket protocol (JSON text frames). The server keeps the conversation of each connection.
    client -> server
        {"type": "message", "content": str, "temperature"?: 0..2, "top_k"?: 0..200, "max_tokens"?: int, "seed"?: int}
                                    the user's next message; the assistant's reply streams back
        {"type": "stop"}            end the reply being generated now (it is kept in the history as it stands)
        {"type": "reset"}           stop, and forget the conversation
    server -> client
        {"type": "ready", "model": str, "limits": {...}, "defaults": {...}}          once, on connect
        {"type": "token", "text": str}                                             reply text, as it is sampled
        {"type": "tool", "kind": "call" | "output", "text": str}                   a calculator call, its result
        {"type": "done", "finish_reason": "stop" | "length" | "cancelled", "usage": {...}}   end of a reply
        {"type": "reset"}                                                          the conversation was cleared
        {"type": "error", "reason": str, "message": str}                           see below; the socket stays open
    error reasons: bad_json, invalid_message (wrong type, unknown field, out of range), message_too_large,
    busy (a reply is still streaming), prompt_too_long, rate_limited, server_busy, internal_error,
    too_many_connections (then the socket closes with code 1013).

Limits (ServeConfig): prompt tokens, new tokens per reply, concurrent connections (WebSockets + in-flight HTTP
completions), message/body bytes, and requests per minute per client address (a token bucket; loopback clients
are exempt unless ServeConfig.limit_loopback).

The OpenAI endpoint honours temperature, top_p, top_k, seed, max_tokens / max_completion_tokens, n, stop and
stream_options.include_usage; OpenAI's other request fields are accepted and ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.resources
import ipaddress
import json
import logging
import threading
import time
import uuid
from typing import Annotated, Literal, Union

from fastapi import FastAPI, Request as HTTPRequest, WebSocket, WebSocketDisconnect
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from flaxchat.generate.scheduler import MAX_TOP_K, QueueFull, Request, Scheduler, new_seed

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    model_name: str = "flaxchat"
    max_prompt_tokens: int | None = None  # None: three quarters of the model's context
    max_new_tokens: int = 512  # most tokens a reply may ask for
    default_max_tokens: int = 256
    default_temperature: float = 0.8
    default_top_k: int = 50
    max_connections: int = 64
    max_message_bytes: int = 32 * 1024  # one WebSocket frame or one HTTP body
    rate_limit: float = 30.0  # generation requests per minute per client address; 0 turns it off
    rate_burst: int = 10
    limit_loopback: bool = False  # loopback clients (127.0.0.1, ::1: this machine's own user) skip the rate limit


# -----------------------------------------------------------------------------
# Messages (pydantic: unknown fields and wrong types are errors, never guessed at)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class WsMessage(_Strict):
    type: Literal["message"]
    content: str = Field(min_length=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**63)


class WsStop(_Strict):
    type: Literal["stop"]


class WsReset(_Strict):
    type: Literal["reset"]


CLIENT_MESSAGE = TypeAdapter(Annotated[Union[WsMessage, WsStop, WsReset], Field(discriminator="type")])


class _OpenAI(BaseModel):
    """OpenAI's request shapes: fields this server does not use (presence_penalty, logit_bias, user, store,
    metadata...) are accepted and ignored, as clients send them routinely; the fields it uses stay strict."""

    model_config = ConfigDict(extra="ignore", strict=True)


MAX_CHOICES = 8  # most choices (`n`) one request may ask for: each takes a scheduler slot
MAX_STOPS = 4  # as OpenAI


class ContentPart(_OpenAI):
    type: Literal["text", "python", "python_output"]  # python parts: flaxchat's tool calls, for round trips
    text: str


class ChatMessage(_OpenAI):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class StreamOptions(_OpenAI):
    include_usage: bool = False


class ResponseFormat(_OpenAI):
    type: Literal["text"]  # json_object / json_schema cannot be honoured, so they are refused


class ChatCompletionRequest(_OpenAI):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None  # any name is accepted; this server has one model
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)  # not OpenAI's, but nanochat's main knob
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins over max_tokens
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    logprobs: Literal[False] | None = None  # per-token log-probabilities are not returned by this endpoint
    tools: list[dict] | None = Field(None, max_length=0)  # the model calls only its own calculator
    response_format: ResponseFormat | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(not x for x in stops):
            raise ClientError("invalid_message", f"stop: at most {MAX_STOPS} non-empty strings")
        return stops


def describe_errors(error: ValidationError) -> str:
    """A pydantic error as one readable sentence: 'temperature: Input should be ...; ...'."""
    out = []
    for e in error.errors()[:3]:
        loc = [str(x) for x in e["loc"]]
        if loc and loc[0] in ("message", "stop", "reset"):  # the union's tag, not a field
            loc = loc[1:]
        out.append(f"{'.'.join(loc)}: {e['msg']}" if loc else e["msg"])
    more = len(error.errors()) - len(out)
    return "; ".join(out) + (f" (and {more} more)" if more > 0 else "")


class ClientError(Exception):
    """A request the server refuses, with a machine-readable reason and a sentence for people."""

    def __init__(self, reason: str, message: str, status: int = 400):
        super().__init__(message)
        self.reason, self.message, self.status = reason, message, status


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(text: str | bytes, max_bytes: int):
    size = len(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    if size > max_bytes:
        raise ClientError("message_too_large", f"message is {size} bytes; the limit is {max_bytes}", 413)
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ClientError("bad_json", f"not valid JSON: {str(e)[:200]}") from None


# -----------------------------------------------------------------------------
# Limits


class RateLimiter:
    """A token bucket per client key: `burst` requests at once, refilled at `per_minute`."""

    def __init__(self, per_minute: float, burst: int):
        self.rate, self.burst = per_minute / 60.0, max(1, burst)
        self.buckets: dict[str, tuple[float, float]] = {}

    def check(self, key: str) -> float:
        """0 if the request may go ahead (and is counted), else seconds until it may."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        tokens, last = self.buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens < 1.0:
            self.buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate
        self.buckets[key] = (tokens - 1.0, now)
        if len(self.buckets) > 10_000:  # forget clients whose buckets are full again
            full = [k for k, (t, s) in self.buckets.items() if t + (now - s) * self.rate >= self.burst]
            for k in full:
                del self.buckets[k]
        return 0.0


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "unknown", a test client's name
        return False


class ChatServer:
    """Shared state of one app: the scheduler, the limits, the connection count."""

    def __init__(self, scheduler: Scheduler, tokenizer, config: ServeConfig):
        self.scheduler, self.tokenizer, self.config = scheduler, tokenizer, config
        capacity = scheduler.capacity
        self.max_prompt_tokens = min(config.max_prompt_tokens or capacity * 3 // 4, capacity - 1)
        self.max_new_tokens = min(config.max_new_tokens, capacity - 1)
        self.limiter = RateLimiter(config.rate_limit, config.rate_burst)
        self.connections = 0

    def acquire(self) -> bool:
        if self.connections >= self.config.max_connections:
            return False
        self.connections += 1
        return True

    def release(self) -> None:
        self.connections -= 1

    def check_rate(self, client: str) -> None:
        if not self.config.limit_loopback and is_loopback(client):
            return
        wait = self.limiter.check(client)
        if wait > 0:
            raise ClientError("rate_limited", f"too many requests; try again in {wait:.1f} s", 429)

    def sampling(self, temperature, top_k, max_tokens, seed, top_p=None) -> dict:
        c = self.config
        if max_tokens is not None and max_tokens > self.max_new_tokens:
            raise ClientError("invalid_message", f"max_tokens: at most {self.max_new_tokens} new tokens per reply")
        return dict(temperature=c.default_temperature if temperature is None else temperature,
                    top_k=c.default_top_k if top_k is None else top_k,
                    max_tokens=min(c.default_max_tokens, self.max_new_tokens) if max_tokens is None else max_tokens,
                    seed=new_seed() if seed is None else seed, top_p=1.0 if top_p is None else top_p)

    def render(self, messages: list[dict], drop_old: bool) -> tuple[list[int], int]:
        """Prompt ids for the reply to `messages` -> (ids, messages dropped). With drop_old, the oldest
        exchanges are dropped until the prompt fits; otherwise a long prompt is an error."""
        dropped = 0
        while True:
            try:
                conversation = {"messages": messages[dropped:] + [{"role": "assistant", "content": ""}]}
                ids = self.tokenizer.render_for_completion(conversation, max_tokens=10**9)
            except (ValueError, KeyError, TypeError, UnicodeError) as e:
                raise ClientError("invalid_message", f"messages: {e}") from None
            if len(ids) <= self.max_prompt_tokens:
                return ids, dropped
            if not drop_old or len(messages) - dropped <= 1:
                raise ClientError("prompt_too_long", f"the prompt is {len(ids)} tokens; the limit is "
                                  f"{self.max_prompt_tokens}", 400)
            dropped += 2  # one user message and the reply to it

    def submit(self, prompt: list[int], settings: dict, emit) -> Request:
        try:
            return self.scheduler.submit(Request(prompt=prompt, emit=emit, **settings))
        except QueueFull as e:
            raise ClientError("server_busy", str(e), 503) from None
        except (ValueError, RuntimeError) as e:
            raise ClientError("server_busy" if isinstance(e, RuntimeError) else "prompt_too_long", str(e), 503) from None

    def info(self) -> dict:
        c = self.config
        return {"type": "ready", "model": c.model_name,
                "limits": {"max_new_tokens": self.max_new_tokens, "max_prompt_tokens": self.max_prompt_tokens,
                           "max_message_bytes": c.max_message_bytes, "max_top_k": MAX_TOP_K},
                "defaults": {"temperature": c.default_temperature, "top_k": c.default_top_k,
                             "max_tokens": min(c.default_max_tokens, self.max_new_tokens)}}


def thread_emitter(queue: asyncio.Queue, tag=None):
    """An emit callback for the scheduler thread that hands events to this event loop's queue."""
    loop = asyncio.get_running_loop()
    return lambda event: loop.call_soon_threadsafe(queue.put_nowait, (tag, event))


def error_event(reason: str, message: str) -> dict:
    return {"type": "error", "reason": reason, "message": message}


# -----------------------------------------------------------------------------
# WebSocket sessions


class ChatSession:
    """One WebSocket: its conversation, the reply in flight, and a single writer task for all its frames."""

    def __init__(self, server: ChatServer, ws: WebSocket, client: str):
        self.server, self.ws, self.client = server, ws, client
        self.history: list[dict] = []  # finished exchanges only: user, assistant, user, assistant...
        self.current: Request | None = None
        self.current_tag: object | None = None
        self.pending_user: str | None = None
        self.out: asyncio.Queue = asyncio.Queue()

    async def run(self) -> None:
        writer = asyncio.create_task(self._write())
        self.out.put_nowait((None, self.server.info()))
        try:
            while not writer.done():
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                try:
                    self._handle(message)
                except ClientError as e:
                    self.out.put_nowait((None, error_event(e.reason, e.message)))
        except WebSocketDisconnect:
            pass
        finally:
            if self.current is not None:
                self.server.scheduler.cancel(self.current)  # frees its slot at the next iteration
            writer.cancel()

    def _handle(self, message: dict) -> None:
        if message.get("text") is None:
            raise ClientError("invalid_message", "binary frames are not part of the protocol; send JSON text")
        data = parse_json(message["text"], self.server.config.max_message_bytes)
        try:
            msg = CLIENT_MESSAGE.validate_python(data)
        except ValidationError as e:
            raise ClientError("invalid_message", describe_errors(e)) from None
        if isinstance(msg, WsStop):
            if self.current is not None:
                self.server.scheduler.cancel(self.current)
        elif isinstance(msg, WsReset):
            if self.current is not None:
                self.server.scheduler.cancel(self.current)
            self.current = self.current_tag = self.pending_user = None
            self.history = []
            self.out.put_nowait((None, {"type": "reset"}))
        else:
            self._start_reply(msg)

    def _start_reply(self, msg: WsMessage) -> None:
        if self.current is not None:
            raise ClientError("busy", "a reply is still being generated; wait for it or send stop")
        settings = self.server.sampling(msg.temperature, msg.top_k, msg.max_tokens, msg.seed)
        messages = self.history + [{"role": "user", "content": msg.content}]
        prompt, dropped = self.server.render(messages, drop_old=True)
        self.server.check_rate(self.client)
        tag = object()  # marks this reply's events, so a reset conversation's stragglers are dropped
        self.current = self.server.submit(prompt, settings, thread_emitter(self.out, tag))
        self.current_tag, self.pending_user = tag, msg.content
        self.history = self.history[dropped:]

    async def _write(self) -> None:
        """Send every queued event in order; bookkeeping for a finished reply happens before its done frame."""
        while True:
            source, event = await self.out.get()
            if source is not None:  # from the scheduler
                if source is not self.current_tag:
                    continue  # a reply the client reset away
                if event["type"] in ("done", "error"):
                    if event["type"] == "done":
                        self.history += [{"role": "user", "content": self.pending_user},
                                         {"role": "assistant", "content": self.current.parts}]
                    self.current = self.current_tag = self.pending_user = None
            try:
                await self.ws.send_text(json.dumps(event))
            except Exception:  # the client went away; the receive loop notices too
                if self.current is not None:
                    self.server.scheduler.cancel(self.current)
                return


# -----------------------------------------------------------------------------
# OpenAI-compatible HTTP


def openai_error(e: ClientError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": "invalid_request_error" if e.status < 500 else "server_error",
                      "param": None, "code": e.reason}}
    return JSONResponse(body, status_code=e.status)


async def read_body(request: HTTPRequest, max_bytes: int) -> bytes:
    """The request body, refused as soon as it passes max_bytes (a large body is never held whole)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ClientError("message_too_large", f"request body is {declared} bytes; the limit is {max_bytes}", 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise ClientError("message_too_large", f"request body is over the {max_bytes}-byte limit", 413)
    return bytes(body)


def openai_messages(req: ChatCompletionRequest) -> list[dict]:
    """OpenAI messages -> flaxchat conversation messages (text parts joined; tool parts kept for assistants)."""
    out = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            if m.role != "assistant":
                if any(p.type != "text" for p in content):
                    raise ClientError("invalid_message", f"{m.role} content parts must be of type text")
                content = "".join(p.text for p in content)
            else:
                content = [p.model_dump() for p in content]
        out.append({"role": m.role, "content": content})
    if out[-1]["role"] != "user":
        raise ClientError("invalid_message", "messages: the last message must be from the user")
    return out


def reply_text(event: dict) -> str:
    """How a scheduler event reads in OpenAI content: text as is, tool calls and outputs as fenced blocks."""
    if event["type"] == "token":
        return event["text"]
    if event["type"] == "tool":
        return f"\n```{'python' if event['kind'] == 'call' else 'output'}\n{event['text']}\n```\n"
    return ""


class HeldStream(StreamingResponse):
    """A streaming response that holds one of the server's connections until it has been sent (or the client
    left): the handler returns long before the stream ends."""

    def __init__(self, server: ChatServer, content, **kwargs):
        super().__init__(content, **kwargs)
        self.server = server

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.server.release()


class StopFilter:
    """One choice's text with OpenAI's `stop` strings: the reply ends before the first occurrence of any.
    Text that could still be the start of a stop string is held back until the next piece decides it."""

    def __init__(self, stops: list[str]):
        self.stops, self.held, self.stopped = stops, "", False

    def feed(self, text: str) -> str:
        """The text that is safe to send now."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        self.held += text
        cut = min((i for i in (self.held.find(x) for x in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, out, self.held = True, self.held[:cut], ""
            return out
        keep = max((k for x in self.stops for k in range(1, len(x)) if self.held.endswith(x[:k])), default=0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class Choices:
    """The n scheduler requests behind one OpenAI completion, their stop filters and finish reasons."""

    def __init__(self, server: ChatServer, jobs: list[Request], stops: list[str]):
        self.server, self.jobs = server, jobs
        self.filters = [StopFilter(stops) for _ in jobs]
        self.reasons: list[str | None] = [None] * len(jobs)

    def handle(self, index: int, event: dict) -> tuple[str, bool]:
        """An event of choice `index` -> (text to send, whether the choice just ended)."""
        f = self.filters[index]
        if self.reasons[index] is not None:
            return "", False  # after a stop string: the cancelled request's stragglers
        if event["type"] == "done":
            self.reasons[index] = self.jobs[index].finish_reason
            return f.flush(), True
        text = f.feed(reply_text(event))
        if f.stopped:
            self.reasons[index] = "stop"
            self.server.scheduler.cancel(self.jobs[index])
            return text, True
        return text, False

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.reasons)

    def usage(self) -> dict:
        prompt = len(self.jobs[0].prompt)  # counted once, as OpenAI does for n > 1
        completion = sum(j.completion_tokens for j in self.jobs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def cancel_unfinished(self) -> None:
        for job in self.jobs:
            if not job.finished:
                self.server.scheduler.cancel(job)


def submit_choices(server: ChatServer, prompt: list[int], settings: dict, n: int, seeded: bool,
                   events: asyncio.Queue) -> list[Request]:
    """n scheduler requests for one prompt, seeds seed+i when the client gave a seed (all or none are queued)."""
    jobs = []
    try:
        for i in range(n):
            seed = settings["seed"] + i if seeded else (settings["seed"] if i == 0 else new_seed())
            jobs.append(server.submit(prompt, {**settings, "seed": seed % 2**63}, thread_emitter(events, i)))
    except ClientError:
        for job in jobs:
            server.scheduler.cancel(job)
        raise
    return jobs


async def read_request(server: ChatServer, request: HTTPRequest, model: type[BaseModel]):
    """The request body parsed and validated as `model`; ClientError (400/413) otherwise."""
    limit = server.config.max_message_bytes
    try:
        return model.model_validate(parse_json(await read_body(request, limit), limit))
    except ValidationError as e:
        raise ClientError("invalid_message", describe_errors(e)) from None


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def completions(server: ChatServer, request: HTTPRequest):
    """POST /v1/chat/completions. Returns a JSONResponse, or a StreamingResponse of SSE chunks."""
    try:
        req = await read_request(server, request, ChatCompletionRequest)
        stops = req.stops()
        settings = server.sampling(req.temperature, req.top_k, req.max_completion_tokens or req.max_tokens, req.seed,
                                   req.top_p)
        prompt, _ = server.render(openai_messages(req), drop_old=False)
        server.check_rate(request.client.host if request.client else "unknown")
        events: asyncio.Queue = asyncio.Queue()
        choices = Choices(server, submit_choices(server, prompt, settings, req.n, req.seed is not None, events), stops)
    except ClientError as e:
        return openai_error(e)
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "", "created": int(time.time()),
            "model": server.config.model_name}  # "object" is filled in per response, keeping OpenAI's key order
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return HeldStream(server, _sse(choices, events, _chat_chunks(meta), include_usage),
                          media_type="text/event-stream", headers=SSE_HEADERS)
    return await _collect(request, choices, events, meta)


async def _collect(request, choices: Choices, events, meta):
    try:
        texts = await _gather(request, choices, events)
    except ClientError as e:  # 499: nobody is waiting (the slots are already freed)
        return JSONResponse({}, status_code=499) if e.status == 499 else openai_error(e)
    out = [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
            "logprobs": None} for i, (text, reason) in enumerate(zip(texts, choices.reasons))]
    return JSONResponse({**meta, "object": "chat.completion", "choices": out, "usage": choices.usage()})


def _sse_chunk(meta: dict, delta: dict, finish_reason=None, index: int = 0, **extra) -> str:
    chunk = {**meta, "object": "chat.completion.chunk",
             "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}], **extra}
    return f"data: {json.dumps(chunk)}\n\n"


def _chat_chunks(meta: dict):
    """The chat endpoint's SSE lines: (opening lines per choice, chunk(index, text, finish), usage line)."""
    opening = lambda n: [_sse_chunk(meta, {"role": "assistant", "content": ""}, index=i) for i in range(n)]
    chunk = lambda index, text, finish: _sse_chunk(meta, {"content": text} if text else {}, finish, index)
    usage = lambda u: f"data: {json.dumps({**meta, 'object': 'chat.completion.chunk', 'choices': [], 'usage': u})}\n\n"
    return opening, chunk, usage


async def _sse(choices: Choices, events, lines, include_usage):
    """Server-sent events for a streamed request: lines = (opening, chunk, usage) as _chat_chunks makes them."""
    opening, chunk, usage = lines
    try:
        for line in opening(len(choices.jobs)):
            yield line
        while not choices.done:
            index, event = await events.get()
            if event["type"] == "error":
                yield f"data: {json.dumps({'error': {'message': event['message'], 'code': event['reason']}})}\n\n"
                break
            text, ended = choices.handle(index, event)
            if text:
                yield chunk(index, text, None)
            if ended:
                yield chunk(index, "", choices.reasons[index])
        else:
            if include_usage:
                yield usage(choices.usage())
        yield "data: [DONE]\n\n"
    finally:  # also runs when the client disconnects mid-stream (the response task is cancelled)
        choices.cancel_unfinished()


# -----------------------------------------------------------------------------
# Legacy OpenAI completions (raw text in and out; lm-evaluation-harness scores prompts through it)


class CompletionRequest(_OpenAI):
    prompt: str | list[int] | list[str] | list[list[int]]
    model: str | None = None
    max_tokens: int = Field(16, ge=0)  # OpenAI's default; 0 with echo scores the prompt only
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    stream: bool = False
    stream_options: StreamOptions | None = None

    stops = ChatCompletionRequest.stops


def legacy_prompts(server: ChatServer, req: CompletionRequest) -> list[tuple[str, list[int]]]:
    """The request's prompts as (text, ids): text is encoded without BOS (send ids to choose the tokens)."""
    p = req.prompt
    items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not items or any(len(x) == 0 for x in items):
        raise ClientError("invalid_message", "prompt: give at least one non-empty prompt")
    vocab = server.tokenizer.get_vocab_size()
    out = []
    for x in items:
        ids = server.tokenizer.encode(x) if isinstance(x, str) else list(x)
        if not ids or any(not 0 <= t < vocab for t in ids):
            raise ClientError("invalid_message", f"prompt: token ids must be in 0..{vocab - 1}")
        out.append((x if isinstance(x, str) else server.tokenizer.decode(ids), ids))
    return out


async def prompt_logprobs(server: ChatServer, ids: list[int], top: int) -> dict:
    """OpenAI's legacy logprobs object for a prompt's tokens (the first has no logprob: nothing precedes it)."""
    chosen, alt, alt_logp = await asyncio.to_thread(server.scheduler.score, ids, top)
    decode = lambda t: server.tokenizer.decode([int(t)])
    tokens = [decode(t) for t in ids]
    offsets = [0]
    for t in tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    tops = [None] + [{decode(a): float(v) for a, v in zip(row, vals)} for row, vals in zip(alt, alt_logp)]
    return {"tokens": tokens, "token_logprobs": [None] + [float(x) for x in chosen[1:]],
            "top_logprobs": tops if top else [None] + [{} for _ in ids[1:]], "text_offset": offsets}


async def legacy_completions(server: ChatServer, request: HTTPRequest):
    """POST /v1/completions: text completion of raw prompts; echo + logprobs + max_tokens 0 scores prompts."""
    try:
        req = await read_request(server, request, CompletionRequest)
        stops, prompts = req.stops(), legacy_prompts(server, req)
        if req.logprobs is not None and req.max_tokens > 0:
            raise ClientError("invalid_message", "logprobs: returned for the prompt only (echo with max_tokens 0)")
        limit = server.max_prompt_tokens if req.max_tokens else server.scheduler.capacity
        if any(len(ids) > limit for _, ids in prompts):
            raise ClientError("prompt_too_long", f"a prompt is over the {limit}-token limit")
        settings = server.sampling(req.temperature, req.top_k, req.max_tokens or None, req.seed, req.top_p)
        if req.stream and (len(prompts) > 1 or req.max_tokens == 0 or req.logprobs is not None):
            raise ClientError("invalid_message", "stream: one prompt, max_tokens > 0 and no logprobs")
        server.check_rate(request.client.host if request.client else "unknown")
        if req.stream:
            return legacy_stream(server, req, prompts[0], settings, stops)
        out, usage = [], {"prompt_tokens": sum(len(ids) for _, ids in prompts), "completion_tokens": 0}
        for p, (text, ids) in enumerate(prompts):
            logprobs = await prompt_logprobs(server, ids, req.logprobs) if req.logprobs is not None and req.echo \
                else None
            if req.max_tokens == 0:
                replies, reasons = [""] * req.n, ["length"] * req.n
            else:
                events: asyncio.Queue = asyncio.Queue()
                choices = Choices(server, submit_choices(server, ids, settings, req.n, req.seed is not None, events),
                                  stops)
                replies = await _gather(request, choices, events)
                reasons = choices.reasons
                usage["completion_tokens"] += choices.usage()["completion_tokens"]
            for i, (reply, reason) in enumerate(zip(replies, reasons)):
                out.append({"text": (text if req.echo else "") + reply, "index": p * req.n + i,
                            "logprobs": logprobs if req.logprobs is not None else None, "finish_reason": reason})
    except ClientError as e:
        return openai_error(e)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion",
                         "created": int(time.time()), "model": server.config.model_name, "choices": out,
                         "usage": usage})


def legacy_stream(server: ChatServer, req: CompletionRequest, prompt: tuple[str, list[int]], settings, stops):
    """A streamed legacy completion: text_completion chunks (the echoed prompt first, with echo), then [DONE]."""
    text, ids = prompt
    events: asyncio.Queue = asyncio.Queue()
    choices = Choices(server, submit_choices(server, ids, settings, req.n, req.seed is not None, events), stops)
    meta = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": server.config.model_name}

    def chunk(index, piece, finish):
        body = {**meta, "choices": [{"text": piece, "index": index, "logprobs": None, "finish_reason": finish}]}
        return f"data: {json.dumps(body)}\n\n"

    opening = lambda n: [chunk(i, text, None) for i in range(n)] if req.echo else []
    usage = lambda u: f"data: {json.dumps({**meta, 'choices': [], 'usage': u})}\n\n"
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return HeldStream(server, _sse(choices, events, (opening, chunk, usage), include_usage),
                      media_type="text/event-stream", headers=SSE_HEADERS)


async def _gather(request, choices: Choices, events) -> list[str]:
    texts = [[] for _ in choices.jobs]
    try:
        while not choices.done:
            try:
                index, event = await asyncio.wait_for(events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise ClientError("cancelled", "the client went away", 499) from None
                continue
            if event["type"] == "error":
                raise ClientError(event["reason"], event["message"], 500)
            texts[index].append(choices.handle(index, event)[0])
    finally:
        choices.cancel_unfinished()
    return ["".join(t) for t in texts]


# -----------------------------------------------------------------------------
# The app


def load_page() -> str:
    return importlib.resources.files("flaxchat.serve").joinpath("ui.html").read_text(encoding="utf-8")


def create_app(scheduler: Scheduler, tokenizer, config: ServeConfig | None = None, own_scheduler: bool = True) -> FastAPI:
    """The FastAPI app around a scheduler. The app starts the scheduler's thread, and closes it on shutdown
    when it owns it (several apps, e.g. with different limits, may share one scheduler)."""
    server = ChatServer(scheduler, tokenizer, config or ServeConfig())
    page = load_page()

    async def lifespan(app):
        scheduler.start()
        yield
        if own_scheduler:
            await asyncio.to_thread(scheduler.close)

    app = FastAPI(title="flaxchat", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.chat = server

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health():
        stats = scheduler.stats()
        return {"status": "ok", "model": server.config.model_name, "connections": server.connections,
                "utilisation": round(stats["active"] / stats["slots"], 3), **stats}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.config.model_name, "object": "model",
                                            "created": 0, "owned_by": "flaxchat"}]}

    def held(handler):
        """An HTTP route that holds one of the server's connections while it runs (a stream: until sent)."""
        async def route(request: HTTPRequest):
            if not server.acquire():
                return openai_error(ClientError("too_many_connections", "the server is at its connection limit", 503))
            response = None
            try:
                response = await handler(server, request)
                return response
            finally:
                if not isinstance(response, HeldStream):  # a stream gives its connection back when it ends
                    server.release()
        return route

    app.post("/v1/chat/completions")(held(completions))
    app.post("/v1/completions")(held(legacy_completions))

    @app.websocket("/ws")
    async def chat_socket(ws: WebSocket):
        await ws.accept()
        if not server.acquire():
            await ws.send_text(json.dumps(error_event("too_many_connections",
                                                      "the server is at its connection limit; try again later")))
            await ws.close(code=1013)
            return
        try:
            await ChatSession(server, ws, ws.client.host if ws.client else "unknown").run()
        finally:
            server.release()

    return app


# -----------------------------------------------------------------------------
# Running it


def uvicorn_config(app, host: str, port: int, config: ServeConfig | None = None, **kwargs):
    """uvicorn settings for the app: WebSocket frames a little over the message limit are still read (and answered
    with message_too_large); far larger ones are cut off by uvicorn itself."""
    import uvicorn

    limit = (config or app.state.chat.config).max_message_bytes
    return uvicorn.Config(app, host=host, port=port, ws_max_size=4 * limit + 4096, log_level="warning",
                          timeout_graceful_shutdown=5, **kwargs)


class BackgroundServer:
    """uvicorn on a background thread (tests, load tests): `with BackgroundServer(app) as url: ...`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

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
