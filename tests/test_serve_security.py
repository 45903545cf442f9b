"""Exposing the chat server: each way a web page, a greedy client or a spoofed header could misuse it, tried against
a real uvicorn server around a tiny model and refused: foreign origins, simple cross-site POSTs, foreign Host names
(DNS rebinding), missing keys, one address holding every connection, idle and dripping clients, clients that never
read, requests whose cost is their work, and X-Forwarded-For from untrusted peers."""

import asyncio
import contextlib
import json
import select
import socket
import time

import httpx
import openai
import pytest
import websockets

from flaxchat.serve.app import BackgroundServer, create_app, uvicorn_config
from flaxchat.serve.limits import LOOPBACK_HOSTS, RateLimiter
from flaxchat.serve.security import key_matches, origin_allowed
from flaxchat.serve.server import ChatServer, ServeConfig
from flaxchat.serve.websocket import ChatSession
from scripts.chat_web import exposure, get_args

LIMITS = dict(max_new_tokens=100, default_max_tokens=4, max_message_bytes=2048)
KEY = "correct-horse-battery"


@contextlib.contextmanager
def serve(scheduler, tok, **config):
    """A server with these ServeConfig fields -> (url, its ChatServer)."""
    app = create_app(scheduler, tok, ServeConfig(**{**LIMITS, **config}), own_scheduler=False)
    with BackgroundServer(app) as url:
        yield url, app.state.chat


def run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def ws_url(url):
    return url.replace("http://", "ws://") + "/ws"


def chat_body(**body):
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}


def post(url, path="/v1/chat/completions", body=None, **headers):
    headers.setdefault("Content-Type", "application/json")
    content = json.dumps(chat_body() if body is None else body)
    return httpx.post(url + path, content=content, headers=headers, timeout=60)


async def first_frames(url, n=1, **connect):
    """The first n frames a new WebSocket gets."""
    async with websockets.connect(ws_url(url), **connect) as ws:
        frames = [json.loads(await ws.recv()) for _ in range(n)]
        return frames


async def closed_after(ws, frames=None):
    """Read frames until the server closes the socket -> (frames, close code, close reason)."""
    frames = [] if frames is None else frames
    with pytest.raises(websockets.ConnectionClosed) as closed:
        while True:
            frames.append(json.loads(await ws.recv()))
    return frames, closed.value.rcvd.code, closed.value.rcvd.reason


