"""The lab's view of the chat server: start `scripts.chat_web` as a user would, stream replies from it over its
OpenAI-compatible SSE route, and time what a client sees (`scripts.bench --what serve`).

- the first minute: the server started with an empty compilation cache, a reply asked for as soon as /health
  answers (while the background compiles run), one as soon as they are done, then the steady state;
- token arrival: when each SSE chunk arrives, how many tokens it carries (the usage count over the chunks) and the
  largest gap between two chunks, i.e. between consecutive tokens a reader sees;
- a growing conversation: each turn's time to first token against its last message sent alone, and prefix reuse
  under many clients chatting at once (hits, misses, tokens not prefilled, from /metrics).
"""

from __future__ import annotations

import concurrent.futures
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


def stream_reply(port: int, messages, max_tokens: int, seed: int = 0, temperature: float = 1.0) -> dict:
    """One streamed chat completion of `messages` (or one user message's text) -> what its client saw: the reply's
    text and tokens, the prompt's tokens, seconds to the first chunk, the decode pace (tokens after the first over
    the time they took), SSE chunks with content, tokens per chunk, the largest gap between chunks."""
    messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response, arrivals, usage, text = conn.getresponse(), [], None, []
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"the server answered with an error: {chunk['error']}")
        if chunk.get("usage"):
            usage = chunk["usage"]
        pieces = [c.get("delta", {}).get("content") for c in chunk.get("choices", [])]
        if any(pieces):
            arrivals.append(time.perf_counter() - t0)
            text += [p for p in pieces if p]
    conn.close()
    tokens = usage["completion_tokens"] if usage else None
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else None
    return {
        "text": "".join(text),
        "prompt_tokens": usage["prompt_tokens"] if usage else None,
        "tokens": tokens,
        "ttft_s": round(arrivals[0], 3) if arrivals else None,
        "s": round(time.perf_counter() - t0, 3),
        "tok_per_s": round((tokens - 1) / span, 1) if tokens and span else None,
        "chunks": len(arrivals),
        "tokens_per_chunk": round(tokens / len(arrivals), 2) if tokens and arrivals else None,
        "max_gap_s": round(max(gaps), 3) if gaps else None,
    }


def metric_values(port: int) -> dict:
    """GET /metrics -> {sample name with its labels: value}."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        lines = conn.getresponse().read().decode().splitlines()
    finally:
        conn.close()
    return {n: float(v) for n, v in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))}


SUBJECTS = ("cat", "dog", "fox", "bird", "fish", "frog", "bear", "duck", "horse", "mouse")


def conversation(port: int, turns: int, max_tokens: int) -> dict:
    """One conversation growing by a user message and a greedy reply a turn: each turn's time to first token, then
    the last user message sent alone (the cost of the conversation's history: what prefix reuse takes away)."""
    messages, turn = [], []
    for i in range(turns):
        messages.append({"role": "user", "content": f"Tell me a story about a {SUBJECTS[i % len(SUBJECTS)]}."})
        reply = stream_reply(port, messages, max_tokens, temperature=0.0)
        messages.append({"role": "assistant", "content": reply["text"]})
        turn.append({k: reply[k] for k in ("prompt_tokens", "tokens", "ttft_s")})
    alone = stream_reply(port, messages[-2:-1], max_tokens, temperature=0.0)
    last, first = turn[-1]["ttft_s"], alone["ttft_s"]
    return {"turns": turn, "alone_ttft_s": first, "last_vs_alone": round(last / first, 2) if last and first else None}


def multi_turn_load(port: int, clients: int, turns: int, max_tokens: int) -> dict:
    """`clients` conversations at once, `turns` turns each (sampled replies): the prefix hits, misses and tokens
    saved over the load, from /metrics."""
    before = metric_values(port)

    def client(c: int) -> None:
        messages = []
        for i in range(turns):
            messages.append({"role": "user", "content": f"Client {c} asks question {i + 1}."})
            messages.append({"role": "assistant", "content": stream_reply(port, messages, max_tokens, seed=c)["text"]})

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    after = metric_values(port)
    delta = lambda name: after.get(f"flaxchat_{name}", 0.0) - before.get(f"flaxchat_{name}", 0.0)
    hits, misses = delta("prefix_cache_hits_total"), delta("prefix_cache_misses_total")
    return {
        "clients": clients,
        "turns": turns,
        "s": round(time.perf_counter() - t0, 1),
        "prefix_hits": hits,
        "prefix_misses": misses,
        "hit_rate": round(hits / max(hits + misses, 1), 3),
        "prompt_tokens": delta("prompt_tokens_total"),
        "tokens_saved": delta("prefix_cache_tokens_saved_total"),
    }


def measure(flags: list[str], content: str, max_tokens: int, turns: int = 8, clients: int = 16) -> dict:
    """A cold start as a new user meets it, then the steady state: the launch-to-/health time; a reply asked for at
    once (while programs compile in the background); the first reply after the compiles are done; the median of
    three more (fresh seeds); a conversation of `turns` turns (`conversation`); `clients` conversations of four
    shorter turns at once (`multi_turn_load`; turns=0 or clients=0 leave them out)."""
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
        steady = [stream_reply(port, content, max_tokens, seed=3 + i) for i in range(3)]
        record["steady"] = sorted(steady, key=lambda r: r["tok_per_s"] or 0)[1]
        if turns:
            record["conversation"] = conversation(port, turns, max_tokens)
        if clients:
            record["load"] = multi_turn_load(port, clients, 4, max(8, max_tokens // 3))
    for reply in ("first", "after_compiles", "steady"):
        record[reply].pop("text")
    pace = lambda r: r["tok_per_s"] or 0
    record["first_vs_steady"] = round(pace(record["first"]) / max(pace(record["steady"]), 1e-9), 3)
    record["after_vs_steady"] = round(pace(record["after_compiles"]) / max(pace(record["steady"]), 1e-9), 3)
    return record
