"""The chat page in headless Chromium (Debian's `chromium`, driven by Playwright; no browser is downloaded): type
a message, watch the reply stream in with its calculator call and result, stop with Esc, start a new chat, and
fit a phone's width. The model is scripted (see scripted_model) so the reply is known in advance; its tool
events are also checked over the WebSocket and the OpenAI API, which needs no browser."""

import asyncio
import concurrent.futures
import json
import os
import shutil

import httpx
import jax.numpy as jnp
import pytest
import websockets
from flax import nnx

from flaxchat.generate.scheduler import Scheduler
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT, rms_norm
from flaxchat.serve.app import BackgroundServer, create_app
from flaxchat.serve.server import ServeConfig

CHROMIUM = os.environ.get("FLAXCHAT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def scripted_model(tok, transitions: dict[int, int], seq_len=128, logit=30.0):
    """A fresh model whose next token after token a is (almost surely) transitions[a].

    At initialisation every residual projection is zero, so the final hidden state is the normalised embedding
    of the current token: the model is a bigram table. lm_head rows are set through the pseudo-inverse of those
    hidden states, so each scripted source raises exactly its own successor's logit.
    """
    config = GPTConfig(
        sequence_len=seq_len, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=2, n_embd=64
    )
    model = GPT(config, rngs=nnx.Rngs(0))
    sources = list(transitions)
    dual = jnp.linalg.pinv(rms_norm(model.transformer.wte.weight[...][jnp.array(sources)]))  # (C, n)
    w = model.lm_head.weight[...]
    for j, a in enumerate(sources):
        w = w.at[transitions[a]].add(logit * dual[:, j])
    model.lm_head.weight[...] = w
    return model


@pytest.fixture(scope="module")
def script(tok):
    """Every reply: a calculator call 3*7, its forced output, then ' the sun' over and over until max_tokens."""
    sp = tok.encode_special
    cycle = [tok.encode(" the")[0], tok.encode(" sun")[0]]
    assert all(len(tok.encode(w)) == 1 for w in (" the", " sun"))
    chain = [sp("<|assistant_start|>"), sp("<|python_start|>"), *tok.encode("3*7"), sp("<|python_end|>")]
    sources = chain[:-1] + [sp("<|output_end|>")] + cycle
    assert len(set(sources)) == len(sources)  # a bigram script needs distinct sources
    transitions = dict(zip(chain, chain[1:])) | {sp("<|output_end|>"): cycle[0], cycle[0]: cycle[1], cycle[1]: cycle[0]}
    return transitions


@pytest.fixture(scope="module")
def url(tok, script):
    # a long context, so a reply of 1000 tokens takes long enough to be stopped by a key press
    scheduler = Scheduler(scripted_model(tok, script, seq_len=1024), tok, slots=2, chunk=4)
    config = ServeConfig(max_new_tokens=1000, default_max_tokens=30, rate_limit=0)
    with BackgroundServer(create_app(scheduler, tok, config)) as url:
        yield url


def test_tool_events_over_websocket_and_openai(url):
    async def go():
        async with websockets.connect(url.replace("http://", "ws://") + "/ws") as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "message", "content": "What is 3*7?", "max_tokens": 20}))
            events = []
            while not events or events[-1]["type"] != "done":
                events.append(json.loads(await ws.recv()))
            return events

    # in a thread of its own: Playwright's sync API keeps an event loop running in this one once a page exists
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        events = pool.submit(asyncio.run, asyncio.wait_for(go(), 60)).result()
    assert [(e["kind"], e["text"]) for e in events if e["type"] == "tool"] == [("call", "3*7"), ("output", "21")]
    text = "".join(e["text"] for e in events if e["type"] == "token")
    assert text.startswith(" the sun the sun") and events[-1]["finish_reason"] == "length"
    body = {"messages": [{"role": "user", "content": "What is 3*7?"}], "max_tokens": 14, "temperature": 0}
    content = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]["content"]
    assert content.startswith("\n```python\n3*7\n```\n\n```output\n21\n```\n the sun")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); .ci/install_browser.sh installs it")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the browser comes from apt)")
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 800},
        )
        yield context
        context.close()


@pytest.fixture
def page(browser, url):
    page = browser.new_page()
    frames = []
    page.on("websocket", lambda ws: ws.on("framereceived", lambda payload: frames.append(json.loads(payload))))
    page.frames_received = frames
    page.goto(url)
    page.wait_for_selector("#status[data-state=open]", timeout=30_000)
    yield page
    page.close()


def set_control(page, selector, value):
    if not page.locator("#settings.open").count():
        page.locator("#toggle-settings").click()
    page.locator(selector).fill(str(value))


