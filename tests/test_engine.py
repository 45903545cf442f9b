"""Engine: cached decode == full forward at every step, jitted loop == naive loop, row independence, stop tokens,
sampling filters, streaming == one loop, tool injection (mock model), speculative sampling (greedy identity and
distribution, under any rule, one compile for every rule)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat import sharding
from flaxchat.data.tokenizer import Tokenizer
from flaxchat.generate import speculative
from flaxchat.generate.engine import COMPACT_MIN_ROWS, Engine, generate
from flaxchat.generate.programs import DecodeSettings, attention_span, bucket_length, controls, pad_prompts, programs
from flaxchat.generate.sampling import (
    TOP_K_TIERS,
    argmax,
    inverse_cdf,
    rule_probs,
    sample_next_token,
    traced_rule_probs,
)
from flaxchat.generate.speculative import generate_speculative
from flaxchat.generate.speculative import programs as speculative_programs
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT, KVCache, with_stacked_qkv
from flaxchat.perf.measure import measure_generation

TEXT = ["The cat sat on the mat. 2+2 is 4 and 6*7 is 42. print(6*7) gives 42.\n" * 20]


def make_model(config, seed, scale):
    """A GPT whose every parameter is N(0, scale): logits far from uniform and no path left at zero. Built
    abstractly and filled from numpy, which is much faster than compiling nanochat's initialisation."""
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    fill = lambda x: jnp.asarray(rng.normal(0.0, scale, x.shape).astype(np.float32))
    nnx.update(model, jax.tree.map(fill, nnx.state(model)))
    return model


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train_from_iterator(iter(TEXT), 300)


@pytest.fixture(scope="module")
def model(tok):
    config = GPTConfig(
        sequence_len=64,
        vocab_size=tok.get_vocab_size(),
        n_layer=2,
        n_head=2,
        n_kv_head=1,
        n_embd=64,
        window_pattern="SL",
    )
    model = make_model(config, 0, 0.3)
    model.window_sizes = [8, 64]  # a window shorter than the sequences, so the cached path must honour it
    return model


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 30))]  # different lengths share one padded prefill


@nnx.jit
def full_forward(model, idx):
    return model(idx)


def naive_greedy(model, prompt, n, width=64):
    """Argmax of a full (uncached) forward over the whole sequence, once per token (right padding is causal-safe)."""
    seq = list(prompt)
    for _ in range(n):
        logits = full_forward(model, jnp.array([seq + [0] * (width - len(seq))]))[0, len(seq) - 1]
        seq.append(int(jnp.argmax(logits)))
    return seq[len(prompt) :]


def test_bucket_and_padding():
    assert [bucket_length(n, 512) for n in (1, 16, 17, 100, 300, 511)] == [16, 16, 32, 128, 512, 512]
    assert bucket_length(40, 48) == 48
    tokens, lengths = pad_prompts([[5, 6, 7], [1]], 64)
    assert tokens.shape == (2, 16) and lengths.tolist() == [3, 1]
    assert tokens[0].tolist() == [5, 6, 7] + [7] * 13  # padded with the row's last token
    with pytest.raises(ValueError, match="no room"):
        pad_prompts([list(range(60))], 64, max_new_tokens=10)
    with pytest.raises(ValueError, match="at least one token"):
        pad_prompts([[1], []], 64)


