"""The chat page's WebSocket protocol (WS /ws): JSON text frames, and the server keeps each connection's
conversation.

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

When a conversation outgrows the prompt limit, its oldest exchanges are dropped until it fits.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Literal, Union

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from flaxchat.generate.scheduler import MAX_TOP_K, Request
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
        self.out.put_nowait((None, ready_event(self.server)))
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
                        self.history += [
                            {"role": "user", "content": self.pending_user},
                            {"role": "assistant", "content": self.current.parts},
                        ]
                    self.current = self.current_tag = self.pending_user = None
            try:
                await self.ws.send_text(json.dumps(event))
            except Exception:  # the client went away; the receive loop notices too
                if self.current is not None:
                    self.server.scheduler.cancel(self.current)
                return
