"""Chat server: the WebSocket protocol with a real client, OpenAI-shaped requests (stream and not), limits, many
clients with random disconnects and slot reuse, and a fuzz of malformed messages while others chat."""

import asyncio
import contextlib
import json
import random
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import websockets
from flax import nnx

from flaxchat.generate.scheduler import auto_slots
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT
from flaxchat.serve.app import BackgroundServer, create_app
from flaxchat.serve.openai import StopFilter, reply_text
from flaxchat.serve.server import ClientError, ServeConfig
from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir
from scripts import chat_web
from scripts.chat_web import build_model, get_args, load_test

MAX_BYTES = 2048
LIMITS = dict(max_new_tokens=100, default_max_tokens=12, max_message_bytes=MAX_BYTES)


@pytest.fixture(scope="module")
def url(scheduler, tok):
    app = create_app(scheduler, tok, ServeConfig(rate_limit=0, max_connections=40, **LIMITS), own_scheduler=False)
    with BackgroundServer(app) as url:
        yield url


@pytest.fixture(scope="module")
def strict_url(scheduler, tok):
    """A second app on the same scheduler with tight connection and rate limits."""
    config = ServeConfig(  # the rate limit in tokens: a burst of two one-token replies
        rate_limit=6, rate_burst=2, rate_min_cost=1, max_connections=2, limit_loopback=True, **LIMITS
    )
    with BackgroundServer(create_app(scheduler, tok, config, own_scheduler=False)) as url:
        yield url


def slow_decoding(monkeypatch, scheduler, seconds=0.02):
    """Make each decode chunk take a while longer, so a client can leave while its reply is still running
    (a tiny model on a fast CPU may otherwise finish 100 tokens before the server hears of the disconnect)."""
    decode = scheduler.batch.runner.decode

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return decode(*args, **kwargs)

    monkeypatch.setattr(scheduler.batch.runner, "decode", slow)


def run(coro, timeout=90):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def ws_url(url):
    return url.replace("http://", "ws://") + "/ws"


@contextlib.asynccontextmanager
async def chat(url):
    async with websockets.connect(ws_url(url), max_size=2**22) as ws:
        ready = json.loads(await ws.recv())
        assert ready["type"] == "ready"
        yield ws


async def recv(ws):
    return json.loads(await ws.recv())


async def reply(ws, **message):
    """Send a message and read events up to its done (or error) -> (text, last event, all events)."""
    await ws.send(json.dumps({"type": "message", **message}))
    events = []
    while True:
        event = await recv(ws)
        events.append(event)
        if event["type"] in ("done", "error"):
            return "".join(e.get("text", "") for e in events if e["type"] == "token"), event, events


def health(url):
    return httpx.get(url + "/health").json()