def test_cached_logits_equal_full_forward_every_step(model):
    """Padded prefill of different-length rows, then one decode step per call: the logits the loop samples from
    equal a full forward over each row's whole sequence so far. The cache has room for 1024 positions and each
    call attends over only the span its rows use (an extracted part), flushed back at the end."""
    progs, params = programs(model)
    tokens, lengths = pad_prompts(PROMPTS, 1024, 24)
    slots = progs.start(params, tokens, lengths, copies=1, rows=3, capacity=1024)
    cached, spans, columns = [], set(), []
    span = attention_span(max(map(len, PROMPTS)) + 24, 1024)
    part = progs.extract(slots, rows=3, span=span)
    for step in range(24):
        cached.append(np.array(part.logits))  # a copy: the next call donates the part
        spans.add(part.extent[1])
        ctl = controls(3, remaining=24 - step, offset=step, temperature=0.0)
        part, out = progs.decode(params, part, ctl, np.int32(1), settings=DecodeSettings(chunk=1))
        assert int(out.steps) == 1 and not np.asarray(out.forced).any()
        columns.append(np.asarray(out.tokens)[:, 0])
    slots = progs.flush(slots, part)
    assert spans == {64} and slots.cache.k[0].shape[2] == 1024  # 64 of 1024 positions read
    assert np.asarray(slots.cache.pos).tolist() == [len(p) + 24 for p in PROMPTS]
    columns = np.stack(columns, axis=1)
    for b, prompt in enumerate(PROMPTS):
        seq = prompt + columns[b, :23].tolist()
        full = np.asarray(full_forward(model, jnp.array([seq + [0] * (64 - len(seq))]))[0])
        for step in range(24):
            np.testing.assert_allclose(cached[step][b], full[len(prompt) - 1 + step], atol=2e-5)


def test_greedy_loop_equals_naive_loop(model):
    out = generate(model, PROMPTS, 20, temperature=0.0)
    for prompt, row in zip(PROMPTS, out):
        assert row == naive_greedy(model, prompt, 20)


def test_rows_are_independent_and_seeded(model):
    a = generate(model, PROMPTS, 16, temperature=1.0, seed=3)
    b = generate(model, [PROMPTS[0], [42, 43], [99] * 19], 16, temperature=1.0, seed=3)
    assert a[0] == b[0]  # row 0's draws depend on the seed and its own tokens, not on the other rows
    assert a == generate(model, PROMPTS, 16, temperature=1.0, seed=3)  # same seed, same tokens
    assert a != generate(model, PROMPTS, 16, temperature=1.0, seed=4)
    greedy = generate(model, PROMPTS, 16, temperature=0.0)
    assert generate(model, PROMPTS[::-1], 16, temperature=0.0) == greedy[::-1]  # a row's place does not matter


def test_stop_tokens_end_rows(model):
    free = generate(model, PROMPTS, 20, temperature=0.0)
    stop = free[0][5]
    out = generate(model, PROMPTS, 20, temperature=0.0, stop_tokens=(stop,))
    for row, ref in zip(out, free):
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert row == ref[:cut]  # up to and including the first stop token, other rows untouched
    assert out[0][-1] == stop and len(out[0]) <= 6


def test_sampling_filters():
    logits = jnp.log(jnp.array([[0.05, 0.4, 0.3, 0.2, 0.05]] * 4000))
    key = jax.random.key(0)
    sample = jax.jit(sample_next_token, static_argnums=(2, 3, 4))
    assert set(np.asarray(sample(logits, key, 0.0)).tolist()) == {1}
    top2 = np.asarray(sample(logits, key, 1.0, 2))
    assert set(top2.tolist()) == {1, 2} and abs(np.mean(top2 == 1) - 0.4 / 0.7) < 0.03
    nucleus = np.asarray(sample(logits, key, 1.0, None, 0.75))  # 0.4 + 0.3 reach 0.7 < 0.75: keep 3
    assert set(nucleus.tolist()) == {1, 2, 3}
    full = np.bincount(np.asarray(sample(logits, key, 1.0)), minlength=5) / 4000
    np.testing.assert_allclose(full, [0.05, 0.4, 0.3, 0.2, 0.05], atol=0.03)
    w = jnp.array([0.0, 1.0, 0.0, 3.0])  # zero weights are never drawn, even at the ends of [0, 1)
    assert [int(inverse_cdf(w, jnp.float32(u))) for u in (0.0, 0.2499, 0.25, 1 - 2**-24)] == [1, 1, 3, 3]
    assert argmax(jnp.array([[1.0, 5.0, 5.0], [2.0, 0.0, 1.0]])).tolist() == [1, 0]  # first of ties
    with pytest.raises(ValueError, match="temperature"):
        sample_next_token(logits, key, -1.0)
    with pytest.raises(ValueError, match="top_k"):
        sample_next_token(logits, key, 1.0, top_k=0)