def raw_socket(url):
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def drip(sock, byte: bytes, seconds=5.0, every=0.1) -> tuple[bytes, float]:
    """Send one byte every `every` s until the server answers (or closes) -> (what it sent until EOF, elapsed)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if select.select([sock], [], [], every)[0]:
            break
        with contextlib.suppress(OSError):
            sock.send(byte)
    answer = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(4096):
            answer += chunk
    return answer, time.monotonic() - t0


# -----------------------------------------------------------------------------
# (a) who may talk to it: origins, content types, hosts, the key, the docs


def test_a_foreign_origin_cannot_open_the_socket_or_post(scheduler, tok):
    with serve(scheduler, tok, allowed_origins=("https://app.example",)) as (url, _):
        with pytest.raises(websockets.InvalidStatus) as refused:
            run(first_frames(url, origin="http://evil.example"))
        assert refused.value.response.status_code == 403
        port = url.rsplit(":", 1)[1]
        for origin in (None, f"http://127.0.0.1:{port}", "http://localhost:3000", "https://app.example"):
            assert run(first_frames(url, origin=origin))[0]["type"] == "ready", origin
        r = post(url, Origin="http://evil.example")
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_origin"
        assert post(url, Origin=f"http://127.0.0.1:{port}").status_code == 200
    assert origin_allowed("http://chat.example:8000", "chat.example:8000", ())  # the page's own origin
    assert not origin_allowed("null", "127.0.0.1:8000", ())  # sandboxed frames and files
    assert not origin_allowed("http://127.0.0.1.evil.example", "127.0.0.1:8000", ())


def test_a_simple_cross_site_post_is_refused(scheduler, tok):
    """A page may POST text/plain (or a form) anywhere without a CORS preflight; /v1 answers only JSON."""
    with serve(scheduler, tok) as (url, _):
        admitted = scheduler.stats()["admitted"]
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = post(url, **{"Content-Type": content_type})
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", content_type
        r = httpx.post(url + "/v1/completions", content=b'{"prompt": "hi"}')  # no Content-Type at all
        assert r.status_code == 415
        assert scheduler.stats()["admitted"] == admitted  # nothing was generated
        assert post(url, **{"Content-Type": "application/json; charset=utf-8"}).status_code == 200


def test_a_foreign_host_is_refused(scheduler, tok):
    """DNS rebinding: a page whose name now points at 127.0.0.1 sends its own name as Host."""
    with serve(scheduler, tok, allowed_hosts=LOOPBACK_HOSTS + ("chat.example",)) as (url, _):
        port = url.rsplit(":", 1)[1]
        assert httpx.get(url + "/health", headers={"Host": f"evil.example:{port}"}).status_code == 400
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "chat.example"):
            assert httpx.get(url + "/health", headers={"Host": host}).status_code == 200, host
        sock = raw_socket(url)  # a WebSocket handshake with the rebound name
        sock.sendall(
            b"GET /ws HTTP/1.1\r\nHost: evil.example\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        assert sock.recv(4096).startswith(b"HTTP/1.1 400")
        sock.close()
    with serve(scheduler, tok, allowed_hosts=None) as (url, _):  # --host 0.0.0.0 without --allowed-hosts
        assert httpx.get(url + "/health", headers={"Host": "anything.example"}).status_code == 200


def test_the_api_key_guards_http(scheduler, tok):
    with serve(scheduler, tok, api_key=KEY) as (url, _):
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
            r = post(url, **headers)
            error = r.json()["error"]
            assert r.status_code == 401 and error["code"] == "invalid_api_key", headers
            assert error["type"] == "invalid_request_error" and r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/metrics").status_code == 401  # what the server does is the operator's to read
        metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert metrics.status_code == 200 and "flaxchat_requests_total" in metrics.text
        assert post(url, Authorization=f"Bearer {KEY}").status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        assert client.completions.create(model="m", prompt="the cat", max_tokens=2).usage.completion_tokens <= 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
        assert httpx.get(url + "/health").json() == {"status": "ok"}  # no model name, no load figures
        full = httpx.get(url + "/health", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert full["model"] == "flaxchat" and "slots" in full
        page = httpx.get(url + "/")  # the page itself is public; it asks for the key
        assert page.status_code == 200 and "auth_required" in page.text and "sessionStorage" in page.text
    assert KEY not in repr(ServeConfig(api_key=KEY))  # never printed with the settings
    assert key_matches(KEY, KEY) and not key_matches(KEY[:-1], KEY) and not key_matches(None, KEY)


def test_the_api_key_guards_the_socket(scheduler, tok):
    async def go(url):
        async with websockets.connect(ws_url(url)) as ws:  # no key: asked for one; a message instead is refused
            assert json.loads(await ws.recv()) == {"type": "auth_required"}
            await ws.send(json.dumps({"type": "message", "content": "hi"}))
            no_key = await closed_after(ws)
        async with websockets.connect(ws_url(url)) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "auth", "key": "wrong-key"}))
            wrong = await closed_after(ws)
        async with websockets.connect(ws_url(url)) as ws:  # the page's way: the key in the first frame
            await ws.recv()
            await ws.send(json.dumps({"type": "auth", "key": KEY}))
            ready = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "message", "content": "hi", "max_tokens": 2}))
            while (done := json.loads(await ws.recv()))["type"] != "done":
                pass
        header = await first_frames(url, additional_headers={"Authorization": f"Bearer {KEY}"})  # a script's way
        async with websockets.connect(ws_url(url)) as ws:  # and one that never sends a key
            silent = await closed_after(ws)
        return no_key, wrong, ready, done, header, silent

    with serve(scheduler, tok, api_key=KEY, auth_timeout=0.5) as (url, server):
        no_key, wrong, ready, done, header, silent = run(go(url))
        for frames, code, _ in (no_key, wrong):
            assert frames[-1]["reason"] == "unauthorized" and code == 1008
        assert ready["type"] == "ready" and done["usage"]["completion_tokens"] <= 2
        assert header[0]["type"] == "ready"
        assert silent[0][-1]["reason"] == "unauthorized" and silent[1] == 1008
        assert server.closed["unauthorized"] == 3


def test_api_docs_are_off_unless_asked_for(scheduler, tok):
    with serve(scheduler, tok) as (url, _):
        assert httpx.get(url + "/openapi.json").status_code == 404 and httpx.get(url + "/docs").status_code == 404
    with serve(scheduler, tok, api_docs=True) as (url, _):
        assert httpx.get(url + "/openapi.json").json()["info"]["title"] == "flaxchat"
        assert httpx.get(url + "/docs").status_code == 200


# -----------------------------------------------------------------------------
# (b) one address cannot lock everyone out: a cap per address, idle sockets, dripping bodies, slow headers


def test_one_address_cannot_take_every_connection(scheduler, tok):
    """Two addresses behind a trusted proxy: the first fills its own cap; the second is still served."""
    config = dict(max_connections_per_client=2, limit_loopback=True, forwarded_allow_ips=("127.0.0.1",))

    async def go(url):
        a = {"additional_headers": {"X-Forwarded-For": "203.0.113.1"}}
        async with websockets.connect(ws_url(url), **a), websockets.connect(ws_url(url), **a):
            async with websockets.connect(ws_url(url), **a) as third:
                refused = await closed_after(third)
            http = await asyncio.to_thread(post, url, **{"X-Forwarded-For": "203.0.113.1"})
            other = await first_frames(url, additional_headers={"X-Forwarded-For": "203.0.113.2"})
            other_http = await asyncio.to_thread(post, url, **{"X-Forwarded-For": "203.0.113.2"})
            return refused, http, other, other_http

    with serve(scheduler, tok, **config) as (url, _):
        (frames, code, _), http, other, other_http = run(go(url))
        assert frames[-1]["reason"] == "too_many_connections" and code == 1013
        assert http.status_code == 429 and http.json()["error"]["code"] == "too_many_connections"
        assert other[0]["type"] == "ready" and other_http.status_code == 200


def test_an_idle_socket_is_closed_even_when_it_answers_pings(scheduler, tok):
    async def go(url):
        async with websockets.connect(ws_url(url)) as ws:
            await ws.recv()
            t0 = time.monotonic()

            async def pings():
                while True:
                    await asyncio.sleep(0.1)
                    with contextlib.suppress(websockets.ConnectionClosed):
                        await ws.ping()

            pinger = asyncio.create_task(pings())
            frames, code, reason = await closed_after(ws)
            pinger.cancel()
            return frames, code, reason, time.monotonic() - t0

    with serve(scheduler, tok, idle_timeout=0.5) as (url, server):
        frames, code, reason, elapsed = run(go(url))
        assert frames[-1]["reason"] == "idle_timeout" and code == 1000 and reason == "idle"
        assert 0.4 < elapsed < 5 and server.closed["idle"] == 1


def test_a_dripping_body_is_dropped_and_holds_no_slot(scheduler, tok):
    with serve(scheduler, tok, body_timeout=0.5, max_connections=2, limit_loopback=True) as (url, _):
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        drippers = [raw_socket(url) for _ in range(3)]
        for sock in drippers:
            sock.sendall(head + b"Content-Length: 500\r\n\r\n{")
        assert post(url).status_code == 200  # more drippers than the server has slots: nobody else notices
        answers = [drip(sock, b" ") for sock in drippers]
        for answer, elapsed in answers:
            assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer and elapsed < 4
        assert post(url).status_code == 200


def test_unfinished_headers_are_cut_off(scheduler, tok):
    async def late_message(url):  # a WebSocket outlives the header deadline: it only covers the headers
        async with websockets.connect(ws_url(url)) as ws:
            await ws.recv()
            await asyncio.sleep(1.0)
            await ws.send(json.dumps({"type": "message", "content": "hi", "max_tokens": 2}))
            while (event := json.loads(await ws.recv()))["type"] != "done":
                pass
            return event

    with serve(scheduler, tok, header_timeout=0.5) as (url, _):
        silent, slow = raw_socket(url), raw_socket(url)
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        answer, elapsed = drip(slow, b"x")
        assert answer.startswith(b"HTTP/1.1 408") and elapsed < 4
        answer, elapsed = drip(silent, b"")  # never sends a byte: closed without a word
        assert answer == b"" and elapsed < 4
        with httpx.Client() as client:  # a keep-alive client's next request is not cut
            assert client.get(url + "/health").status_code == 200
            time.sleep(0.7)
            assert client.get(url + "/health").status_code == 200
        assert run(late_message(url))["type"] == "done"


# -----------------------------------------------------------------------------
# (c) a client that never reads


class StuckSocket:
    """A WebSocket whose client sends malformed frames as fast as they are read, and never reads a frame itself."""

    def __init__(self):
        self.headers, self.received = {}, 0

    async def receive(self):
        self.received += 1
        await asyncio.sleep(0)
        return {"type": "websocket.receive", "text": "{not json"}

    async def send_text(self, text):
        await asyncio.Event().wait()

    async def close(self, code=1000, reason=None):
        await asyncio.Event().wait()


def test_a_client_that_does_not_read_holds_a_bounded_queue(scheduler, tok):
    server = ChatServer(scheduler, tok, ServeConfig(max_send_queue=16))
    ws = StuckSocket()
    session = ChatSession(server, ws, "203.0.113.9")
    run(session.run(), timeout=20)  # returns: the server ended the socket
    assert session.out.qsize() <= 16 and session.out.overflowed.is_set()
    assert ws.received <= 16 + 3  # it stopped reading the client once the queue was full
    assert server.closed["not_reading"] == 1


def test_a_client_that_does_not_read_is_closed(scheduler, tok):
    async def go(url, server):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, quickly full
        sock.connect((host, int(port)))
        # reads one frame, then stops; uncompressed, so that the server's kernel buffers (megabytes) fill quickly
        ws = await websockets.connect(ws_url(url), sock=sock, max_queue=1, compression=None)
        sent, deadline = 0, time.monotonic() + 90
        while not server.closed["not_reading"] and time.monotonic() < deadline:
            try:  # each frame is answered with an error event it never reads
                for _ in range(200):
                    await asyncio.wait_for(ws.send("{not json"), 5)
            except (websockets.ConnectionClosed, TimeoutError):
                break
            sent += 200
            await asyncio.sleep(0.02)  # let the server's thread catch up
        ws.transport.abort()
        return sent

    with serve(scheduler, tok, max_send_queue=32) as (url, server):
        sent = run(go(url, server), timeout=120)
        deadline = time.monotonic() + 10
        while server.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.closed["not_reading"] == 1 and server.connections == 0, sent


# -----------------------------------------------------------------------------
# (d) the rate limit counts the work asked for, refusals included


def test_the_rate_limiter_counts_tokens_and_refusals():
    limiter = RateLimiter(per_minute=6, burst=300, refusal_cost=10)  # 0.1 token/s: no refill to speak of
    assert limiter.check("a", 200) == 0 and limiter.check("a", 100) == 0
    assert limiter.check("a", 50) > 400  # empty: refused, and charged 10 more
    assert limiter.buckets["a"][0] == pytest.approx(-10, abs=0.1)
    for _ in range(100):
        limiter.check("a", 50)  # hammering: each refusal costs, down to one burst of debt
    assert limiter.buckets["a"][0] == pytest.approx(-300, abs=0.1)
    assert limiter.check("b", 301) == float("inf")  # more than a burst can never go
    assert RateLimiter(0, 1).check("a", 10**9) == 0  # off


def test_requests_cost_prompts_times_n_times_tokens(scheduler, tok):
    async def ws_reply(url, max_tokens):
        async with websockets.connect(ws_url(url)) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "message", "content": "hi", "max_tokens": max_tokens}))
            while (event := json.loads(await ws.recv()))["type"] not in ("done", "error"):
                pass
            return event

    config = dict(rate_limit=0.6, rate_burst=300, rate_min_cost=10, limit_loopback=True)  # next to no refill
    with serve(scheduler, tok, **config) as (url, server):
        level = lambda: server.limiter.buckets["127.0.0.1"][0]
        r = post(url, "/v1/completions", {"prompt": ["the cat", "a dog"], "n": 2, "max_tokens": 40})
        assert r.status_code == 200 and level() == pytest.approx(300 - 2 * 2 * 40, abs=1)
        assert post(url, body=chat_body(n=2, max_tokens=30)).status_code == 200
        assert level() == pytest.approx(140 - 2 * 30, abs=1)
        assert run(ws_reply(url, 50))["type"] == "done" and level() == pytest.approx(30, abs=1)
        refused = run(ws_reply(url, 40))  # 40 > 30: refused, and that costs the minimum
        assert refused["reason"] == "rate_limited" and level() == pytest.approx(20, abs=1)
        assert post(url, body={"messages": "not a list"}).status_code == 400  # a malformed request costs too
        assert level() == pytest.approx(10, abs=1)
        big = post(url, "/v1/completions", {"prompt": ["hi"] * 40, "n": 8, "max_tokens": 50})
        assert big.status_code == 429 and "at once" in big.json()["error"]["message"]  # 16,000 tokens in one
        assert level() == pytest.approx(0, abs=1)  # it could never go, and asking cost the minimum too
        assert run(ws_reply(url, 5))["reason"] == "rate_limited"


# -----------------------------------------------------------------------------
# (e) X-Forwarded-For counts only from a trusted proxy


def test_forwarded_for_is_ignored_unless_the_peer_is_a_trusted_proxy(scheduler, tok):
    config = dict(rate_limit=6, rate_burst=10, rate_min_cost=1, limit_loopback=True)

    def rotating(url):
        return [post(url, body=chat_body(max_tokens=4), **{"X-Forwarded-For": f"203.0.113.{i}"}) for i in range(5)]

    with serve(scheduler, tok, **config) as (url, server):
        assert [r.status_code for r in rotating(url)] == [200, 200, 429, 429, 429]  # one bucket: the real peer's
        assert set(server.limiter.buckets) == {"127.0.0.1"}
        assert uvicorn_config(create_app(scheduler, tok, own_scheduler=False), "127.0.0.1", 0).proxy_headers is False
    with serve(scheduler, tok, forwarded_allow_ips=("127.0.0.1",), **config) as (url, server):
        assert [r.status_code for r in rotating(url)] == [200] * 5  # five clients behind the proxy, each its own
        assert set(server.limiter.buckets) == {f"203.0.113.{i}" for i in range(5)}


# -----------------------------------------------------------------------------
# The script's flags


def test_chat_web_security_flags(monkeypatch):
    local = exposure(get_args([]))
    assert local["allowed_hosts"] == LOOPBACK_HOSTS and local["api_key"] is None and not local["api_docs"]
    assert local["forwarded_allow_ips"] == () and local["max_connections_per_client"] == 8
    public = exposure(get_args(["--host", "0.0.0.0"]))
    assert public["allowed_hosts"] is None  # names unknown: the key and the origin check still apply
    flags = ["--host", "0.0.0.0", "--allowed-hosts", "Chat.Example.com,::1", "--allowed-origins", "https://a.example/"]
    named = exposure(get_args([*flags, "--forwarded-allow-ips", "10.0.0.2", "--api-docs", "--idle-timeout", "30"]))
    assert named["allowed_hosts"] == LOOPBACK_HOSTS + ("chat.example.com", "[::1]")
    assert named["allowed_origins"] == ("https://a.example",) and named["forwarded_allow_ips"] == ("10.0.0.2",)
    assert named["api_docs"] and named["idle_timeout"] == 30
    monkeypatch.setenv("FLAXCHAT_API_KEY", KEY)
    assert get_args([]).api_key == KEY and get_args(["--api-key", "another-key"]).api_key == "another-key"
    for bad in (["--api-key", "short"], ["--idle-timeout", "0"], ["--max-connections-per-client", "0"]):
        with pytest.raises(SystemExit):
            get_args(bad)