def test_a_message_streams_a_reply_with_its_tool_call(page, tmp_path):
    set_control(page, "#temperature", 0)
    set_control(page, "#max-tokens", 40)
    page.locator("#input").fill("What is 3*7?")
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.assistant .meta", timeout=60_000)
    assert page.locator(".msg.user .bubble").inner_text() == "What is 3*7?"
    assert page.locator(".tool.call").inner_text().endswith("3*7")
    assert page.locator(".tool.output").inner_text().endswith("21")
    text = page.locator(".msg.assistant .text").inner_text()
    assert text.startswith("the sun the sun") or text.startswith(" the sun the sun")
    assert "40 tokens" in page.locator(".meta").inner_text() and "token limit" in page.locator(".meta").inner_text()
    tokens = [f for f in page.frames_received if f["type"] == "token"]
    assert len(tokens) >= 3  # the reply arrived in pieces, as it was generated
    assert "".join(f["text"] for f in tokens).strip() == text.strip()
    sent = [f for f in page.frames_received if f["type"] == "done"][0]
    assert sent["usage"]["completion_tokens"] == 40
    page.screenshot(path=str(tmp_path / "desktop.png"))
    assert page.locator("#input").evaluate("el => el === document.activeElement")


def test_escape_stops_and_new_chat_clears(page):
    set_control(page, "#max-tokens", 1000)
    page.locator("#input").fill("count forever")
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.assistant .text", timeout=60_000)
    page.keyboard.press("Escape")
    page.wait_for_selector(".msg.assistant .meta", timeout=30_000)
    done = [f for f in page.frames_received if f["type"] == "done"][0]
    assert done["finish_reason"] == "cancelled" and done["usage"]["completion_tokens"] < 1000
    assert "stopped" in page.locator(".meta").inner_text() and page.locator("#send").inner_text() == "Send"
    page.locator("#input").fill("first line")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("second line")
    assert page.locator("#input").input_value() == "first line\nsecond line"  # Shift+Enter is a new line
    assert page.locator(".msg.user").count() == 1
    page.locator("#new-chat").click()
    assert page.locator(".msg").count() == 0 and page.locator("#empty").is_visible()
    for _ in range(100):  # the server acknowledges the reset
        if {"type": "reset"} in page.frames_received:
            break
        page.wait_for_timeout(50)
    assert {"type": "reset"} in page.frames_received


def test_phone_width_fits(browser, url, tmp_path):
    page = browser.new_page()
    page.set_viewport_size({"width": 390, "height": 780})
    try:
        page.goto(url)
        page.wait_for_selector("#status[data-state=open]", timeout=30_000)
        set_control(page, "#max-tokens", 30)  # settings persist in the profile; keep this reply short
        page.locator("#toggle-settings").click()  # and fold the panel away again
        page.locator("#input").fill("What is 3*7?")
        page.locator("#send").click()
        page.wait_for_selector(".msg.assistant .meta", timeout=60_000)
        overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0  # nothing sticks out sideways
        box = page.locator("#send").bounding_box()
        assert box["x"] + box["width"] <= 390 and box["y"] + box["height"] <= 780  # the composer stays on screen
        page.screenshot(path=str(tmp_path / "phone.png"))
    finally:
        page.close()


def test_a_server_with_a_key_asks_for_it_once(browser, tok, script):
    """With --api-key the page asks for the key (a prompt), keeps it for the tab and chats; a wrong key is refused
    and forgotten, so the page asks again."""
    scheduler = Scheduler(scripted_model(tok, script), tok, slots=1, chunk=4)
    config = ServeConfig(default_max_tokens=12, rate_limit=0, api_key="sesame")
    answers, asked = ["wrong", "sesame"], []

    def answer(dialog):
        asked.append(dialog.message)
        dialog.accept(answers.pop(0) if answers else "sesame")

    with BackgroundServer(create_app(scheduler, tok, config)) as key_url:
        page = browser.new_page()
        page.on("dialog", answer)
        try:
            page.goto(key_url)
            page.wait_for_selector("#status[data-state=open]", timeout=30_000)
            page.locator("#input").fill("What is 3*7?")
            page.keyboard.press("Enter")
            page.wait_for_selector(".msg.assistant .meta", timeout=60_000)
            assert len(asked) == 2 and all("API key" in m for m in asked)  # wrong, then right
            assert page.locator(".tool.output").inner_text().endswith("21")
            assert page.evaluate("() => Object.values(sessionStorage)") == ["sesame"]
        finally:
            page.close()