def test_engine_stream_equals_one_loop(model, tok):
    """Streaming (chunks of 1, 2, 4, ... steps) yields exactly the tokens one while_loop makes, per row."""
    engine = Engine(model, tok, stream_chunk=4)
    prompt = [tok.get_bos_token_id()] + tok.encode("The cat sat on the mat, 2+2 is 4. Hello there, Bob!")
    stream = list(engine.generate(prompt, num_samples=3, max_tokens=20, temperature=1.0, top_k=50, seed=7))
    assert all(len(col) == 3 and mask == [1, 1, 1] for col, mask in stream)
    rows = [[col[i] for col, _ in stream] for i in range(3)]
    ref = generate(model, [prompt] * 3, 20, temperature=1.0, top_k=50, seed=7, stop_tokens=engine.stop_tokens)
    assert [r[: len(x)] for r, x in zip(rows, ref)] == ref
    assert len({tuple(r) for r in rows}) > 1  # samples differ
    results, masks = engine.generate_batch(prompt, num_samples=3, max_tokens=20, temperature=1.0, top_k=50, seed=7)
    assert [r[len(prompt) :] for r in results] == [[t for t in x if t not in engine.stop_tokens] for x in ref]
    assert all(len(r) == len(m) for r, m in zip(results, masks))


# -----------------------------------------------------------------------------
# Tool use, with a mock model that follows a script


class NoEmbedding(nnx.Module):
    """The embedding speculative sampling reads when it rewinds a cache: nothing to smear in a scripted model."""

    def __init__(self):
        self.wte = lambda tokens, dtype: jnp.zeros(tokens.shape + (2,), dtype)


class ScriptedModel(nnx.Module):
    """Mock model: after absolute position p it puts all mass on script[p + 1], whatever the tokens are."""

    def __init__(self, script, vocab_size, sequence_len=64):
        self.transformer = NoEmbedding()
        self.config = GPTConfig(
            sequence_len=sequence_len, vocab_size=vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=2
        )
        self.script = nnx.Variable(jnp.asarray(script + [script[-1]] * (sequence_len + 1 - len(script)), jnp.int32))
        self.dtype = jnp.float32  # the compute dtype the engine casts parameters to

    def init_cache(self, batch_size, max_len):
        k, v = (jnp.zeros((batch_size, 1, max_len, 1)),), (jnp.zeros((batch_size, 1, 1, max_len)),)  # one layer
        return KVCache(k=k, v=v, pos=jnp.zeros((batch_size,), jnp.int32), prev_embedding=jnp.zeros((batch_size, 2)))

    def forward_cached(self, idx, cache, logits_at=None, fresh=False):
        B, T = idx.shape
        positions = cache.pos[:, None] + jnp.arange(T)[None, :]
        if logits_at is not None:
            positions = jnp.take_along_axis(positions, logits_at[:, None], axis=1)[:, 0]
        logits = 100.0 * jax.nn.one_hot(self.script[...][positions + 1], self.config.vocab_size)
        return logits, dataclasses.replace(cache, pos=cache.pos + T)


def tool_script(tok, code: str, forced_len: int):
    """A prompt and a scripted reply that calls the tool with `code`; where the tool's output (forced_len
    tokens) goes, the script says "Z", so the output can only appear if the engine forces it."""
    sp = tok.encode_special
    prompt = [
        tok.get_bos_token_id(),
        sp("<|user_start|>"),
        *tok.encode("hi"),
        sp("<|user_end|>"),
        sp("<|assistant_start|>"),
    ]
    call = [sp("<|python_start|>"), *tok.encode(code), sp("<|python_end|>")]
    after = [*tok.encode(" The cat"), sp("<|assistant_end|>")]
    reply = call + tok.encode("Z") * forced_len + after
    return prompt, call, after, reply