def wait_idle(url, timeout=30):
    """Wait until no slot is busy and no connection is open; returns /health."""
    deadline = time.monotonic() + timeout
    while True:
        h = health(url)
        if (h["active"] == 0 and h["queued"] == 0 and h["connections"] == 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


# -----------------------------------------------------------------------------
# WebSocket protocol


def test_ready_message_and_pages(url):
    async def go():
        async with websockets.connect(ws_url(url)) as ws:
            return json.loads(await ws.recv())

    ready = run(go())
    assert ready["limits"]["max_new_tokens"] == 100 and ready["limits"]["max_prompt_tokens"] == 96
    assert ready["defaults"]["max_tokens"] == 12
    page = httpx.get(url + "/")
    assert page.status_code == 200 and "<textarea" in page.text and "/ws" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # works offline: nothing external
    assert health(url)["status"] == "ok"
    models = httpx.get(url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "flaxchat"


def test_multi_turn_history_and_reset(url):
    async def go():
        async with chat(url) as ws:
            text1, done1, _ = await reply(ws, content="Once upon a time", max_tokens=5, temperature=0.0)
            _, done2, _ = await reply(ws, content="and then?", max_tokens=5, temperature=0.0)
            await ws.send(json.dumps({"type": "reset"}))
            assert await recv(ws) == {"type": "reset"}
            text3, done3, _ = await reply(ws, content="Once upon a time", max_tokens=5, temperature=0.0)
            return text1, done1, done2, text3, done3

    text1, done1, done2, text3, done3 = run(go())
    assert done1["type"] == "done" and done1["usage"]["completion_tokens"] <= 5
    p1 = done1["usage"]["prompt_tokens"]
    assert done2["usage"]["prompt_tokens"] > p1 + 3  # the first exchange is in the second prompt
    assert done3["usage"]["prompt_tokens"] == p1 and text3 == text1  # reset forgot it; greedy repeats itself


def test_stop_ends_the_reply_and_keeps_it(url, scheduler, monkeypatch):
    slow_decoding(monkeypatch, scheduler)  # the stop must arrive while the reply is still running

    async def go():
        async with chat(url) as ws:
            # seeded: this reply runs all 100 tokens when nobody stops it (a random seed may sample a stop token)
            await ws.send(
                json.dumps({"type": "message", "content": "Tell me everything", "max_tokens": 100, "seed": 3})
            )
            first = await recv(ws)
            await ws.send(json.dumps({"type": "stop"}))
            events = [first]
            while events[-1]["type"] != "done":
                events.append(await recv(ws))
            _, after, _ = await reply(ws, content="go on", max_tokens=2)
            return events, after

    events, after = run(go())
    done = events[-1]
    assert done["finish_reason"] == "cancelled" and done["usage"]["completion_tokens"] < 100
    assert after["type"] == "done" and after["usage"]["prompt_tokens"] > done["usage"]["prompt_tokens"]


def test_one_reply_at_a_time(url, scheduler, monkeypatch):
    slow_decoding(monkeypatch, scheduler)  # the stop must arrive while the first reply is still running

    async def go():
        async with chat(url) as ws:
            # seeded as in test_stop_ends_the_reply_and_keeps_it: this reply runs all 100 tokens unless stopped
            await ws.send(
                json.dumps({"type": "message", "content": "Tell me everything", "max_tokens": 100, "seed": 3})
            )
            await ws.send(json.dumps({"type": "message", "content": "another"}))
            events = []
            while not any(e["type"] == "error" for e in events):
                events.append(await recv(ws))
            await ws.send(json.dumps({"type": "stop"}))
            while events[-1]["type"] != "done":
                events.append(await recv(ws))
            return events

    events = run(go())
    errors = [e for e in events if e["type"] == "error"]
    assert len(errors) == 1 and errors[0]["reason"] == "busy"
    assert events[-1]["finish_reason"] == "cancelled"


BAD_FRAMES = [
    ("{not json", "bad_json"),
    ('{"type": "message", "content": "hi"', "bad_json"),
    ('{"type": "message", "content": "hi", "temperature": NaN}', "bad_json"),
    ("[1, 2, 3]", "invalid_message"),
    ('"message"', "invalid_message"),
    ("{}", "invalid_message"),
    ('{"type": "launch"}', "invalid_message"),
    ('{"type": "message"}', "invalid_message"),
    ('{"type": "message", "content": ""}', "invalid_message"),
    ('{"type": "message", "content": 42}', "invalid_message"),
    ('{"type": "message", "content": "hi", "temperature": "hot"}', "invalid_message"),
    ('{"type": "message", "content": "hi", "temperature": 9}', "invalid_message"),
    ('{"type": "message", "content": "hi", "top_k": 1.5}', "invalid_message"),
    ('{"type": "message", "content": "hi", "top_k": 201}', "invalid_message"),
    ('{"type": "message", "content": "hi", "max_tokens": true}', "invalid_message"),
    ('{"type": "message", "content": "hi", "max_tokens": 101}', "invalid_message"),
    ('{"type": "message", "content": "hi", "seed": -1}', "invalid_message"),
    ('{"type": "message", "content": "hi", "role": "system"}', "invalid_message"),
    ('{"type": "stop", "now": true}', "invalid_message"),
    (json.dumps({"type": "message", "content": "x" * MAX_BYTES}), "message_too_large"),
    (json.dumps({"type": "message", "content": "the cat sat on the mat " * 60}), "prompt_too_long"),
    (b'{"type": "message", "content": "bytes"}', "invalid_message"),
]


def test_bad_messages_get_clear_errors_and_the_socket_stays_open(url):
    async def go():
        async with chat(url) as ws:
            answers = []
            for frame, _ in BAD_FRAMES:
                await ws.send(frame)
                answers.append(await recv(ws))
            # seeded: an unseeded reply may sample the end token before its third token
            _, done, _ = await reply(ws, content="still there?", max_tokens=3, seed=3)
            return answers, done

    answers, done = run(go())
    for (frame, reason), answer in zip(BAD_FRAMES, answers):
        assert answer["type"] == "error" and answer["reason"] == reason, (frame, answer)
        assert len(answer["message"]) > 10
    by_reason = {a["message"] for a in answers}
    assert any("temperature" in m for m in by_reason) and any("Extra inputs" in m for m in by_reason)
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == 3


def fuzz_frames(rng: random.Random, n: int) -> list:
    """n malformed frames: broken JSON, wrong shapes and types, unknown fields and types, oversize, binary."""
    good = {"type": "message", "content": "hello", "max_tokens": 4}
    wrong_values = {
        "content": [None, 5, [], {}, "", True],
        "temperature": ["x", -1, 3, "1", [1]],
        "top_k": [-1, 1.5, "5", 10**6, False],
        "max_tokens": [0, -5, 10**30, "8", 2.5, 1000],
        "seed": [-1, 2**70, "s", 1.0],
        "type": [None, 1, "MESSAGE", "", ["message"]],
    }
    frames = []
    while len(frames) < n:
        kind = rng.randrange(9)
        if kind == 0:
            frames.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))).decode("latin-1"))
        elif kind == 1:
            text = json.dumps(good)
            frames.append(text[: rng.randrange(1, len(text) - 1)])
        elif kind == 2:
            frames.append(json.dumps(rng.choice([[], [good], 1, -2.5, "message", None, True])))
        elif kind == 3:
            key = rng.choice(list(wrong_values))
            frames.append(json.dumps({**good, key: rng.choice(wrong_values[key])}))
        elif kind == 4:
            frames.append(json.dumps({**good, rng.choice(["role", "evil", "Content", "stream", "__proto__"]): 1}))
        elif kind == 5:
            frames.append(json.dumps({"type": rng.choice(["shutdown", "eval", "stop!", "reset ", "tokens"])}))
        elif kind == 6:
            frames.append(json.dumps({**good, "content": "a" * rng.randrange(MAX_BYTES, 3 * MAX_BYTES)}))
        elif kind == 7:
            depth = rng.randrange(200, 1800)  # under uvicorn's frame cap (see the next test)
            frames.append("[" * depth + "]" * depth if rng.random() < 0.5 else '{"a":' * depth + "1" + "}" * depth)
        else:
            frames.append(json.dumps(good).encode())  # a binary frame
    return frames


