"""The chat page's WebSocket protocol (WS /ws): JSON text frames, and the server keeps each connection's
conversation.

    client -> server
        {"type": "auth", "key": str}  first, when the server asked for it (a server started with an API key)
        {"type": "message", "content": str, "temperature"?: 0..2, "top_k"?: 0..200, "max_tokens"?: int, "seed"?: int}
                                    the user's next message; the assistant's reply streams back
        {"type": "stop"}            end the reply being generated now (it is kept in the history as it stands)
        {"type": "reset"}           stop, and forget the conversation
    server -> client
        {"type": "auth_required"}                                                  on connect, when a key is needed
        {"type": "ready", "model": str, "limits": {...}, "defaults": {...}}          on connect (or once authorized)
        {"type": "token", "text": str}                                             reply text, as it is sampled
        {"type": "tool", "kind": "call" | "output", "text": str}                   a calculator call, its result
        {"type": "done", "finish_reason": "stop" | "length" | "cancelled", "usage": {...}}   end of a reply
        {"type": "reset"}                                                          the conversation was cleared
        {"type": "error", "reason": str, "message": str}                           see below; the socket stays open
    error reasons: bad_json, invalid_message (wrong type, unknown field, out of range), message_too_large,
    busy (a reply is still streaming), prompt_too_long, rate_limited, server_busy, internal_error; and ones the
    server closes the socket after: too_many_connections (code 1013), unauthorized (1008: a missing or wrong key,
    or none within ServeConfig.auth_timeout), idle_timeout (1000: no message for ServeConfig.idle_timeout seconds
    while no reply streams; pings do not count, so an abandoned tab does not hold a connection forever).

The key goes in the first frame rather than the URL, so that no access log or proxy log ever records it; a
non-browser client may instead send `Authorization: Bearer KEY` with the handshake and get "ready" at once.
A client that does not read its frames lets its queue of events (at most ServeConfig.max_send_queue) fill up; it
is then closed (1008) instead of growing the server's memory without bound.

When a conversation outgrows the prompt limit, its oldest exchanges are dropped until it fits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Annotated, Literal, Union

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from flaxchat.generate.scheduler import MAX_TOP_K, Request
from flaxchat.serve.security import authorized, key_matches
from flaxchat.serve.server import ChatServer, ClientError, describe_errors, error_event, parse_json, thread_emitter

# -----------------------------------------------------------------------------
# Client messages (pydantic: unknown fields and wrong types are errors, never guessed at)


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


class WsAuth(_Strict):
    type: Literal["auth"]
    key: str = Field(max_length=4096)


CLIENT_MESSAGE = TypeAdapter(Annotated[Union[WsMessage, WsStop, WsReset], Field(discriminator="type")])


def ready_event(server: ChatServer) -> dict:
    """The frame a new connection gets first: the model's name, the limits and the sampling defaults."""
    c = server.config
    return {
        "type": "ready",
        "model": c.model_name,
        "limits": {
            "max_new_tokens": server.max_new_tokens,
            "max_prompt_tokens": server.max_prompt_tokens,
            "max_message_bytes": c.max_message_bytes,
            "max_top_k": MAX_TOP_K,
        },
        "defaults": {
            "temperature": c.default_temperature,
            "top_k": c.default_top_k,
            "max_tokens": min(c.default_max_tokens, server.max_new_tokens),
        },
    }


# -----------------------------------------------------------------------------
# Sessions

CLOSE_CODES = {"idle": 1000, "unauthorized": 1008, "not_reading": 1008}


class Outbox(asyncio.Queue):
    """The events waiting to be sent to one client, at most `maxsize`. When a client stops reading it fills up;
    `overflowed` is then set and further events are dropped (the session closes the client), so what a client
    makes the server hold is bounded."""

    def __init__(self, maxsize: int):
        super().__init__(maxsize)
        self.overflowed = asyncio.Event()

    def put_nowait(self, item) -> None:
        if self.overflowed.is_set():
            return
        try:
            super().put_nowait(item)
        except asyncio.QueueFull:
            self.overflowed.set()


