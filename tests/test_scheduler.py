"""Scheduler: continuous batching == one-at-a-time greedy decoding, seeded replies independent of their neighbours,
slot reuse and cancellation, per-row sampling, the tool state machine end to end on a scripted model."""

import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat.data.tokenizer import Tokenizer
from flaxchat.generate.engine import generate
from flaxchat.generate.programs import (
    attention_span,
    bucket_length,
    compiler_options,
    empty_slots,
    pad_prompts,
    programs,
)
from flaxchat.generate.reply import FORCED_CAPACITY, Reply, stop_tokens
from flaxchat.generate.sampling import sample_rows
from flaxchat.generate.scheduler import Request, Scheduler, SpeculativeScheduler
from flaxchat.generate.warmup import Precompiler, batch_rows, variants
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT, rms_norm
from flaxchat.model.quantize import quantize_for_generation

TEXT = ["The cat sat on the mat. 3*7 is 21 and 12+5 is 17. Héllo wörld, naïve café.\n" * 30]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train_from_iterator(iter(TEXT), 320)


def tiny_config(tok, seq_len=64):
    return GPTConfig(
        sequence_len=seq_len,
        vocab_size=tok.get_vocab_size(),
        n_layer=2,
        n_head=2,
        n_kv_head=2,
        n_embd=64,
        window_pattern="SL",
    )


@pytest.fixture(scope="module")
def model(tok):
    return perturbed(GPT(tiny_config(tok), rngs=nnx.Rngs(0)))


