"""The chat server's per-client limits: a token-bucket rate limiter keyed by client address, and the loopback
test that lets this machine's own user skip it.

ChatServer (server.py) applies them to every generation request, WebSocket or HTTP alike, so that one client
cannot use up the scheduler's slots for everyone else.
"""

from __future__ import annotations

import ipaddress
import time


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
    """Whether a client address is this machine (127.0.0.0/8, ::1); names that are not addresses are not."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "unknown", a test client's name
        return False