def test_fuzz_malformed_messages_while_others_chat(url):
    frames = fuzz_frames(random.Random(0), 300)

    async def fuzzer():
        async with chat(url) as ws:
            errors = 0
            for frame in frames:
                await ws.send(frame)
                event = await recv(ws)
                assert event["type"] == "error", (frame[:80], event)
                errors += 1
            return errors

    async def chatter(i):
        async with chat(url) as ws:
            dones = []
            for j in range(4):
                text, done, _ = await reply(ws, content=f"message {j} from {i}", max_tokens=8)
                assert done["type"] == "done", done
                dones.append(done)
            return dones

    async def go():
        return await asyncio.gather(fuzzer(), *(chatter(i) for i in range(3)))

    failures_before = health(url).get("failures", 0)
    errors, *dones = run(go(), timeout=120)
    assert errors == len(frames)  # one error for every malformed frame
    for done in (d for ds in dones for d in ds):  # every well-formed request got its whole reply
        assert done["finish_reason"] in ("length", "stop")
        assert done["finish_reason"] == "stop" or done["usage"]["completion_tokens"] == 8
    h = wait_idle(url)
    assert h["status"] == "ok" and h.get("failures", 0) == failures_before and h["active"] == 0


def test_a_huge_frame_closes_only_its_own_socket(url):
    """Frames far past the limit (over 4x) are cut off by uvicorn itself with close code 1009; nobody else notices."""

    async def go():
        async with chat(url) as other, chat(url) as ws:
            await ws.send(json.dumps({"type": "message", "content": "x" * (8 * MAX_BYTES)}))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            return closed.value.rcvd.code, (await reply(other, content="fine?", max_tokens=2))[1]

    code, done = run(go())
    assert code == 1009 and done["usage"]["completion_tokens"] == 2