def test_tool_injection_with_mock_model(tok):
    sp = tok.encode_special
    forced = [sp("<|output_start|>"), *tok.encode("4"), sp("<|output_end|>")]
    prompt, call, after, reply = tool_script(tok, "2+2", len(forced))
    engine = Engine(ScriptedModel(prompt + reply, tok.get_vocab_size()), tok)
    stream = list(engine.generate(prompt, num_samples=2, max_tokens=40, temperature=1.0, top_k=50))
    tokens = [col[0] for col, _ in stream]
    masks = [m[0] for _, m in stream]
    assert tokens == call + forced + after  # the tool's output replaced the script's "Z"s, then it resumed
    assert masks == [1] * len(call) + [0] * len(forced) + [1] * len(after)
    assert all(col[1] == col[0] for col, _ in stream)  # both samples ran the tool
    results, _ = engine.generate_batch(prompt, num_samples=1, max_tokens=40, temperature=0.0)
    assert tok.decode(results[0][len(prompt) :]).endswith("4<|output_end|> The cat")  # no <|assistant_end|>


def test_tool_runs_per_row_in_a_batch_of_prompts(tok):
    """generate_many: two prompts whose tool calls close at different columns; each row's output is forced when
    its own call closes, and each row is what its prompt gets alone."""
    sp = tok.encode_special
    forced = [sp("<|output_start|>"), *tok.encode("4"), sp("<|output_end|>")]
    prompt, call, after, reply = tool_script(tok, "2+2", len(forced))
    engine = Engine(ScriptedModel(prompt + reply, tok.get_vocab_size()), tok, stream_chunk=4)
    short = prompt[:-2]  # the script is by position: this row writes prompt[-2:] first, then the same reply
    together = engine.generate_batches([prompt, short], max_tokens=40, temperature=0.0)
    assert together == [engine.generate_batch(p, max_tokens=40, temperature=0.0) for p in (prompt, short)]
    (long_rows, long_masks), (short_rows, short_masks) = together
    assert long_rows[0] == prompt + call + forced + after[:-1]  # (without its <|assistant_end|>)
    assert short_rows[0] == short + prompt[-2:] + call + forced + after[:-1]
    assert short_masks[0] == [0] * len(short) + [1] * (2 + len(call)) + [0] * len(forced) + [1] * (len(after) - 1)
    # rows that start near the script's end stop within 3 tokens, so the tool rows are packed into other slots
    # before their calls close
    enders = [prompt + reply[:-k] for k in (1, 2, 3)]
    engine = Engine(engine.model, tok, stream_chunk=4, compact=True)
    progs = programs(engine.model)[0]
    move, moves = progs.move, []
    progs.move = lambda slots, src, dst, **kw: moves.append(src.tolist()) or move(slots, src, dst, **kw)
    try:
        crowded = engine.generate_batches([short, *enders, prompt], num_samples=2, max_tokens=40, temperature=0.0)
    finally:
        progs.move = move
    assert moves[0] == [8, 9]  # prompt's rows, into the enders' free slots 2-3: rows 0-3 hold all four left
    assert crowded[0] == engine.generate_batch(short, num_samples=2, max_tokens=40, temperature=0.0)
    assert crowded[4] == engine.generate_batch(prompt, num_samples=2, max_tokens=40, temperature=0.0)
    assert crowded[4][0][0] == prompt + call + forced + after[:-1]


def test_many_prompts_sample_as_one_prompt_at_a_time(model, tok):
    """generate_many: prompts of different lengths, seeds and room in the cache share one batch, and each row is
    the row its prompt gets alone; a row stops at its own budget (live says when)."""
    engine = Engine(model, tok, stream_chunk=4)
    prompts = PROMPTS + [list(range(1, 61))]  # the last leaves 4 of the cache's 64 positions
    seeds = [3, 4, 5, 6]
    for kwargs in (dict(temperature=1.0, top_k=50, max_tokens=12), dict(temperature=0.0, max_tokens=None)):
        together = engine.generate_batches(prompts, num_samples=2, seeds=seeds, **kwargs)
        alone = [engine.generate_batch(p, num_samples=2, seed=seed, **kwargs) for p, seed in zip(prompts, seeds)]
        assert together == alone
    stream = list(engine.generate_many(prompts, num_samples=2, seeds=seeds, temperature=0.0))
    live = np.array([alive for _, _, alive in stream])  # (columns, rows)
    assert live.shape[1] == 8 and live[:, 6:].sum(axis=0).tolist() == [4, 4]  # the last prompt's rows: 4 tokens
    assert len(stream) > 4 and live[4:, 6:].sum() == 0
    with pytest.raises(ValueError, match="2 seeds for 4 prompts"):
        list(engine.generate_many(prompts, seeds=[1, 2]))