def perturbed(model):
    """A random model with every parameter perturbed, so logits are far from uniform and greedy is stable."""
    leaves, treedef = jax.tree.flatten(nnx.state(model, nnx.Param))
    keys = jax.random.split(jax.random.key(1), len(leaves))
    nnx.update(
        model, jax.tree.unflatten(treedef, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    )
    return model


@pytest.fixture(scope="module")
def scheduler(model, tok):
    s = Scheduler(model, tok, slots=4, chunk=4).start()
    yield s
    s.close()


def scripted_model(tok, transitions: dict[int, int], seq_len=64, logit=30.0):
    """A fresh model whose greedy (and, nearly always, sampled) next token after token a is transitions[a].

    At initialisation every residual projection is zero, so the final hidden state is the normalised embedding
    of the current token: the model is a bigram table. lm_head rows are set through the pseudo-inverse of those
    hidden states, so each scripted source raises exactly its own successor's logit.
    """
    model = GPT(tiny_config(tok, seq_len), rngs=nnx.Rngs(0))
    sources = list(transitions)
    hidden = rms_norm(model.transformer.wte.weight[...][jnp.array(sources)])  # (n, C)
    dual = jnp.linalg.pinv(hidden)  # (C, n): hidden @ dual = I
    w = model.lm_head.weight[...]
    for j, a in enumerate(sources):
        w = w.at[transitions[a]].add(logit * dual[:, j])
    model.lm_head.weight[...] = w
    return model


def collect(req_queue: queue.Queue, timeout=60.0) -> list[dict]:
    events, deadline = [], time.monotonic() + timeout
    while True:
        event = req_queue.get(timeout=max(0.1, deadline - time.monotonic()))
        events.append(event)
        if event["type"] in ("done", "error"):
            return events


def wait_finished(req, timeout=30.0):
    """Wait until the scheduler's thread has ended a request (a cancel, queued or running, lands at its next round)."""
    deadline = time.monotonic() + timeout
    while not req.finished and time.monotonic() < deadline:
        time.sleep(0.01)
    return req.finish_reason


def submit(s, prompt, max_tokens, **kw):
    q = queue.Queue()
    return s.submit(Request(prompt=list(prompt), max_tokens=max_tokens, emit=q.put, **kw)), q


def greedy_reference(model, prompt, n, stops):
    """One prompt at a time through the uncached forward pass (padded to the context: causal, so harmless)."""
    T = model.config.sequence_len
    last_logits = nnx.jit(lambda m, ids, i: m(ids)[0, i])
    seq, out = list(prompt), []
    for _ in range(n):
        token = int(jnp.argmax(last_logits(model, jnp.array([seq + [0] * (T - len(seq))]), len(seq) - 1)))
        out.append(token)
        if token in stops:
            break
        seq.append(token)
    return out


# -----------------------------------------------------------------------------


def test_batch_rows_cover_the_highest_active_slot():
    assert [batch_rows(i, 16) for i in (0, 1, 2, 3, 4, 7, 8, 15)] == [1, 2, 4, 4, 8, 8, 16, 16]
    assert batch_rows(5, 6) == 6


SAMPLE = jax.jit(sample_rows)


def draw(logits, n, temperature, top_k, seed=0):
    """n draws from one row of logits (V,): the row repeated n times, one key each."""
    keys = jax.random.split(jax.random.key(seed), n)
    return np.asarray(
        SAMPLE(
            jnp.tile(logits, (n, 1)), keys, jnp.full((n,), temperature, jnp.float32), jnp.full((n,), top_k, jnp.int32)
        )
    )


def test_sample_rows_per_row_settings():
    V = 300
    logits = jax.random.normal(jax.random.key(0), (4, V)) * 3
    keys = jax.random.split(jax.random.key(1), 4)
    tokens = SAMPLE(logits, keys, jnp.array([0.0, 1.0, 1.0, 0.7]), jnp.array([0, 1, 0, 5]))
    assert int(tokens[0]) == int(jnp.argmax(logits[0]))  # greedy, whatever top_k says
    assert int(tokens[1]) == int(jnp.argmax(logits[1]))  # top-1
    top5 = set(np.argsort(-np.asarray(logits[3]))[:5].tolist())
    draws = set(draw(logits[3], 400, 0.7, 5).tolist())
    assert draws <= top5 and len(draws) > 1
    assert len(set(draw(logits[3], 400, 1.0, 0).tolist()) - top5) > 0  # top_k 0: the whole vocabulary


def test_inverse_cdf_sampling_matches_softmax():
    logits = jnp.array([2.0, 1.0, 0.0, -1.0, -30.0])
    n = 20000
    freq = np.bincount(draw(logits, n, 1.0, 0, seed=3), minlength=5) / n
    np.testing.assert_allclose(freq, np.asarray(jax.nn.softmax(logits)), atol=0.015)
    freq = np.bincount(draw(logits, n, 2.0, 3, seed=4), minlength=5) / n
    np.testing.assert_allclose(freq[:3], np.asarray(jax.nn.softmax(logits[:3] / 2.0)), atol=0.015)
    assert freq[3:].sum() == 0  # outside the top 3


def test_top_p_keeps_the_nucleus_per_row():
    logits = jnp.array([2.0, 1.0, 0.0, -1.0, -30.0])  # softmax ~ [.64, .24, .09, .03, 0]
    n = 4000
    keys = jax.random.split(jax.random.key(5), n)
    rows = jnp.tile(logits, (n, 1))
    top_p = jnp.where(jnp.arange(n) % 2 == 0, 0.8, 1.0).astype(jnp.float32)  # 0.8: the top two only
    out = np.asarray(SAMPLE(rows, keys, jnp.ones((n,)), jnp.zeros((n,), jnp.int32), top_p))
    assert set(out[0::2].tolist()) == {0, 1}
    assert len(set(out[1::2].tolist())) >= 3  # top_p 1: no cut for those rows
    freq = np.bincount(out[0::2], minlength=5)[:2] / (n // 2)
    np.testing.assert_allclose(freq, np.asarray(jax.nn.softmax(logits[:2])), atol=0.04)
    tiny = jnp.full((n,), 1e-6, jnp.float32)  # the top token is always kept
    assert set(np.asarray(SAMPLE(rows, keys, jnp.ones((n,)), jnp.zeros((n,), jnp.int32), tiny)).tolist()) == {0}


def test_reply_decodes_split_characters_and_runs_the_tool(tok):
    sp = tok.encode_special
    calls = []
    reply = Reply(tok, lambda expr: calls.append(expr) or "21")
    text = "café é"
    for t in tok.encode(text):  # multi-byte characters come out whole, never as replacement characters
        assert reply.feed(t) == (False, None)
    assert reply.take_events() == [{"type": "token", "text": text}]
    assert reply.feed(sp("<|python_start|>")) == (False, None)
    for t in tok.encode("3*7"):
        reply.feed(t)
    ended, forced = reply.feed(sp("<|python_end|>"))
    assert not ended and calls == ["3*7"]
    assert forced == [sp("<|output_start|>"), *tok.encode("21"), sp("<|output_end|>")]
    for t in forced:
        reply.feed(t)
    reply.feed(tok.encode(" ok")[0])
    assert reply.feed(sp("<|assistant_end|>")) == (True, None)
    parts = reply.finish()
    assert [p["type"] for p in parts] == ["text", "python", "python_output", "text"]
    assert parts[1]["text"] == "3*7" and parts[2]["text"] == "21"
    kinds = [(e["type"], e.get("kind")) for e in reply.take_events()]
    assert kinds == [("tool", "call"), ("tool", "output"), ("token", None)]


def test_continuous_batching_equals_greedy_one_at_a_time(scheduler, model, tok):
    bos = tok.get_bos_token_id()
    prompts = [
        [bos] + tok.encode(t)
        for t in ("The cat", "3*7 is", "Héllo wörld, naïve café. The cat sat on", "12", "mat.", "is 17 and")
    ]
    stops = scheduler.stop_tokens
    # more requests than slots: later ones wait, then reuse freed slots; lengths differ, so slots finish apart
    jobs = [submit(scheduler, p, 6 + 2 * i, temperature=0.0) for i, p in enumerate(prompts)]
    for (req, q), prompt in zip(jobs, prompts):
        events = collect(q)
        assert events[-1]["type"] == "done"
        expected = greedy_reference(model, prompt, req.max_tokens, stops)
        assert req.tokens == expected and req.completion_tokens == len(expected)
        assert events[-1]["finish_reason"] == ("stop" if expected[-1] in stops else "length")
        text = "".join(e["text"] for e in events if e["type"] == "token")
        assert text == "".join(p["text"] for p in req.parts if p["type"] == "text")
    assert scheduler.stats()["active"] == 0


def test_an_int8_model_is_served_like_its_own_greedy_generation(model, tok):
    """chat_web --quantize int8: the scheduler's programs run the int8 weights (compiled with the int8 options)
    and two replies sharing the batch each equal generate() on that model alone."""
    int8 = quantize_for_generation(nnx.clone(model), "int8")
    s = Scheduler(int8, tok, slots=2, chunk=4).start()
    try:
        assert s.programs.options == compiler_options(nnx.state(int8)) == (("xla_cpu_prefer_vector_width", 512),)
        bos = tok.get_bos_token_id()
        prompts = [[bos] + tok.encode(t) for t in ("The cat", "3*7 is")]
        jobs = [submit(s, p, 8, temperature=0.0) for p in prompts]
        for (req, q), prompt in zip(jobs, prompts):
            assert collect(q)[-1]["type"] == "done"
            assert req.tokens == generate(int8, [prompt], 8, temperature=0.0, stop_tokens=s.stop_tokens)[0]
    finally:
        s.close()


def test_a_long_reply_left_in_a_high_slot_moves_down_and_goes_on_unchanged(model, tok):
    """Three short replies end; the long one in slot 3 moves to slot 0 and decodes one row at a time, giving the
    same greedy tokens, and the same sampled tokens as when it ran alone, as if it had never moved."""
    bos = tok.get_bos_token_id()
    prompt = [bos] + tok.encode("3*7 is")

    def serve(shorts, **settings):  # -> (the long request's tokens, rows moved, rows of each decode chunk)
        s, widths = Scheduler(model, tok, slots=4, chunk=4), []
        decode = s.batch.runner.decode
        s.batch.runner.decode = lambda rows, pushes, limit: widths.append(len(rows)) or decode(rows, pushes, limit)
        jobs = [submit(s, [bos] + tok.encode(t), 2, **settings) for t in ("The cat", "12", "mat.")[:shorts]]
        long, q = submit(s, prompt, 24, **settings)
        s.start()  # after every submit: they land in slots 0, 1, ... in order
        try:
            collect(q)
            assert all(collect(q_short)[-1]["type"] == "done" for _, q_short in jobs)
            return long.tokens, s.stats().get("moved", 0), widths
        finally:
            s.close()

    tokens, moved, widths = serve(3, temperature=0.0)
    assert tokens == greedy_reference(model, prompt, 24, stop_tokens(tok))
    assert moved == 1 and widths[0] == 4 and widths[-1] == 1
    tokens, moved, widths = serve(3, temperature=1.0, seed=5)
    assert moved == 1 and widths[-1] == 1
    assert tokens == serve(0, temperature=1.0, seed=5)[0]  # alone in slot 0: never moved


def test_warmup_compiles_every_variant_and_shows_its_progress(model, tok, capsys):
    """warmup compiles every prompt bucket, (rows, span) pair and move count before serving and, asked to, counts
    them on stderr as it goes (a large server's first start compiles for minutes on a GPU); requests then run the
    exact variant they need, compiling nothing."""
    s = Scheduler(model, tok, slots=4, chunk=4)
    assert s.warmup(progress=True) > 0
    keys = variants(4, s.capacity)
    rows = sorted({batch_rows(i, 4) for i in range(4)})
    spans = sorted({attention_span(n, s.capacity) for n in range(1, s.capacity + 1)})
    assert [k[1:] for k in keys if k[0] == "decode"] == [(n, span) for n in rows for span in spans] and len(rows) == 3
    assert [k[1:] for k in keys if k[0] == "move"] == [(m, span) for m in (1, 2, 4) for span in spans]
    buckets = [k[1] for k in keys if k[0] == "prefill"]  # a tail's bucket over each span that can hold it
    assert [k[1:] for k in keys if k[0] == "extend"] == [(T, span) for T in buckets for span in spans if span >= T]
    assert all(s.batch.runner.ahead.program(k) for k in keys)
    total = len(keys)
    err = capsys.readouterr().err
    assert "compiling" in err and f"{total}/{total}" in err
    compiles = []
    listener = lambda event, seconds, **kw: compiles.append(event) if event.startswith("/jax/core/compile") else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    s.start()
    try:
        bos = tok.get_bos_token_id()
        req, q = submit(s, [bos] + tok.encode("The cat"), 6, temperature=0.0)
        assert collect(q)[-1]["type"] == "done" and req.completion_tokens == 6
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        s.close()
    assert compiles == []


def test_serves_with_the_widest_programs_until_the_background_has_compiled_the_rest(model, tok, monkeypatch):
    """warmup_in_background: while the background compiles are held back, requests are served, correctly, by what
    was compiled before serving (the widest programs: every row, the whole cache, the longest prompt bucket; and the
    one-row decodes); once they are done, requests run the narrow programs compiled there (the short bucket, two
    rows, a move) without compiling anything, and the greedy replies are the same."""
    bos = tok.get_bos_token_id()
    prompts = [[bos] + tok.encode(t) for t in ("The cat", "3*7 is")]
    expected = [greedy_reference(model, p, 10, stop_tokens(tok)) for p in prompts]
    s, used, hold = Scheduler(model, tok, slots=2, chunk=4, capacity=32, prefix_reuse=False), [], threading.Event()
    compile_variant, fit = Precompiler.compile, Precompiler.fit

    def held(self, key, options=None, pool=None):  # the background thread's compiles wait
        assert threading.current_thread().name != "flaxchat-compile" or hold.wait(120)
        return compile_variant(self, key, options, pool)

    def fitted(self, kind, *need):  # the variants the runner runs
        key = fit(self, kind, *need)
        used.append(key)
        return key

    monkeypatch.setattr(Precompiler, "compile", held)
    monkeypatch.setattr(Precompiler, "fit", fitted)
    compiles = []
    listener = lambda event, seconds, **kw: compiles.append(event) if event.startswith("/jax/core/compile") else None
    try:
        assert s.warmup_in_background() > 0
        s.start()
        req, q = submit(s, prompts[0], 10, temperature=0.0)
        assert collect(q)[-1]["type"] == "done" and req.tokens == expected[0]
        assert set(used) == {("decode", 1, 32), ("prefill", 32)} and s.stats()["programs_compiling"] == 5
        hold.set()
        assert s.wait_compiled(300) and s.stats()["programs_compiling"] == 0
        used.clear()
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            req, q = submit(s, prompts[0], 10, temperature=0.0)
            assert collect(q)[-1]["type"] == "done" and req.tokens == expected[0]
            assert set(used) == {("decode", 1, 32), ("prefill", 16)}
            short, q_short = submit(s, prompts[0], 3, temperature=0.0)  # ends first: the long one moves down
            long, q_long = submit(s, prompts[1], 10, temperature=0.0)
            assert collect(q_short)[-1]["type"] == collect(q_long)[-1]["type"] == "done"
            assert short.tokens == expected[0][:3] and long.tokens == expected[1]
            assert used[-1] == ("decode", 1, 32) and ("decode", 2, 32) in used and ("move", 1, 32) in used
            assert s.stats()["moved"] == 1
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        assert compiles == []
    finally:
        s.close()


def test_seeded_reply_does_not_depend_on_neighbours(scheduler, tok):
    prompt = [tok.get_bos_token_id()] + tok.encode("The cat sat")
    alone, q = submit(scheduler, prompt, 12, temperature=1.0, top_k=20, seed=7)
    collect(q)
    crowd = [submit(scheduler, prompt[: 2 + i], 12, temperature=1.0, top_k=0, seed=100 + i) for i in range(3)]
    again, q2 = submit(scheduler, prompt, 12, temperature=1.0, top_k=20, seed=7)
    collect(q2)
    for _, q in crowd:
        collect(q)
    assert again.parts == alone.parts and again.completion_tokens == alone.completion_tokens


def test_cancel_frees_the_slot_at_once(scheduler, tok):
    prompt = [tok.get_bos_token_id()] + tok.encode("The cat")
    before = scheduler.stats().get("finished_cancelled", 0)
    longs = [submit(scheduler, prompt, 55, temperature=1.0, seed=i) for i in range(4)]  # every slot busy
    waiting, q_wait = submit(scheduler, prompt, 3, temperature=1.0, seed=9)
    while longs[0][0].completion_tokens == 0:
        time.sleep(0.005)
    assert scheduler.stats()["queued"] == 1
    scheduler.cancel(longs[0][0])
    done = collect(longs[0][1])[-1]
    assert done["finish_reason"] == "cancelled" and done["usage"]["completion_tokens"] < 55
    assert collect(q_wait)[-1]["finish_reason"] in ("length", "stop")  # the freed slot went to the waiting one
    assert not all(req.finished for req, _ in longs[1:])  # ...while the others were still generating
    gone, q_gone = submit(scheduler, prompt, 5, temperature=1.0)
    gone.cancel()  # cancelled while queued (or just admitted): ends without running to its limit
    assert collect(q_gone)[-1]["finish_reason"] == "cancelled"
    ends = []
    for req, q in longs[1:]:
        scheduler.cancel(req)
        ends.append(collect(q)[-1]["finish_reason"])
    assert set(ends) <= {"cancelled", "length", "stop"}
    stats = scheduler.stats()
    # the other long ones may have reached their end while `gone` was collected, before their cancel landed: the
    # count holds the first long one, `gone`, and those the cancel did stop
    assert stats["active"] == 0 and stats["queued"] == 0
    assert stats["finished_cancelled"] == before + 2 + ends.count("cancelled")


def test_a_client_whose_emit_fails_is_dropped(scheduler, tok):
    prompt = [tok.get_bos_token_id()] + tok.encode("The")
    calls = []

    def broken(event):
        calls.append(event)
        raise RuntimeError("socket closed")

    req = scheduler.submit(Request(prompt=prompt, max_tokens=40, emit=broken, temperature=1.0))
    assert wait_finished(req) == "cancelled" and req.completion_tokens < 40
    ok, q = submit(scheduler, prompt, 3, temperature=0.0)  # and the scheduler goes on serving
    assert collect(q)[-1]["type"] == "done"


def test_submit_checks(scheduler, tok):
    with pytest.raises(ValueError, match="at least one token"):
        scheduler.submit(Request(prompt=[], max_tokens=4, emit=print))
    with pytest.raises(ValueError, match="max_tokens"):
        scheduler.submit(Request(prompt=[1], max_tokens=0, emit=print))
    with pytest.raises(ValueError, match="no room"):
        scheduler.submit(Request(prompt=[1] * 64, max_tokens=4, emit=print))
    req = Request(prompt=[1] * 60, max_tokens=50, emit=lambda e: None, top_k=10_000)
    scheduler.cancel(scheduler.submit(req))
    assert req.max_tokens == 4 and req.top_k == 200  # cut to the room left in the context and to MAX_TOP_K
    # ended (at the scheduler's next round) before the next test reads the shared scheduler's counters
    assert wait_finished(req) == "cancelled"


def test_tool_call_end_to_end_on_a_scripted_model(tok):
    sp = tok.encode_special
    expr, after = tok.encode("3*7"), tok.encode(" is the answer")
    chain = [sp("<|assistant_start|>"), sp("<|python_start|>"), *expr, sp("<|python_end|>")]
    tail = [sp("<|output_end|>"), *after, sp("<|assistant_end|>")]
    assert len(set(chain + tail[:-1])) == len(chain) + len(tail) - 1  # a bigram script needs distinct sources
    transitions = dict(zip(chain, chain[1:])) | dict(zip(tail, tail[1:]))
    s = Scheduler(
        scripted_model(tok, transitions), tok, slots=4, chunk=4
    ).start()  # shapes of `scheduler`: no recompiles
    try:
        prompt = [
            tok.get_bos_token_id(),
            sp("<|user_start|>"),
            *tok.encode("what is 3*7?"),
            sp("<|user_end|>"),
            sp("<|assistant_start|>"),
        ]
        jobs = [submit(s, prompt, 40, temperature=t, seed=3) for t in (0.0, 1.0)]
        for req, q in jobs:
            events = collect(q)
            tools = [(e["kind"], e["text"]) for e in events if e["type"] == "tool"]
            assert tools == [("call", "3*7"), ("output", "21")]
            assert events.index(next(e for e in events if e["type"] == "token")) == 2  # text comes after the tool
            assert "".join(e["text"] for e in events if e["type"] == "token") == " is the answer"
            assert events[-1]["finish_reason"] == "stop"
            forced = 2 + len(tok.encode("21"))
            assert req.completion_tokens == len(chain) - 1 + forced + len(after) + 1
            assert req.parts == [
                {"type": "python", "text": "3*7"},
                {"type": "python_output", "text": "21"},
                {"type": "text", "text": " is the answer"},
            ]
        # a tool output waiting to be forced moves with its row: three replies end (by length) at the call's
        # end, the one left in slot 3 moves to slot 0 and its output is forced there
        s2 = Scheduler(s.model, tok, slots=4, chunk=4)
        shorts = [submit(s2, prompt, len(expr) + 2, temperature=0.0) for _ in range(3)]
        req, q = submit(s2, prompt, 40, temperature=0.0)
        s2.start()
        try:
            events = collect(q)
            assert [e["finish_reason"] for _, qs in shorts for e in collect(qs) if e["type"] == "done"] == [
                "length"
            ] * 3
            assert [(e["kind"], e["text"]) for e in events if e["type"] == "tool"] == [
                ("call", "3*7"),
                ("output", "21"),
            ]
            assert "".join(e["text"] for e in events if e["type"] == "token") == " is the answer"
            assert s2.stats()["moved"] == 1
        finally:
            s2.close()
    finally:
        s.close()
    assert FORCED_CAPACITY >= forced


def test_close_fails_waiting_requests(model, tok):
    s = Scheduler(model, tok, slots=1, chunk=2)  # never started: requests only wait
    _, q = submit(s, [1, 2], 4)
    s.close()
    event = q.get(timeout=5)
    assert event["type"] == "error" and event["reason"] == "shutting_down"
    with pytest.raises(RuntimeError, match="shutting down"):
        s.submit(Request(prompt=[1], max_tokens=1, emit=print))


def test_threads_may_submit_concurrently(scheduler, tok):
    prompt = [tok.get_bos_token_id()] + tok.encode("cat")
    results = []

    def worker(i):
        req, q = submit(scheduler, prompt, 4, temperature=1.0, seed=i)
        results.append(collect(q)[-1]["type"])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == ["done"] * 8


def test_speculative_scheduler_greedy_tools_and_cancel(model, tok):
    """--draft-model in chat_web: one conversation at a time, greedy replies equal the model's own (the draft
    is another random model, so it is often rejected), the tool runs, a cancel frees the conversation."""
    draft = GPT(
        GPTConfig(sequence_len=64, vocab_size=tok.get_vocab_size(), n_layer=1, n_head=1, n_kv_head=1, n_embd=32),
        rngs=nnx.Rngs(5),
    )
    s = SpeculativeScheduler(model, tok, draft, draft_steps=3, chunk=4)
    assert s.warmup() > 0
    s.start()
    try:
        bos = tok.get_bos_token_id()
        prompts = [[bos] + tok.encode(t) for t in ("The cat", "3*7 is", "mat.")]
        jobs = [submit(s, p, 9, temperature=0.0) for p in prompts]  # the second and third wait for the first
        for (req, q), prompt in zip(jobs, prompts):
            events = collect(q)
            expected = greedy_reference(model, prompt, req.max_tokens, s.stop_tokens)
            assert req.tokens == expected and events[-1]["type"] == "done"
            assert events[-1]["usage"]["completion_tokens"] == len(expected)
        sampled, q = submit(s, prompts[0], 6, temperature=1.0, top_k=20, seed=4)
        assert collect(q)[-1]["type"] == "done" and sampled.completion_tokens == 6
        long, q = submit(s, prompts[0], 60, temperature=1.0)
        s.cancel(long)
        assert collect(q)[-1]["finish_reason"] == "cancelled" and s.stats()["active"] == 0
        assert s.stats()["draft_steps"] == 3 and s.stats()["slots"] == 1
    finally:
        s.close()
    # the tool: the scripted model with itself as the draft (every proposal accepted)
    sp = tok.encode_special
    expr = tok.encode("3*7")
    chain = [sp("<|assistant_start|>"), sp("<|python_start|>"), *expr, sp("<|python_end|>")]
    tail = [sp("<|output_end|>"), sp("<|assistant_end|>")]
    scripted = scripted_model(tok, dict(zip(chain, chain[1:])) | dict(zip(tail, tail[1:])))
    s = SpeculativeScheduler(scripted, tok, scripted, draft_steps=2, chunk=4).start()
    try:
        req, q = submit(
            s, [bos, sp("<|user_start|>"), sp("<|user_end|>"), sp("<|assistant_start|>")], 30, temperature=0.0
        )
        events = collect(q)
        assert [(e["kind"], e["text"]) for e in events if e["type"] == "tool"] == [("call", "3*7"), ("output", "21")]
        assert events[-1]["finish_reason"] == "stop" and req.tokens[-1] == sp("<|assistant_end|>")
    finally:
        s.close()


def test_chunks_are_as_long_as_the_stream_interval_allows(model, tok):
    """A chunk runs as many decode steps as fit --stream-interval at the measured step time (a newcomer's first chunk
    is one step): a short interval streams every token as it is sampled, a long one runs `chunk` steps a call. The
    reply is the same either way."""
    prompt = [tok.get_bos_token_id()] + tok.encode("The cat")
    replies = []
    for interval, most in ((1e-6, 1), (60.0, 4)):
        s, limits = Scheduler(model, tok, slots=2, chunk=4, stream_interval=interval), []
        decode = s.batch.runner.decode
        s.batch.runner.decode = lambda rows, pushes, limit: limits.append(limit) or decode(rows, pushes, limit)
        s.start()
        try:
            req, q = submit(s, prompt, 13, temperature=0.0)
            assert collect(q)[-1]["type"] == "done" and req.completion_tokens == 13
            assert limits[0] == 1 and set(limits[1:]) == {most}
            assert s.stats()["decode_step_ms"] > 0
            replies.append(req.tokens)
        finally:
            s.close()
    assert replies[0] == replies[1]


# -----------------------------------------------------------------------------
# Prefix reuse


def test_a_tail_prefilled_over_a_span_of_a_long_cache_equals_a_whole_prefill(tok):
    """extend reads and writes only the row's first `span` positions of a longer cache: the row's logits and its
    cache up to the prompt's end are a whole prefill's, the positions past the span and every other row untouched
    (a window layer included)."""
    long = GPT(tiny_config(tok, seq_len=256), rngs=nnx.Rngs(2))
    progs, params = programs(long)
    prompt = [int(t) % 300 + 1 for t in np.random.default_rng(0).integers(0, 10_000, 100)]
    start, width = 40, bucket_length(60, 256)
    span = attention_span(start + width, 256)
    assert span == 128 < 256  # the case that reads a part of the row
    whole = progs.prefill(params, empty_slots(long, 3, 256), np.int32(1), *pad_prompts([prompt], 256))
    slots = progs.prefill(params, empty_slots(long, 3, 256), np.int32(0), *pad_prompts([prompt[:40] + [7] * 9], 256))
    slots = progs.prefill(params, slots, np.int32(1), *pad_prompts([prompt[:start]], 256))
    before = jax.tree.map(np.asarray, slots)
    tokens, length = pad_prompts([prompt[start:]], 256, width=width)
    slots = progs.extend(
        params, slots, np.int32(1), np.int32(start), np.int32(prompt[start - 1]), tokens, length[0], span=span
    )
    slots = jax.tree.map(np.asarray, slots)
    np.testing.assert_allclose(slots.logits[1], whole.logits[1], rtol=2e-5, atol=2e-5)
    assert int(slots.cache.pos[1]) == len(prompt)
    for got, want, old in zip(slots.cache.k, whole.cache.k, before.cache.k):  # (N, Hkv, S, D)
        np.testing.assert_allclose(got[1, :, : len(prompt)], want[1, :, : len(prompt)], rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(got[1, :, span:], old[1, :, span:])
        np.testing.assert_array_equal(got[[0, 2]], old[[0, 2]])
    for got, want, old in zip(slots.cache.v, whole.cache.v, before.cache.v):  # (N, Hkv, D, S)
        np.testing.assert_allclose(got[1, ..., : len(prompt)], want[1, ..., : len(prompt)], rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(got[1, ..., span:], old[1, ..., span:])
        np.testing.assert_array_equal(got[[0, 2]], old[[0, 2]])


def test_a_conversations_next_turn_prefills_only_its_new_tokens(model, tok):
    """Prefix reuse: each turn of a growing conversation continues the row its previous turn left (only the new
    tokens are prefilled), a conversation that diverges mid-way reuses what it shares, and a prompt that is a strict
    prefix of a kept row reuses all but its last token; every greedy reply is the one a server without reuse gives."""
    sp, bos = tok.encode_special, tok.get_bos_token_id()
    user = lambda text: [sp("<|user_start|>"), *tok.encode(text), sp("<|user_end|>"), sp("<|assistant_start|>")]

    def serve(reuse: bool) -> tuple[list[list[int]], dict]:
        s, replies = Scheduler(model, tok, slots=4, chunk=4, prefix_reuse=reuse).start(), []
        try:
            prompt = [bos]
            for text in ("The cat", "12", "mat.", "3*7"):  # a conversation of four turns
                prompt = prompt + user(text)
                req, q = submit(s, prompt, 6, temperature=0.0)
                assert collect(q)[-1]["type"] == "done"
                replies.append(req.tokens)
                prompt = prompt + req.tokens + ([] if req.tokens[-1] in s.stop_tokens else [sp("<|assistant_end|>")])
            for other in (prompt[:-3], prompt[:20] + user("cat")):  # a strict prefix of the kept row; diverging
                req, q = submit(s, other, 5, temperature=0.0)
                assert collect(q)[-1]["type"] == "done"
                replies.append(req.tokens)
            return replies, s.stats()
        finally:
            s.close()

    (with_reuse, stats), (without, plain) = serve(True), serve(False)
    assert with_reuse == without
    assert stats["prefix_hits"] == 5 and stats["prefix_misses"] == 1 and stats["prefix_tokens_saved"] > 60
    assert "prefix_hits" not in plain and plain["prompt_tokens"] == stats["prompt_tokens"]


def test_kept_rows_are_taken_least_recently_used_first(model, tok):
    """With every slot holding a kept row, a newcomer takes the one kept longest ago; the other still serves its
    conversation's next turn. A prompt that shares only its first tokens with a kept row does not take it."""
    bos = tok.get_bos_token_id()
    a, b, c = ([bos] + tok.encode(t) for t in ("The cat sat", "12+5 is", "naive cafe"))
    s, done = Scheduler(model, tok, slots=2, chunk=4).start(), {}
    try:
        for name, prompt in (("a", a), ("b", b), ("c", c)):  # a in slot 0, b in slot 1; c takes slot 0, kept longest
            req, q = submit(s, prompt, 3, temperature=0.0)
            assert collect(q)[-1]["type"] == "done"
            done[name] = prompt + req.tokens
        assert s.stats()["prefix_misses"] == 3 and s.stats()["kept"] == 2
        for name, hits in (("b", 1), ("a", 1)):  # b's next turn continues its row; a's row is gone
            req, q = submit(s, done[name] + [5], 3, temperature=0.0)
            assert collect(q)[-1]["type"] == "done" and s.stats()["prefix_hits"] == hits
        assert s.stats()["prefix_tokens_saved"] == len(done["b"])
    finally:
        s.close()


@pytest.mark.parametrize("capacity", [64, 256])
def test_a_live_row_moved_down_swaps_places_with_a_kept_row(model, tok, capacity):
    """Compacting moves a long reply left in a high slot into a kept row's slot and the kept row up into its place:
    the kept conversation's next turn still continues it, and both replies are greedy's. With a longer cache a move
    copies only the positions the rows hold (a span of 64 of 256)."""
    model = model if capacity == 64 else perturbed(GPT(tiny_config(tok, seq_len=capacity), rngs=nnx.Rngs(0)))
    bos = tok.get_bos_token_id()
    prompts = [[bos] + tok.encode(t) for t in ("The cat", "12", "mat.", "3*7 is")]
    if capacity == 256:  # rows that hold most of the span they are moved over, replies that read all of it
        prompts = [[bos] + np.random.default_rng(0).integers(1, 256, n).tolist() for n in (24, 12, 36, 48)]
    s = Scheduler(model, tok, slots=4, chunk=4)
    jobs = [submit(s, p, n, temperature=0.0) for p, n in zip(prompts, (2, 2, 2, 20))]
    s.start()  # after every submit: slots 0-3 in order; the three short ones end and are kept
    try:
        assert all(collect(q)[-1]["type"] == "done" for _, q in jobs)
        assert s.stats()["moved"] == 1 and s.stats()["kept"] == 4
        assert jobs[3][0].tokens == greedy_reference(model, prompts[3], 20, stop_tokens(tok))
        first, _ = jobs[0]
        req, q = submit(s, prompts[0] + first.tokens + [5], 3, temperature=0.0)
        assert collect(q)[-1]["type"] == "done" and s.stats()["prefix_hits"] == 1
        assert req.tokens == greedy_reference(model, prompts[0] + first.tokens + [5], 3, stop_tokens(tok))
    finally:
        s.close()