def test_many_clients_random_disconnects_and_slot_reuse(url, scheduler, monkeypatch):
    slow_decoding(monkeypatch, scheduler)
    rng = random.Random(1)
    plans = [rng.choice(["finish", "stop", "vanish"]) for _ in range(16)]
    before = health(url)

    async def client(i, plan):
        ws = await websockets.connect(ws_url(url))
        await recv(ws)
        max_tokens = 20 + i
        await ws.send(
            json.dumps(
                {"type": "message", "content": f"client {i}", "max_tokens": max_tokens, "temperature": 1.0, "seed": i}
            )
        )
        event = await recv(ws)
        if plan == "vanish":  # drop the TCP connection without a closing handshake
            ws.transport.abort()
            return None
        if plan == "stop":
            await ws.send(json.dumps({"type": "stop"}))
        while event["type"] != "done":
            event = await recv(ws)
        await ws.close()
        return plan, event, max_tokens

    async def go():
        return await asyncio.gather(*(client(i, p) for i, p in enumerate(plans)))

    results = run(go())
    for result in filter(None, results):
        plan, done, max_tokens = result
        if plan == "finish":
            assert done["finish_reason"] in ("length", "stop")
            assert done["finish_reason"] == "stop" or done["usage"]["completion_tokens"] == max_tokens
        else:
            assert done["finish_reason"] in ("cancelled", "length", "stop")
    after = wait_idle(url)
    assert after["active"] == 0 and after["queued"] == 0 and after["connections"] == 0  # every slot came back
    assert after["admitted"] - before.get("admitted", 0) == 16  # 16 conversations went through 4 slots
    vanished = plans.count("vanish")
    cancelled = after.get("finished_cancelled", 0) - before.get("finished_cancelled", 0)
    assert cancelled >= vanished // 2  # replies of vanished clients stop early (most are still running then)

    async def still_serving():
        async with chat(url) as ws:
            # greedy: a sampled reply may end at the end token before its 4th token
            return (await reply(ws, content="after the storm", max_tokens=4, temperature=0.0))[1]

    assert run(still_serving())["usage"]["completion_tokens"] == 4


# -----------------------------------------------------------------------------
# Limits


def test_connection_limit(strict_url):
    async def go():
        async with chat(strict_url), chat(strict_url):
            async with websockets.connect(ws_url(strict_url)) as third:
                event = json.loads(await third.recv())
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await third.recv()
            status = await asyncio.to_thread(
                lambda: httpx.post(
                    strict_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                )
            )
            return event, closed.value.rcvd.code, status

    event, code, response = run(go())
    assert event["reason"] == "too_many_connections" and code == 1013
    assert response.status_code == 503 and response.json()["error"]["code"] == "too_many_connections"