def test_rows_still_going_are_packed_into_fewer_slots(model, tok):
    """Once half of a batch's rows have stopped, the rest move to the lowest slots and decode over a smaller
    batch: the same tokens as without packing, and as each prompt alone."""
    prompts = [list(range(1, 61)), list(range(2, 60)), list(range(3, 59)), [5, 6, 7]]  # room 4, 6, 8 and 61
    kwargs = dict(num_samples=2, seeds=[1, 2, 3, 4], temperature=1.0, top_k=50)
    moves = []
    packed, plain = Engine(model, tok, stream_chunk=4, compact=True), Engine(model, tok, stream_chunk=4, compact=False)
    progs = programs(with_stacked_qkv(model))[0]  # the programs Engine runs
    move = progs.move
    progs.move = lambda slots, src, dst, **kw: moves.append((src.tolist(), dst.tolist())) or move(slots, src, dst, **kw)
    try:
        got = list(packed.generate_many(prompts, **kwargs))
    finally:
        progs.move = move
    want = list(plain.generate_many(prompts, **kwargs))
    live = np.array([alive for _, _, alive in got])
    assert [alive for _, _, alive in want] == live.tolist() and live.sum(axis=0).tolist() == [4, 4, 6, 6, 8, 8, 61, 61]
    for (a, ma, alive), (b, mb, _) in zip(got, want):  # every live entry agrees
        assert [x for x, on in zip(a, alive) if on] == [x for x, on in zip(b, alive) if on] and ma == mb
    # 4 rows left of 8: slots 4-7 move to 0-3; when 2 are left they stay (none go below COMPACT_MIN_ROWS)
    assert COMPACT_MIN_ROWS == 4 and moves == [([4, 5, 6, 7], [0, 1, 2, 3])]
    assert packed.generate_batches(prompts, **kwargs) == [
        plain.generate_batch(p, num_samples=2, seed=seed, temperature=1.0, top_k=50)
        for p, seed in zip(prompts, [1, 2, 3, 4])
    ]


def test_speculative_engine_runs_the_tool(tok):
    """With a draft model the Engine streams from speculative sampling, and a tool's output is forced into both
    caches between calls: the same tokens and masks as the plain loop."""
    sp = tok.encode_special
    forced = [sp("<|output_start|>"), *tok.encode("4"), sp("<|output_end|>")]
    prompt, call, after, reply = tool_script(tok, "2+2", len(forced))
    model = ScriptedModel(prompt + reply, tok.get_vocab_size())
    draft = ScriptedModel(prompt + reply[:3] + [7] * 40, tok.get_vocab_size())  # right at first, then wrong
    engine = Engine(model, tok, draft_model=draft, draft_steps=3, stream_chunk=4)
    for temperature in (0.0, 1.0):
        stream = list(engine.generate(prompt, max_tokens=40, temperature=temperature))
        assert [c[0] for c, _ in stream] == call + forced + after
        assert [m[0] for _, m in stream] == [1] * len(call) + [0] * len(forced) + [1] * len(after)


def test_speculative_engine_equals_plain_greedy(model, tok):
    config = dataclasses.replace(model.config, n_layer=1)
    draft = make_model(config, 5, 0.3)
    prompt = [tok.get_bos_token_id()] + tok.encode("The cat sat on the mat")
    plain = [c[0] for c, _ in Engine(model, tok).generate(prompt, max_tokens=30, temperature=0.0)]
    fast = Engine(model, tok, draft_model=draft, draft_steps=3)
    assert [c[0] for c, _ in fast.generate(prompt, max_tokens=30, temperature=0.0)] == plain
    assert [c[0] for c, _ in fast.generate(prompt, max_tokens=7, temperature=0.0)] == plain[:7]  # stops at max_tokens


