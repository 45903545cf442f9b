"""The chat server's shared core: its settings (ServeConfig), the refusal every protocol speaks (ClientError), and
ChatServer, the state one app shares between its WebSockets and HTTP routes.

Every generation goes through one `flaxchat.generate.scheduler.Scheduler` (continuous batching over N KV-cache
slots); ChatServer turns a conversation into prompt ids, checks a request against the limits and hands it to the
scheduler. The protocols on top live in websocket.py (the chat page's socket) and openai.py (the HTTP API).

Limits (ServeConfig): prompt tokens, new tokens per reply, concurrent connections (WebSockets + in-flight HTTP
completions), message/body bytes, and requests per minute per client address (a token bucket, limits.py; loopback
clients are exempt unless ServeConfig.limit_loopback).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

from pydantic import ValidationError

from flaxchat.generate.scheduler import QueueFull, Request, Scheduler, new_seed
from flaxchat.serve.limits import RateLimiter, is_loopback


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
# Refusals and parsing (pydantic: unknown fields and wrong types are errors, never guessed at)


class ClientError(Exception):
    """A request the server refuses, with a machine-readable reason and a sentence for people."""

    def __init__(self, reason: str, message: str, status: int = 400):
        super().__init__(message)
        self.reason, self.message, self.status = reason, message, status


def describe_errors(error: ValidationError) -> str:
    """A pydantic error as one readable sentence: 'temperature: Input should be ...; ...'."""
    out = []
    for e in error.errors()[:3]:
        loc = [str(x) for x in e["loc"]]
        if loc and loc[0] in ("message", "stop", "reset"):  # the WebSocket union's tag, not a field
            loc = loc[1:]
        out.append(f"{'.'.join(loc)}: {e['msg']}" if loc else e["msg"])
    more = len(error.errors()) - len(out)
    return "; ".join(out) + (f" (and {more} more)" if more > 0 else "")


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(text: str | bytes, max_bytes: int):
    """A WebSocket frame or HTTP body as JSON; ClientError when it is too large or not JSON (NaN included)."""
    size = len(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    if size > max_bytes:
        raise ClientError("message_too_large", f"message is {size} bytes; the limit is {max_bytes}", 413)
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ClientError("bad_json", f"not valid JSON: {str(e)[:200]}") from None


# -----------------------------------------------------------------------------
# The shared state


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
        return dict(
            temperature=c.default_temperature if temperature is None else temperature,
            top_k=c.default_top_k if top_k is None else top_k,
            max_tokens=min(c.default_max_tokens, self.max_new_tokens) if max_tokens is None else max_tokens,
            seed=new_seed() if seed is None else seed,
            top_p=1.0 if top_p is None else top_p,
        )

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
                raise ClientError(
                    "prompt_too_long", f"the prompt is {len(ids)} tokens; the limit is {self.max_prompt_tokens}", 400
                )
            dropped += 2  # one user message and the reply to it

    def submit(self, prompt: list[int], settings: dict, emit) -> Request:
        try:
            return self.scheduler.submit(Request(prompt=prompt, emit=emit, **settings))
        except QueueFull as e:
            raise ClientError("server_busy", str(e), 503) from None
        except (ValueError, RuntimeError) as e:
            raise ClientError(
                "server_busy" if isinstance(e, RuntimeError) else "prompt_too_long", str(e), 503
            ) from None


def thread_emitter(queue: asyncio.Queue, tag=None):
    """An emit callback for the scheduler thread that hands events to this event loop's queue."""
    loop = asyncio.get_running_loop()
    return lambda event: loop.call_soon_threadsafe(queue.put_nowait, (tag, event))


def error_event(reason: str, message: str) -> dict:
    return {"type": "error", "reason": reason, "message": message}