def test_rate_limit(strict_url):
    async def go():
        async with chat(strict_url) as ws:
            results = [await reply(ws, content="hi", max_tokens=1) for _ in range(3)]
            return [r[1] for r in results]

    events = run(go())
    assert [e["type"] for e in events[:2]] == ["done", "done"]  # the burst
    assert events[2]["reason"] == "rate_limited" and "try again in" in events[2]["message"]
    r = httpx.post(strict_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"


def test_loopback_clients_are_not_rate_limited_by_default(scheduler, tok):
    app = create_app(scheduler, tok, ServeConfig(**LIMITS), own_scheduler=False)
    with BackgroundServer(app) as url:

        async def go():
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                return await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=body) for _ in range(16)))

        assert [r.status_code for r in run(go())] == [200] * 16
        h = wait_idle(url)
        assert h["slots"] == scheduler.slots and h["utilisation"] == 0.0 and "queued" in h
    server = app.state.chat
    server.check_rate("::1", 10**6)  # loopback: whatever it asks for
    for _ in range(ServeConfig().rate_burst // 512):
        server.check_rate("203.0.113.7", 512)  # another machine: a burst's worth of tokens, then the limit
    with pytest.raises(ClientError) as e:
        server.check_rate("203.0.113.7", 512)
    assert e.value.status == 429


def test_auto_slots_fit_the_memory(scheduler):
    model, c = scheduler.model, scheduler.model.config
    per_slot = 2 * c.n_layer * c.sequence_len * c.n_kv_head * c.head_dim * jnp.dtype(model.dtype).itemsize
    assert auto_slots(model, memory=10**15)[0] == 32
    assert auto_slots(model, memory=per_slot * 4 * 5)[0] == 4  # a quarter of the memory holds 5: a power of two
    assert auto_slots(model, memory=1)[0] == 1
    slots, why = auto_slots(model)
    assert 1 <= slots <= 32 and "slots" in why


# -----------------------------------------------------------------------------
# OpenAI-compatible HTTP


def completion(url, **body):
    body.setdefault("messages", [{"role": "user", "content": "Why is the sky blue?"}])
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def sse_events(text: str) -> list:
    lines = [line for line in text.split("\n\n") if line.strip()]
    assert all(line.startswith("data: ") for line in lines)
    return [line[len("data: ") :] for line in lines]


def test_openai_non_stream_and_stream_agree(url):
    r = completion(url, model="gpt-4o", max_tokens=10, temperature=0.0)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == "flaxchat"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("length", "stop")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] <= 10

    r = completion(url, max_tokens=10, temperature=0.0, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = sse_events(r.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert streamed == choice["message"]["content"]  # greedy: the same reply both ways


def test_openai_multi_turn_with_system_and_parts(url):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "python", "text": "1+1"}, {"type": "python_output", "text": "2"}]},
        {"role": "user", "content": "and 2+2?"},
    ]
    r = completion(url, messages=messages, max_completion_tokens=3, seed=5, top_k=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


@pytest.mark.parametrize(
    "body, status, code",
    [
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "invalid_message"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "warm"}, 400, "invalid_message"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 2.5}, 400, "invalid_message"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "invalid_message"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 9}, 400, "invalid_message"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": "2"}, 400, "invalid_message"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "invalid_message"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400, "invalid_message"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_message"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": 3}, 400, "invalid_message"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": [""]}, 400, "invalid_message"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "stream": True}, 400, "invalid_message"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
            400,
            "invalid_message",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "seed": -1}, 400, "invalid_message"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 101}, 400, "invalid_message"),
        ({"messages": []}, 400, "invalid_message"),
        ({"messages": [{"role": "tool", "content": "hi"}]}, 400, "invalid_message"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            400,
            "invalid_message",
        ),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, 400, "invalid_message"),
        ({"messages": [{"role": "user", "content": "the cat sat on the mat " * 60}]}, 400, "prompt_too_long"),
        ({"messages": [{"role": "user", "content": "x" * MAX_BYTES}]}, 413, "message_too_large"),
        ("{broken", 400, "bad_json"),
        ([1, 2], 400, "invalid_message"),
    ],
)
def test_openai_errors(url, body, status, code):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url + "/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert error["code"] == code and error["message"] and error["type"] == "invalid_request_error"