def test_tool_is_the_calculator_unless_the_sandbox_is_asked_for(tok):
    sp = tok.encode_special
    forced = [sp("<|output_start|>"), *tok.encode("42"), sp("<|output_end|>")]
    prompt, call, after, reply = tool_script(tok, "x = 6\nx * 7", len(forced))
    model = ScriptedModel(prompt + reply, tok.get_vocab_size())
    # the default is nanochat's tool, the calculator only: not arithmetic, so nothing is forced
    engine = Engine(model, tok)
    assert not engine.use_sandbox and engine.run_tool("x = 6\nx * 7") is None
    stream = list(engine.generate(prompt, max_tokens=40, temperature=0.0))
    assert [c[0] for c, _ in stream] == reply and all(m == [1] for _, m in stream)
    # opt-in: other code runs in the sandbox and its output is forced
    stream = list(Engine(model, tok, use_sandbox=True).generate(prompt, max_tokens=40, temperature=0.0))
    assert [c[0] for c, _ in stream] == call + forced + after


def test_run_tool(tok, model):
    engine = Engine(model, tok)
    assert engine.run_tool("12/60") == "0.2" and engine.run_tool("'strawberry'.count('r')") == "3"


# -----------------------------------------------------------------------------
# Speculative sampling


V = 8  # speculative tests: a vocabulary small enough to enumerate every 3-token continuation


@pytest.fixture(scope="module")
def pair():
    """A target and a (different) draft model over V tokens."""
    config = GPTConfig(sequence_len=16, vocab_size=V, n_layer=1, n_head=1, n_kv_head=1, n_embd=32, window_pattern="L")
    return make_model(config, 2, 0.5), make_model(config, 3, 0.5)


def test_speculative_greedy_equals_target_greedy(pair):
    target, draft = pair
    prompt = [1, 5]
    expected = naive_greedy(target, prompt, 12, width=16)
    spec, stats = generate_speculative(target, draft, prompt, 12, draft_steps=3, temperature=0.0, return_stats=True)
    assert spec == expected
    assert naive_greedy(draft, prompt, 12, width=16) != expected  # the draft alone would have said otherwise
    assert 0 < stats["rounds"] <= 12 and stats["accepted"] <= 3 * stats["rounds"]


@pytest.mark.parametrize("rule", [(1.0, None, None), (0.7, 5, 0.9)])
def test_speculative_sampling_preserves_distribution(pair, rule):
    """The joint law of the first three sampled tokens matches the target model's exactly computed law under the
    rule (chi-square; nothing outside its top_k / top_p support), while the draft's own law is far from it."""
    target, draft = pair
    n, prompt = 24000, [1, 5]
    temperature, top_k, top_p = rule
    progs, params = speculative_programs(target, draft)
    tokens, lengths = pad_prompts([prompt], 16, 3)
    traced = speculative.traced_rule(rule)

    def run(key):  # one continuation of the prompt: the first token, then rounds for 2 more
        spec, first = progs.jitted_start(params, tokens[0], lengths[0], key, capacity=16, rule=traced)
        static = dict(k=2, rule=traced, stops=(), tool_end=-1, chunk=4)
        spec, out, count = progs.jitted_run(params, spec, np.int32(2), **static)
        return jnp.concatenate([first[None], out]), count + 1, spec.accepted

    out, count, accepted = jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(0), n))
    assert np.all(np.asarray(count) >= 3) and 0 < np.mean(accepted) < 2  # drafts were both accepted and rejected
    observed = np.bincount(np.asarray(out[:, :3]) @ np.array([V * V, V, 1]), minlength=V**3)
    seqs = np.stack(np.meshgrid(*[np.arange(V)] * 3, indexing="ij"), -1).reshape(-1, 3)
    full = jnp.asarray(np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1))

    def law(m):  # exact probability of every 3-token continuation under the rule
        probs = rule_probs(full_forward(m, full)[:, len(prompt) - 1 : -1], *rule)  # (N, 3, V)
        return np.prod(np.asarray(jnp.take_along_axis(probs, jnp.asarray(seqs)[..., None], -1)), axis=(1, 2))

    def chi2(p):
        expected = n * p
        keep = expected >= 5
        return np.sum((observed[keep] - expected[keep]) ** 2 / expected[keep]), keep.sum() - 1

    p_target = law(target)
    assert observed[p_target == 0].sum() == 0 and (top_k is None or (p_target == 0).any())
    stat, dof = chi2(p_target)
    assert stat < dof + 5 * np.sqrt(2 * dof), (stat, dof)  # chi-square: mean dof, sd sqrt(2 dof)
    stat_draft, dof_draft = chi2(law(draft))
    assert stat_draft > 10 * dof_draft  # the test can tell the draft's law from the target's