class ChatSession:
    """One WebSocket: its conversation, the reply in flight, and a single writer task for all its frames."""

    def __init__(self, server: ChatServer, ws: WebSocket, client: str):
        self.server, self.ws, self.client = server, ws, client
        self.history: list[dict] = []  # finished exchanges only: user, assistant, user, assistant...
        self.current: Request | None = None
        self.current_tag: object | None = None
        self.pending_user: str | None = None
        self.out = Outbox(server.config.max_send_queue)
        self.authorized = authorized(server.config.api_key, ws.headers)

    async def run(self) -> None:
        """Read the client's frames until it leaves, or the server ends the socket: idle, unauthorized, or not
        reading what it is sent."""
        c = self.server.config
        writer = asyncio.create_task(self._write())
        overflow = asyncio.create_task(self.out.overflowed.wait())
        self.out.put_nowait((None, ready_event(self.server) if self.authorized else {"type": "auth_required"}))
        receive, why = None, None
        try:
            while why is None:
                receive = receive or asyncio.ensure_future(self.ws.receive())
                timeout = c.idle_timeout if self.authorized else c.auth_timeout
                done, _ = await asyncio.wait(
                    (receive, writer, overflow), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if overflow in done:
                    why = "not_reading"
                elif writer in done:
                    break  # the client went away while we wrote to it
                elif receive in done:
                    message, receive = receive.result(), None
                    if message["type"] == "websocket.disconnect":
                        break
                    why = self._receive(message)
                elif self.current is None:  # quiet for `timeout` seconds, and no reply streaming
                    why = "idle" if self.authorized else "unauthorized"
                    reason = "idle_timeout" if self.authorized else "unauthorized"
                    self.out.put_nowait((None, error_event(reason, f"closed after {timeout:g} s without a message")))
        except WebSocketDisconnect:
            pass
        finally:
            if self.current is not None:
                self.server.scheduler.cancel(self.current)  # frees its slot at the next iteration
            for task in (receive, overflow):
                if task is not None:
                    task.cancel()
            if why is not None:
                await self._close(why, writer)
            writer.cancel()

    def _receive(self, message: dict) -> str | None:
        """Handle one frame; a refusal is answered with an error event and costs the client. Returns why the
        socket must close, if it must."""
        try:
            self._handle(message)
        except ClientError as e:
            if e.reason != "rate_limited":  # the rate limiter charged that one itself
                self.server.charge_refusal(self.client)
            self.out.put_nowait((None, error_event(e.reason, e.message)))
            if not self.authorized:
                return "unauthorized"
        return None

    async def _close(self, why: str, writer: asyncio.Task) -> None:
        """End the socket from our side: after what is queued (a client that reads sees why), or at once for a
        client that does not read."""
        self.server.closed[why] += 1
        if why == "not_reading":
            writer.cancel()
            with contextlib.suppress(Exception):  # its buffers are full: the close frame may never go out
                await asyncio.wait_for(self.ws.close(CLOSE_CODES[why], why), 1.0)
            return
        self.out.put_nowait((None, (CLOSE_CODES[why], why)))
        await asyncio.wait((writer,), timeout=5.0)

    def _handle(self, message: dict) -> None:
        if message.get("text") is None:
            raise ClientError("invalid_message", "binary frames are not part of the protocol; send JSON text")
        data = parse_json(message["text"], self.server.config.max_message_bytes)
        if not self.authorized:
            return self._authenticate(data)
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

    def _authenticate(self, data) -> None:
        try:
            key = WsAuth.model_validate(data).key
        except ValidationError:
            raise ClientError(
                "unauthorized", 'this server needs its API key first: {"type": "auth", "key": KEY}'
            ) from None
        if not key_matches(key, self.server.config.api_key):
            raise ClientError("unauthorized", "wrong API key")
        self.authorized = True
        self.out.put_nowait((None, ready_event(self.server)))

    def _start_reply(self, msg: WsMessage) -> None:
        if self.current is not None:
            raise ClientError("busy", "a reply is still being generated; wait for it or send stop")
        settings = self.server.sampling(msg.temperature, msg.top_k, msg.max_tokens, msg.seed)
        messages = self.history + [{"role": "user", "content": msg.content}]
        prompt, dropped = self.server.render(messages, drop_old=True)
        self.server.check_rate(self.client, settings["max_tokens"])
        tag = object()  # marks this reply's events, so a reset conversation's stragglers are dropped
        self.current = self.server.submit(prompt, settings, thread_emitter(self.out, tag))
        self.current_tag, self.pending_user = tag, msg.content
        self.history = self.history[dropped:]

    async def _write(self) -> None:
        """Send every queued event in order; bookkeeping for a finished reply happens before its done frame.
        A (code, reason) pair in place of an event closes the socket."""
        while True:
            source, event = await self.out.get()
            if source is not None:  # from the scheduler
                if source is not self.current_tag:
                    continue  # a reply the client reset away
                if event["type"] in ("done", "error"):
                    if event["type"] == "done":
                        self.history += [
                            {"role": "user", "content": self.pending_user},
                            {"role": "assistant", "content": self.current.parts},
                        ]
                    self.current = self.current_tag = self.pending_user = None
            try:
                if isinstance(event, tuple):
                    return await self.ws.close(*event)
                await self.ws.send_text(json.dumps(event))
            except Exception:  # the client went away; the receive loop notices too
                if self.current is not None:
                    self.server.scheduler.cancel(self.current)
                return
