"""The chat server's per-client budget: a token bucket counted in the tokens a client asks the model for, keyed by
client address, and the loopback test that lets this machine's own user skip it.

A request costs what it asks for (prompts x n x max_tokens), not one unit per request: otherwise one request with
forty prompts and n=8 costs the same as "hi". ChatServer (server.py) charges every generation request, WebSocket
or HTTP alike, and every refused request a small minimum, so that hammering the server is never free.
"""

from __future__ import annotations

import ipaddress
import math
import time

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # Host header names that mean this machine


class RateLimiter:
    """A token bucket per client key, in generated tokens: a client may ask for `burst` tokens at once, and its
    bucket refills at `per_minute`. A refused request is still charged `refusal_cost`; a bucket's debt is capped at
    one burst, so a client that stops hammering waits at most about two bursts' worth of refill."""

    def __init__(self, per_minute: float, burst: int, refusal_cost: int = 0):
        self.rate, self.burst, self.refusal_cost = per_minute / 60.0, max(1, burst), refusal_cost
        self.buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, when)

    def _level(self, key: str, now: float) -> float:
        tokens, last = self.buckets.get(key, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - last) * self.rate)

    def check(self, key: str, cost: float) -> float:
        """0 if a request costing `cost` tokens may go ahead (and is charged); else the seconds until it may, or
        inf when it never may (it costs more than a burst). A refused request is charged refusal_cost."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        tokens = self._level(key, now)
        if tokens >= cost:
            self._store(key, tokens - cost, now)
            return 0.0
        tokens = max(tokens - self.refusal_cost, -float(self.burst))
        self._store(key, tokens, now)
        return math.inf if cost > self.burst else (cost - tokens) / self.rate

    def charge(self, key: str, cost: float) -> None:
        """Take `cost` tokens whatever the bucket holds (a refusal decided elsewhere, e.g. a malformed request)."""
        if self.rate > 0:
            now = time.monotonic()
            self._store(key, max(self._level(key, now) - cost, -float(self.burst)), now)

    def _store(self, key: str, tokens: float, now: float) -> None:
        self.buckets[key] = (tokens, now)
        if len(self.buckets) > 10_000:  # forget clients whose buckets are full again
            full = [k for k, (t, s) in self.buckets.items() if t + (now - s) * self.rate >= self.burst]
            for k in full:
                del self.buckets[k]


def is_loopback(host: str) -> bool:
    """Whether a client address is this machine (127.0.0.0/8, ::1); names that are not addresses are not."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "unknown", a test client's name
        return False