def test_openai_accepts_and_ignores_fields_it_does_not_use(url):
    r = completion(
        url,
        max_tokens=3,
        presence_penalty=0.5,
        frequency_penalty=0.1,
        logit_bias={"5": 2},
        user="u1",
        logprobs=False,
        top_logprobs=0,
        response_format={"type": "text"},
        parallel_tool_calls=False,
        service_tier="auto",
        store=False,
        metadata={"k": "v"},
        modalities=["text"],
        tools=[],
        messages=[{"role": "user", "content": "hi", "tool_calls": None, "refusal": None}],
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_openai_max_completion_tokens_wins_and_tiny_top_p_is_greedy(url):
    r = completion(url, max_tokens=10, max_completion_tokens=2, temperature=0.0)
    assert r.json()["usage"]["completion_tokens"] <= 2
    greedy = completion(url, max_tokens=12, temperature=0.0).json()["choices"][0]["message"]["content"]
    for seed in range(3):  # top_p tiny keeps only the most likely token, whatever the temperature and seed
        r = completion(url, max_tokens=12, temperature=1.5, top_p=1e-6, seed=seed)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == greedy


def _greedy_reply(url, n_tokens=20):
    return completion(url, max_tokens=n_tokens, temperature=0.0).json()["choices"][0]["message"]["content"]


def test_openai_stop_strings_end_the_reply(url):
    text = _greedy_reply(url)
    assert len(text) >= 6, text
    stop = text[3:6]
    first = text.find(stop)
    r = completion(url, max_tokens=20, temperature=0.0, stop=[stop, "\u2603never"])
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == text[:first] and choice["finish_reason"] == "stop"
    r = completion(url, max_tokens=20, temperature=0.0, stop=stop, stream=True)
    chunks = [json.loads(d) for d in sse_events(r.text)[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == text[:first] and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    r = completion(url, max_tokens=20, temperature=0.0, stop="\u2603never")  # never matched: the whole reply
    assert r.json()["choices"][0]["message"]["content"] == text


def test_stop_filter_holds_back_a_possible_prefix():
    f = StopFilter(["END", "xyz"])
    assert f.feed("abcE") == "abc"  # "E" may begin END
    assert f.feed("N") == ""
    assert f.feed("x") == "EN"  # "ENx" is not END, but "x" may begin xyz
    assert f.held == "x"
    assert f.feed("q") == "xq"
    assert f.feed("1EN") == "1" and f.feed("D2") == "" and f.stopped
    g = StopFilter(["ab"])
    assert g.feed("za") == "z" and g.flush() == "a"


def test_openai_n_choices_are_seeded_requests(url):
    body = dict(max_tokens=8, temperature=1.0, seed=11)
    r = completion(url, n=3, **body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    singles = [completion(url, **{**body, "seed": 11 + i}).json() for i in range(3)]
    assert [c["message"]["content"] for c in r["choices"]] == [s["choices"][0]["message"]["content"] for s in singles]
    assert r["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    assert r["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    s = completion(url, n=2, stream=True, stream_options={"include_usage": True}, **body)
    chunks = [json.loads(d) for d in sse_events(s.text)[:-1]]
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content", "") for c in mine) == r["choices"][i]["message"]["content"]
        assert mine[-1]["finish_reason"] == r["choices"][i]["finish_reason"]
    assert chunks[-1]["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles[:2])


def test_legacy_completions_score_prompts_like_the_model(url, scheduler, tok):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    text = "the cat sat on the mat"
    r = client.completions.create(model="flaxchat", prompt=text, echo=True, logprobs=1, max_tokens=0)
    choice = r.choices[0]
    ids = [tok.get_bos_token_id()] + tok.encode(text)  # read after <|bos|>: every word of the text is scored
    logp = np.asarray(jax.nn.log_softmax(scheduler.model(jnp.asarray([ids]))[0], axis=-1))
    expected = [logp[i - 1, ids[i]] for i in range(1, len(ids))]
    lp = choice.logprobs
    assert choice.text == text and lp.token_logprobs[0] is None and "".join(lp.tokens) == "<|bos|>" + text
    np.testing.assert_allclose(lp.token_logprobs[1:], expected, atol=1e-4)
    assert lp.top_logprobs[0] is None and all(1 <= len(d) <= 2 for d in lp.top_logprobs[1:])  # the chosen too
    best = [tok.decode([int(logp[i - 1].argmax())]) for i in range(1, len(ids))]
    assert [next(iter(d)) for d in lp.top_logprobs[1:]] == best
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0

    # token ids and a list of prompts; generation with n, seed, stop; echo prepends the prompt
    r = client.completions.create(model="m", prompt=[ids, ids[:3]], max_tokens=5, temperature=0.0, n=2, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("<|bos|>" + text) and r.choices[0].text == r.choices[1].text  # greedy
    assert r.usage.prompt_tokens == len(ids) + 3 and 0 < r.usage.completion_tokens <= 20
    plain = client.completions.create(model="m", prompt=text, max_tokens=5, temperature=0.0)
    assert r.choices[0].text == "<|bos|>" + text + plain.choices[0].text
    assert plain.choices[0].finish_reason in ("length", "stop")
    # streaming (the official client's iterator): the same text as the plain reply, then usage
    chunks = list(
        client.completions.create(
            model="m",
            prompt=text,
            max_tokens=5,
            temperature=0.0,
            stream=True,
            echo=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text + plain.choices[0].text
    assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens and not chunks[-1].choices
    for bad in (
        dict(logprobs=6),
        dict(prompt=[]),
        dict(prompt=[10**9]),
        dict(stream=True),
        dict(stream=True, max_tokens=2, prompt=[ids, ids]),
        dict(max_tokens=-1),
    ):
        body = {"prompt": text, "max_tokens": 0, "echo": True, **bad}
        resp = httpx.post(url + "/v1/completions", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error", (bad, resp.text)


def test_openai_fuzz_never_breaks_the_server(url):
    rng = random.Random(2)
    statuses = []
    for frame in fuzz_frames(rng, 60):
        if isinstance(frame, str):
            frame = frame.encode("utf-8", "surrogatepass")
        statuses.append(httpx.post(url + "/v1/chat/completions", content=frame).status_code)
    assert all(400 <= s < 500 for s in statuses), statuses
    assert completion(url, max_tokens=2).status_code == 200


def test_stream_disconnect_frees_the_slot(url, scheduler, monkeypatch):
    # 100 tokens take 2 s: time to hear of the disconnect under load
    slow_decoding(monkeypatch, scheduler, seconds=0.08)
    before = health(url).get("finished_cancelled", 0)
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "go"}], "stream": True, "max_tokens": 100, "temperature": 0.0},
    ) as r:  # greedy: a sampled reply may end at the end token first
        lines = r.iter_lines()
        next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
    h = wait_idle(url)
    assert h["active"] == 0 and h["connections"] == 0
    assert h.get("finished_cancelled", 0) == before + 1, h


def test_tool_events_read_as_fenced_blocks():
    assert reply_text({"type": "token", "text": "hi"}) == "hi"
    assert reply_text({"type": "tool", "kind": "call", "text": "3*7"}) == "\n```python\n3*7\n```\n"
    assert reply_text({"type": "tool", "kind": "output", "text": "21"}) == "\n```output\n21\n```\n"


# -----------------------------------------------------------------------------
# The script


def test_help_says_each_default_once():
    """Each flag's help names its default at most once, whether the help says it in its own words or the formatter
    adds it; a flag that is simply off by default says nothing."""
    import re

    text = " ".join(chat_web.build_parser().format_help().split())
    entries = re.split(r" (?=--?[a-z][\w-]* )", text)
    assert not [e for e in entries if e.lower().count("default:") > 1]
    assert "port to listen on (default: 8000)" in text and "(default: 3/4 of the context)" in text
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: ())" not in text


def test_script_flags_and_random_init(tiny_base_dir, url):
    for bad in (["--slots", "0"], ["--port", "70000"], ["--top-k", "500"], ["--load-test", "1,x"]):
        with pytest.raises(SystemExit):
            get_args(bad)
    args = get_args(["--random-init", "--depth", "2", "--seq-len", "64", "--slots", "3", "--load-test", "1,4"])
    assert args.load_test == [1, 4] and args.host == "127.0.0.1" and args.port == 8000
    model, tokenizer, name = build_model(args)
    assert model.config.vocab_size == tokenizer.get_vocab_size() == 512 and model.config.n_layer == 2
    assert name == "d2-random-init"
    result = run(load_test(url, 3, 6))
    assert result["clients"] == 3 and result["tokens"] <= 18 and result["tok_per_s"] > 0


def test_chat_web_serves_with_a_draft_model(tiny_base_dir, tok, monkeypatch):
    """--draft-model: the speculative scheduler behind the same app; a load test's replies stream through it."""
    config = GPTConfig(sequence_len=64, vocab_size=tok.get_vocab_size(), n_layer=1, n_head=1, n_kv_head=1, n_embd=32)
    ckpt = Checkpointer(checkpoint_dir("sft", "d1"), async_save=False)
    ckpt.save(1, GPT(config, rngs=nnx.Rngs(0)))
    ckpt.close()
    printed = []  # main's own lines (uvicorn's log handlers would outlive a capture fixture's streams)
    monkeypatch.setattr(
        chat_web, "print", lambda *a, file=None, **kw: printed.append((file, " ".join(map(str, a)))), raising=False
    )
    monkeypatch.setattr(chat_web, "load_test_in_subprocess", chat_web.run_load_test)  # clients in this process
    monkeypatch.setattr(chat_web, "enable_compilation_cache", lambda path: None)  # process-wide otherwise
    flags = ["-i", "sft", "-g", "d1", "--draft-model", "d1", "--draft-steps", "2", "--no-warmup"]
    assert chat_web.main([*flags, "--load-test", "2", "--load-tokens", "4", "--load-repeats", "1"]) == 0
    out = [line for f, line in printed if f is None]
    assert any("speculative sampling: draft d1 (1 layers) proposes 2 tokens" in line for line in out)
    summary = json.loads(out[-1])
    assert summary["slots"] == 1 and summary["median_tok_per_s"]["2"] > 0
    for bad, message in ((["--slots", "4"], "one conversation at a time"), (["--draft-model", "rl:d1"], "rl")):
        printed.clear()
        assert chat_web.main([*flags, *bad]) == 1
        errors = [line for f, line in printed if f is not None]
        assert len(errors) == 1 and message in errors[0] and "\n" not in errors[0]


def prometheus_samples(text: str) -> dict:
    """Prometheus text format -> {'name{labels}': value} (comments left out)."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_count_requests_tokens_latencies_and_prefix_reuse(scheduler, tok):
    """GET /metrics, Prometheus' text format: requests by outcome, tokens in and out, the latency histograms, and a
    conversation's second turn counted as a prefix hit with the tokens it did not prefill, as /health reports them."""
    app = create_app(scheduler, tok, ServeConfig(rate_limit=0, **LIMITS), own_scheduler=False)
    with BackgroundServer(app) as url:
        before = prometheus_samples(httpx.get(url + "/metrics").text)
        messages = [{"role": "user", "content": "The cat"}]
        body = lambda messages: {"messages": messages, "max_tokens": 5, "temperature": 0.0}
        first = httpx.post(url + "/v1/chat/completions", json=body(messages), timeout=60).json()
        messages += [first["choices"][0]["message"], {"role": "user", "content": "and then?"}]
        second = httpx.post(url + "/v1/chat/completions", json=body(messages), timeout=60).json()
        response = httpx.get(url + "/metrics")
        assert response.headers["content-type"].startswith("text/plain; version=")
        after = prometheus_samples(response.text)
        health = httpx.get(url + "/health").json()
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)
    finished = sum(delta(f'flaxchat_requests_total{{outcome="{o}"}}') for o in ("stop", "length"))
    assert finished == 2 and delta("flaxchat_time_to_first_token_seconds_count") == 2
    generated = first["usage"]["completion_tokens"] + second["usage"]["completion_tokens"]
    assert delta("flaxchat_generation_tokens_total") == generated
    prompt = first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"]
    assert delta("flaxchat_prompt_tokens_total") == prompt
    assert delta("flaxchat_prefix_cache_hits_total") == 1
    assert 0 < delta("flaxchat_prefix_cache_tokens_saved_total") < second["usage"]["prompt_tokens"]
    assert after["flaxchat_prefix_cache_hits_total"] == health["prefix_hits"]
    assert after["flaxchat_slots"] == 4 and after["flaxchat_queue_length"] == 0
    assert delta("flaxchat_request_duration_seconds_sum") > 0


def test_after_the_demo_chat_web_finds_its_model_and_says_so(tiny_base_dir, tok, capsys):
    """The README's `chat_web -i sft` right after the laptop demo: the demo's model, in <base dir>/tinystories, is
    loaded (with the demo's tokenizer), and one line on stderr says so."""
    demo = tiny_base_dir / "tinystories"
    tok.save(str(demo / "tokenizer"))
    config = GPTConfig(sequence_len=64, vocab_size=tok.get_vocab_size(), n_layer=1, n_head=1, n_kv_head=1, n_embd=32)
    ckpt = Checkpointer(checkpoint_dir("sft", "demo-d4", str(demo)), async_save=False)
    ckpt.save(5, GPT(config, rngs=nnx.Rngs(0)))
    ckpt.close()
    model, tokenizer, name = build_model(get_args(["-i", "sft"]))
    assert name == "demo-d4-sft-step5" and model.config.n_embd == 32
    err = capsys.readouterr().err.strip()
    assert err == f"chat_web: none in {tiny_base_dir}; the laptop demo's model: sft demo-d4 step 5 in {demo}"
