"""The chat server's shared core: its settings (ServeConfig), the refusal every protocol speaks (ClientError), and
ChatServer, the state one app shares between its WebSockets and HTTP routes.

Every generation goes through one `flaxchat.generate.scheduler.Scheduler` (continuous batching over N KV-cache
slots); ChatServer turns a conversation into prompt ids, checks a request against the limits and hands it to the
scheduler. The protocols on top live in websocket.py (the chat page's socket) and openai.py (the HTTP API); the
checks that let the server face a network (key, origins, hosts, per-address caps, deadlines) in security.py.

Limits (ServeConfig): prompt tokens, new tokens per reply, concurrent connections (WebSockets + in-flight HTTP
completions) in all and per client address, message/body bytes, and new tokens asked for per minute per client
address (a token bucket, limits.py). Loopback clients skip the per-address limits unless ServeConfig.limit_loopback.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math

from pydantic import ValidationError

from flaxchat.generate.scheduler import QueueFull, Request, Scheduler, new_seed
from flaxchat.serve.limits import LOOPBACK_HOSTS, RateLimiter, is_loopback
from flaxchat.serve.metrics import Metrics


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    model_name: str = "flaxchat"
    max_prompt_tokens: int | None = None  # None: three quarters of the model's context
    max_new_tokens: int = 512  # most tokens a reply may ask for
    default_max_tokens: int = 256
    default_temperature: float = 0.8
    default_top_k: int = 50
    # who may talk to it (security.py)
    api_key: str | None = dataclasses.field(default=None, repr=False)  # Bearer key for the API and /ws; None: no key
    allowed_origins: tuple[str, ...] = ()  # browser origins besides the page's own and loopback ones ("*": any)
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS  # Host header names served, any port; None: any name
    forwarded_allow_ips: tuple[str, ...] = ()  # proxies whose X-Forwarded-For names the client; (): trust none
    api_docs: bool = False  # serve /docs and /openapi.json
    # how much one client may hold
    max_connections: int = 64  # WebSockets + in-flight HTTP completions, all clients together
    max_connections_per_client: int = 8  # requests and WebSockets one address may hold at once
    max_message_bytes: int = 32 * 1024  # one WebSocket frame or one HTTP body
    max_send_queue: int = 1024  # events waiting for a WebSocket client; one that lets it fill is closed
    idle_timeout: float = 600.0  # s a WebSocket may go without a message while no reply streams (pings don't count)
    auth_timeout: float = 10.0  # s a WebSocket has to send its key
    header_timeout: float = 10.0  # s for an HTTP request's headers to arrive
    body_timeout: float = 10.0  # s for an HTTP request's body to arrive
    rate_limit: float = 20_000.0  # new tokens asked for per minute per client address; 0 turns it off
    rate_burst: int = 8192  # tokens a client may ask for at once
    rate_min_cost: int = 64  # the least a request costs, a refused one included
    limit_loopback: bool = False  # loopback clients (127.0.0.1, ::1: this machine's own user) skip per-client limits


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
        self.limiter = RateLimiter(config.rate_limit, config.rate_burst, refusal_cost=config.rate_min_cost)
        self.connections = 0
        self.closed = collections.Counter()  # WebSockets the server ended, by why: idle, not_reading, unauthorized
        self.metrics = Metrics(self)

    def acquire(self) -> bool:
        if self.connections >= self.config.max_connections:
            return False
        self.connections += 1
        return True

    def release(self) -> None:
        self.connections -= 1

    def limits_apply(self, client: str) -> bool:
        """Whether the per-client limits (rate, connections per address) apply to this address."""
        return self.config.limit_loopback or not is_loopback(client)

    def check_rate(self, client: str, cost: int) -> None:
        """Charge `client` for a request asking for `cost` new tokens (prompts x n x max_tokens; at least
        rate_min_cost). ClientError (429) when its bucket cannot pay, which still costs it rate_min_cost."""
        if not self.limits_apply(client):
            return
        cost = max(int(cost), self.config.rate_min_cost)
        wait = self.limiter.check(client, cost)
        if wait == math.inf:
            raise ClientError(
                "rate_limited", f"this asks for {cost} tokens; one client may ask for {self.limiter.burst} at once", 429
            )
        if wait > 0:
            raise ClientError("rate_limited", f"too many tokens asked for; try again in {wait:.1f} s", 429)

    def charge_refusal(self, client: str) -> None:
        """A refused request (malformed, unauthorized, over a cap) costs its client rate_min_cost tokens."""
        if self.limits_apply(client):
            self.limiter.charge(client, self.config.rate_min_cost)

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
        request = Request(prompt=prompt, **settings)

        def counted(event: dict) -> None:  # the metrics see each request's end, even when its client has gone
            if event["type"] in ("done", "error"):
                self.metrics.observe(request, event)
            emit(event)

        request.emit = counted
        try:
            return self.scheduler.submit(request)
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