def test_traced_rule_is_the_static_rule():
    """traced_rule_probs (the rule as traced values) keeps the same tokens as rule_probs and gives them the same
    probabilities, for every kind of setting, top_k at, between and past the static tiers included."""
    probs = jax.jit(traced_rule_probs)
    for V in (8, 333):  # 333: not a multiple of the top-k block
        logits = 3 * jax.random.normal(jax.random.key(V), (2, 3, V))
        for t, k, p in [(0.0, None, None), (1.0, None, None), (0.7, 5, None), (0.9, None, 0.8), (1.3, 120, 0.5)] + [
            (1.0, k, None) for k in (1, 50, 51, 250, V - 1, V + 7)
        ]:
            want = np.asarray(rule_probs(logits, t, k, p))
            got = np.asarray(probs(logits, np.float32(t), np.int32(k or 0), np.float32(p or 1.0)))
            assert np.array_equal(got > 0, want > 0), (V, t, k, p)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert probs._cache_size() == 2  # one per shape


def test_speculative_sampling_settings_compile_nothing(pair):
    """The sampling rule is a traced argument of the speculative programs: requests with new temperature, top_k
    and top_p run the programs the first request compiled, and the settings still act (greedy = greedy)."""
    target, draft = pair
    progs, _ = speculative_programs(target, draft)
    sizes, outs = [], []
    for t, k, p in [(1.0, None, None), (0.5, 3, None), (1.5, None, 0.7), (0.0, None, None)]:
        outs.append(generate_speculative(target, draft, [1, 5], 10, draft_steps=3, temperature=t, top_k=k, top_p=p))
        sizes.append((progs.jitted_start._cache_size(), progs.jitted_run._cache_size()))
    assert sizes[1:] == sizes[:1] * 3, sizes
    assert outs[-1] == naive_greedy(target, [1, 5], 10, width=16)


def test_measure_generation_reports(model):
    # the shapes of the other tests (3 rows, a 32-token bucket), so nothing new compiles
    out = measure_generation(model, batch_size=3, prompt_len=20, max_new_tokens=8, repeats=1)
    for name in ("tok_per_s", "ttft_s", "prefill_tok_per_s", "compile_s", "decode_steps_per_s", "e2e_tok_per_s"):
        assert out[name] >= 0 and np.isfinite(out[name])
    assert out["tok_per_s"] == pytest.approx(3 * out["decode_steps_per_s"])


def test_engine_checks_prompts_and_clips_to_the_cache(tok):
    script = list(range(100, 170))  # never a special token: only the cache can end this stream
    engine = Engine(ScriptedModel(script, tok.get_vocab_size()), tok)
    stream = list(engine.generate(script[:60], max_tokens=1000, temperature=0.0))
    assert [c[0] for c, _ in stream] == script[60:64]  # 64-token cache: 4 new tokens fit
    assert len(list(engine.generate(np.array(script[:60]), max_tokens=2, temperature=0.0))) == 2  # numpy ids are fine
    with pytest.raises(ValueError, match="no room"):
        next(engine.generate(script[:64]))
    with pytest.raises(ValueError, match="token ids"):
        next(engine.generate("hello"))
    with pytest.raises(ValueError, match="at least one token"):
        next(engine.generate([]))


