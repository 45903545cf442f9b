"""The lab's view of the chat server: start `scripts.chat_web` as a user would, stream replies from it over its
OpenAI-compatible SSE route, and time what a client sees (`scripts.bench --what serve`).

- the first minute: the server started with an empty compilation cache, a reply asked for as soon as /health
  answers (while the background compiles run), one as soon as they are done, then the steady state;
- token arrival: when each SSE chunk arrives, how many tokens it carries (the usage count over the chunks) and the
  largest gap between two chunks, i.e. between consecutive tokens a reader sees.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(port: int, path: str, timeout: float = 60.0) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


@contextlib.contextmanager
def chat_web(flags: list[str], cold: bool = True, timeout: float = 600.0):
    """`python -m scripts.chat_web FLAGS` on a free loopback port -> (port, seconds from launch to /health). cold: JAX
    compiles into a fresh, empty persistent cache (JAX_COMPILATION_CACHE_DIR), as on a first start."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="flaxchat-serve-bench-") as cache:
        env = dict(os.environ, **({"JAX_COMPILATION_CACHE_DIR": cache} if cold else {}))
        cmd = [sys.executable, "-m", "scripts.chat_web", "--port", str(port), *flags]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"chat_web exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
                with contextlib.suppress(OSError, ValueError):
                    get_json(port, "/health", timeout=1.0)
                    break
                if time.perf_counter() - t0 > timeout:
                    raise RuntimeError(f"chat_web did not answer /health within {timeout:.0f} s")
                time.sleep(0.05)
            yield port, time.perf_counter() - t0
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()


def stream_reply(port: int, content: str, max_tokens: int, seed: int = 0, temperature: float = 1.0) -> dict:
    """One streamed chat completion -> what its client saw: tokens, seconds to the first chunk, the decode pace
    (tokens after the first over the time they took), SSE chunks with content, tokens per chunk, the largest gap
    between chunks."""
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response, arrivals, usage = conn.getresponse(), [], None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"the server answered with an error: {chunk['error']}")
        if chunk.get("usage"):
            usage = chunk["usage"]
        if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
            arrivals.append(time.perf_counter() - t0)
    conn.close()
    tokens = usage["completion_tokens"] if usage else None
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else None
    return {
        "tokens": tokens,
        "ttft_s": round(arrivals[0], 3) if arrivals else None,
        "s": round(time.perf_counter() - t0, 3),
        "tok_per_s": round((tokens - 1) / span, 1) if tokens and span else None,
        "chunks": len(arrivals),
        "tokens_per_chunk": round(tokens / len(arrivals), 2) if tokens and arrivals else None,
        "max_gap_s": round(max(gaps), 3) if gaps else None,
    }


def first_minute(flags: list[str], content: str, max_tokens: int, steady_runs: int = 3) -> dict:
    """A cold start as a new user meets it: the launch-to-/health time, a reply asked for at once (while programs
    compile in the background), the first reply after the compiles are done, and the median of `steady_runs`
    replies after that (each a fresh seed of the same request)."""
    with chat_web(flags) as (port, ready_s):
        record = {
            "ready_s": round(ready_s, 2),
            "compiling_at_first": get_json(port, "/health").get("programs_compiling"),
        }
        record["first"] = stream_reply(port, content, max_tokens, seed=1)
        t0 = time.perf_counter()
        while get_json(port, "/health").get("programs_compiling"):
            time.sleep(0.2)
        record["compiled_after_s"] = round(ready_s + record["first"]["s"] + time.perf_counter() - t0, 1)
        record["after_compiles"] = stream_reply(port, content, max_tokens, seed=2)
        steady = [stream_reply(port, content, max_tokens, seed=3 + i) for i in range(steady_runs)]
        record["steady"] = sorted(steady, key=lambda r: r["tok_per_s"] or 0)[len(steady) // 2]
    pace = lambda r: r["tok_per_s"] or 0
    record["first_vs_steady"] = round(pace(record["first"]) / max(pace(record["steady"]), 1e-9), 3)
    record["after_vs_steady"] = round(pace(record["after_compiles"]) / max(pace(record["steady"]), 1e-9), 3)
    return record