@pytest.mark.eight_devices
def test_sampling_on_a_mesh_equals_one_device(model):
    """Parameters on an 8-device mesh: the decode program is partitioned (no optimisation barriers around
    top-k there: XLA cannot rewrite them) and samples the same tokens as on one device."""
    mesh = sharding.make_mesh(data=-1)
    sharded = nnx.eval_shape(lambda: model)
    nnx.update(
        sharded, jax.device_put(nnx.state(model), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    )
    for top_k in (None, 5, 50):
        want = generate(model, PROMPTS, 6, temperature=1.0, top_k=top_k, seed=1)
        assert generate(sharded, PROMPTS, 6, temperature=1.0, top_k=top_k, seed=1) == want


def test_decode_loop_updates_the_cache_in_place(model, users_codegen):
    """Inside the compiled decode loop each step writes its keys/values into the carried cache in place: no copy
    or transpose of a whole cache layer per step (which once cost more than a small model's matmuls)."""
    progs, params = programs(model)
    for rows in (1, 3):
        padded, lengths = pad_prompts([[1, 2, 3]] * rows, 64, 8)
        slots = progs.start(params, padded, lengths, copies=1, rows=rows, capacity=64)
        lowered = progs.decode.lower(
            params, slots, controls(rows, remaining=8), np.int32(8), settings=DecodeSettings(8)
        )
        hlo = lowered.compile(compiler_options=users_codegen).as_text()
        loop = next(line for line in hlo.splitlines() if " while(" in line and 'op_name="jit(_decode)/while"' in line)
        name = re.search(r"body=(%[\w.-]+)", loop).group(1)
        body = hlo[hlo.index(f"\n{name} ") + 1 :]
        body = body[: body.index("\n}")]
        layer = rows * 1 * 64 * 32  # (rows, Hkv, S, D) elements
        whole = []
        for line in body.splitlines()[1:]:
            m = re.match(r"\s*(?:ROOT )?(%\S+) = f32\[([\d,]+)\]\S* (\S+?)\(", line)
            if (
                m
                and np.prod([int(d) for d in m.group(2).split(",")]) == layer
                and m.group(3) not in ("bitcast", "get-tuple-element")
            ):
                whole.append((m.group(1), m.group(3)))
        assert whole and all("update-slice" in n or "scatter" in n for n, _ in whole), whole  # the writes, only


def test_an_extracted_part_decodes_like_the_whole_cache(model):
    """The runner decodes a (rows, span) part extracted from the slots and flushes it back later: the same tokens,
    cache, positions and logits in those rows as decoding the whole slots (the other rows inactive)."""
    progs, params = programs(model)
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9]]
    tokens, lengths = pad_prompts(prompts, 256, 12)
    settings = DecodeSettings(chunk=4, tiers=TOP_K_TIERS)

    def run(rows, part):
        slots = progs.start(params, tokens, lengths, copies=1, rows=4, capacity=256)
        work = progs.extract(slots, rows=rows, span=64) if part else slots
        n, outs = work.extent[0], []
        for chunk in range(3):
            ctl = controls(n, active=np.arange(n) < rows, remaining=12 - 4 * chunk, offset=4 * chunk, seed=range(n))
            work, out = progs.decode(params, work, ctl, np.int32(4), settings=settings)
            outs.append(np.asarray(out.tokens)[:rows, : int(out.steps)])
        if part:
            assert work.cache.k[0].shape[:3] == (rows, 1, 64) and work.logits.shape[0] == rows
            work = progs.flush(slots, work)
        return np.concatenate(outs, axis=1), jax.tree.map(lambda x: np.asarray(x)[:rows], work)

    for rows in (4, 2):
        (a, whole), (b, flushed) = run(rows, part=False), run(rows, part=True)
        np.testing.assert_array_equal(a, b)
        assert a.shape == (rows, 12)
        np.testing.assert_array_equal(whole.cache.pos, flushed.cache.pos)
        # two programs of different shapes: their sums may run in another order (a few fp32 ulps apart)
        np.testing.assert_allclose(whole.logits, flushed.logits, rtol=1e-5, atol=1e-5)
        for x, y in zip(whole.cache.k + whole.cache.v, flushed.cache.k + flushed.cache.v):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
