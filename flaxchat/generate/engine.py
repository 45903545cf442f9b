"""Inference: the one generation core and what is built on it.

The core (used by `generate`, the streaming `Engine` for the CLI, evaluation and RL rollouts, the server's
continuous-batching `flaxchat.generate.scheduler`, and `bench`):

- `Slots`: a KV cache of N rows (`flaxchat.model.gpt.KVCache`, fixed capacity, a position per row) with each row's
  next-token logits and a queue of tokens to force (a tool's output).
- One jitted prefill: prompts padded to a power-of-two bucket, run once, written into rows of the slots (one
  prompt may be copied into several rows: num_samples draws share its prefill).
- One jitted decode loop (`lax.while_loop`) over the lowest `rows` slots, attending over only the first `span`
  cache positions (the used part, a power of two). Each row has its own sampling settings, seed, token budget
  and forced tokens (`Controls`); a row freezes when it stops; the loop returns early when every row stopped or
  a row closed a tool call, so the host can run the tool.
- One sampler (`sample_rows`): greedy, temperature, top-k, top-p, per row, by inverse CDF.
- One tool state machine (`Reply`): `<|python_start|>expr<|python_end|>` runs the calculator and
  `<|output_start|>result<|output_end|>` is forced into the row; it also decodes text incrementally for streaming.

Randomness is explicit: token n of row `lane` of a request with `seed` draws with
fold_in(fold_in(key(seed), lane), n), so the same seed gives the same tokens however the loop is cut into calls,
whichever slot the row lands in and whoever else is in the batch.

Speculative sampling (flaxchat.generate.speculative) reuses the sampler and cache helpers; the Engine streams from it
when given a draft model.
"""

from __future__ import annotations

import ast
import codecs
import dataclasses
import functools
import numbers
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat.model.attention import write_cache
from flaxchat.common import from_main_process, is_main_process
from flaxchat.generate.sandbox import execute_code, use_calculator
from flaxchat.model.gpt import KVCache, rms_norm

MIN_BUCKET = 16  # smallest padded prompt length
STREAM_CHUNK = 16  # most decode steps per jitted call while streaming (a ~50 ms burst on a laptop CPU)
FORCED_CAPACITY = 128  # tokens a tool call may force into a row; longer outputs are cut to fit
MAX_TOP_K = 200  # largest per-row top_k the server's sampler takes (0 = no top-k cut)
TOP_K_TIERS = (50, MAX_TOP_K)  # the server's static top-k sizes; a chunk uses the smallest covering its rows
COMPACT_MIN_ROWS = 4  # generate_many packs its rows still going into no fewer slots: each width is a compile


def bucket_length(n: int, capacity: int) -> int:
    """Padded length for an n-token prompt: the next power of two (at least MIN_BUCKET), at most capacity."""
    return min(max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length()), capacity)


def attention_span(positions_needed: int, capacity: int) -> int:
    """Cache positions a decode chunk attends over: a power of two (at least capacity/16, at least 64) holding
    `positions_needed`, at most the capacity. Few distinct spans keep the number of compiled programs small."""
    floor = max(64, capacity // 16)
    return min(max(floor, 1 << max(positions_needed - 1, 0).bit_length()), capacity)


def pad_prompts(prompts, capacity: int, max_new_tokens: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Prompts (lists of ids) -> (tokens (B, bucket) int32, lengths (B,) int32), checked against the cache.

    Each row is padded with its own last token: a padded prefill then leaves the smear state (the embedding
    of the last token fed) exactly as an unpadded one would; the padding's K/V sit past the row's position
    and are never attended to.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (start it with <|bos|>)")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > capacity:
        raise ValueError(f"a {longest}-token prompt leaves no room for {max_new_tokens} new tokens in a "
                         f"{capacity}-token KV cache; shorten the prompt")
    width = bucket_length(longest, capacity)
    tokens = np.array([list(p) + [p[-1]] * (width - len(p)) for p in prompts], dtype=np.int32)
    return tokens, np.array([len(p) for p in prompts], dtype=np.int32)


# -----------------------------------------------------------------------------
# Cache helpers (functions over KVCache)


def take_rows(cache: KVCache, rows: int, span: int) -> KVCache:
    """The first `rows` slots and the first `span` positions of the cache (what a decode chunk touches)."""
    return KVCache(k=tuple(c[:rows, :, :span] for c in cache.k), v=tuple(c[:rows, ..., :span] for c in cache.v),
                   pos=cache.pos[:rows], prev_embedding=cache.prev_embedding[:rows])


def extent(cache: KVCache) -> tuple[int, int]:
    """(rows, span) of a cache or of a part taken from one: its slots and the positions each holds."""
    return cache.pos.shape[0], cache.k[0].shape[2]


def put_rows(cache: KVCache, part: KVCache, start, width: int) -> KVCache:
    """Write a decode chunk's work back: for each row, only the `width` positions from `start` (B,) on, which
    hold everything the chunk wrote (copying the whole working part back would cost as much as the chunk's
    attention). The window is clamped inside the part; positions it covers that the chunk did not write hold
    the values taken from the cache, so writing them back changes nothing."""
    rows, span = extent(part)
    width = min(width, span)
    start = jnp.clip(start, 0, span - width)
    cols = start[:, None] + jnp.arange(width)[None, :]  # (rows, width)

    def put_layers(layers, new, axis):  # each layer: gather (rows, width, Hkv, D) from the part, scatter it in place
        at = (jnp.arange(rows)[:, None],) + (slice(None),) * (axis - 1) + (cols,)
        return tuple(write_cache(c, n[at], start, axis) for c, n in zip(layers, new))

    return KVCache(k=put_layers(cache.k, part.k, 2), v=put_layers(cache.v, part.v, 3),
                   pos=cache.pos.at[:rows].set(part.pos),
                   prev_embedding=cache.prev_embedding.at[:rows].set(part.prev_embedding))


def in_compute_dtype(params, dtype):
    """Floating parameters cast to the compute dtype: decoding then reads half the bytes per step in bf16, and the
    numbers do not change (every forward casts each weight to that dtype before using it)."""
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x
    return jax.tree.map(cast, params)


def cast_for_compute(model) -> None:
    """in_compute_dtype on a (traced) model's parameters, in place."""
    nnx.update(model, in_compute_dtype(nnx.state(model, nnx.Param), model.dtype))


def narrow_weights(params, dtype) -> bool:
    """Whether any weight matrix is stored narrower than the compute dtype (--quantize int8/bf16).

    A loop over such weights carries them behind `loop_weights`: XLA would otherwise hoist their conversion out of
    the loop and every step would read float copies; kept in the step, the conversion fuses into the
    matrix-vector products, which then read the narrow bytes."""
    itemsize = jnp.dtype(dtype).itemsize
    return any(x.dtype.itemsize < itemsize for x in jax.tree.leaves(params) if x.ndim == 2)


def loop_weights(graphdef, weights):
    """Inside a loop body: (the model rebuilt from weights carried through the loop, the weights to carry on), both
    from behind an optimisation barrier, so XLA cannot treat them as loop-invariant."""
    weights = jax.lax.optimization_barrier(weights)
    model = nnx.merge(graphdef, weights)
    cast_for_compute(model)
    return model, weights


def rewind(model, cache: KVCache, pos, last_token) -> KVCache:
    """Move each row back to position `pos` (B,) whose last cached token is `last_token` (B,).

    Entries past pos stay in memory but are invisible (a query never sees keys after its own position) and
    are overwritten as decoding resumes. The smear state is recomputed the way forward_cached computes it:
    the normalised embedding of the last token.
    """
    prev = rms_norm(model.transformer.wte(last_token, model.dtype))
    return dataclasses.replace(cache, pos=pos.astype(jnp.int32), prev_embedding=prev.astype(cache.prev_embedding.dtype))


# -----------------------------------------------------------------------------
# The sampler


def _check_sampling(temperature, top_k, top_p):
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be a positive integer or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")


def argmax(x):
    """argmax over the last axis (first index among ties), as int32.

    A max and a min: on CPU this is ~10x faster than jnp.argmax's variadic reduce, which costs a tenth of a
    small model's decode step over a 32k vocabulary.
    """
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), iota, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1)  # NaN rows: some index rather than out of range


def inverse_cdf(weights, u, block: int = 128):
    """Index drawn with probability proportional to weights (..., K) >= 0, given uniforms u (...) in [0, 1).

    One uniform per draw and a cumulative sum (as torch.multinomial does) instead of K Gumbel variates, which
    cost more than the rest of a small model's decode step on a CPU. Two levels (which block of `block`
    entries, then where in it) keep the cumulative sums short. Zero-weight entries are never drawn.
    """
    lead, K = weights.shape[:-1], weights.shape[-1]
    w = jnp.pad(weights.reshape(-1, K), ((0, 0), (0, (-K) % block)))
    B, n = w.shape[0], w.shape[1] // block
    p = w.reshape(B, n, block)
    mass = jnp.sum(p, axis=-1)  # (B, blocks)
    cum = jnp.cumsum(mass, axis=-1)
    target = jnp.reshape(u, (-1,)) * cum[:, -1]
    b = jnp.minimum(jnp.sum(cum <= target[:, None], axis=-1), n - 1)  # <=: skips zero-mass blocks
    rest = target - jnp.take_along_axis(cum - mass, b[:, None], axis=1)[:, 0]
    inner = jnp.cumsum(jnp.take_along_axis(p, b[:, None, None], axis=1)[:, 0], axis=-1)  # (B, block)
    index = b * block + jnp.minimum(jnp.sum(inner <= rest[:, None], axis=-1), block - 1)
    # rounding at the very top of the CDF can land past the last positive weight: take that one then
    iota = jax.lax.broadcasted_iota(jnp.int32, w.shape, 1)
    last = jnp.max(jnp.where(w > 0, iota, 0), axis=-1)
    return jnp.minimum(index, last).astype(jnp.int32).reshape(lead)


def _kth_largest(x, k: int, ks, block: int = 32, barrier: bool = True):
    """Each row's ks[b]-th largest value (1 <= ks <= k) of x (B, V).

    The k largest values lie in the k blocks with the largest maxima, so top_k runs on k*block candidates
    instead of V. The optimisation barriers keep XLA from rewriting top_k-then-index into a full sort, which
    on a CPU is two orders of magnitude slower; a program partitioned over several devices cannot have them
    (XLA's top-k rewriting fails on them), so barrier=False there.
    """
    fence = jax.lax.optimization_barrier if barrier else (lambda x: x)
    x = jnp.pad(x, ((0, 0), (0, (-x.shape[1]) % block)), constant_values=-jnp.inf)
    B, V = x.shape
    candidates = x
    if k < V // block:  # (a top_k of a whole axis is rewritten into a sort, and fails behind a barrier)
        xb = x.reshape(B, V // block, block)
        _, best = fence(jax.lax.top_k(jnp.max(xb, axis=-1), k))  # (B, k) block ids
        candidates = jnp.take_along_axis(xb, best[:, :, None], axis=1).reshape(B, k * block)
    k = min(k, candidates.shape[1])
    if k < candidates.shape[1]:
        values, _ = fence(jax.lax.top_k(candidates, k))  # (B, k), largest first
    else:
        values = -jnp.sort(-candidates, axis=-1)
    return jnp.take_along_axis(values, jnp.clip(ks - 1, 0, k - 1)[:, None], axis=1)[:, 0]


def _nucleus_threshold(scaled, top_p):
    """Each row's smallest kept value under nucleus sampling (Holtzman et al. 2019, arXiv:1904.09751): the
    tokens whose probability mass above them is below top_p (so the top token is always kept)."""
    s = -jnp.sort(-scaled, axis=-1)  # (B, V) largest first; a full sort, paid only when some row asks
    p = jax.nn.softmax(s, axis=-1)
    above = jnp.cumsum(p, axis=-1) - p
    return jnp.min(jnp.where(above < top_p[:, None], s, jnp.inf), axis=-1)


def kept_logits(logits, temperature, top_k, top_p=None, tiers=TOP_K_TIERS, barrier=True):
    """Each row of logits (B, V) divided by its temperature, -inf outside its top_k (0 = all; ties at the k-th
    value are kept) and then outside its top_p nucleus (1 = all). Greedy rows (temperature 0) are unscaled.

    tiers: the static top-k sizes compiled (a row's top_k is cut to the largest); the chunk runs the smallest
    tier covering its sampled rows, or none. The nucleus needs a sort, so it runs only when a row asks.
    """
    B, V = logits.shape
    greedy = temperature <= 0
    thr = jnp.full((B,), -jnp.inf)
    tiers = sorted({min(int(k), V) for k in tiers if k > 0})
    if tiers:
        top_k = jnp.minimum(top_k, tiers[-1])
        kmax = jnp.max(jnp.where(greedy, 0, top_k))
        branch = (kmax > 0).astype(jnp.int32) + sum((kmax > t).astype(jnp.int32) for t in tiers[:-1])
        cut = lambda k: lambda: jnp.where(top_k > 0, _kth_largest(logits, k, top_k, barrier=barrier), -jnp.inf)
        thr = jax.lax.switch(branch, [lambda: thr] + [cut(k) for k in tiers])
    t = jnp.where(greedy, 1.0, temperature)[:, None]
    scaled = jnp.where(logits >= thr[:, None], logits / t, -jnp.inf)
    if top_p is not None:
        nucleus = ~greedy & (top_p < 1.0)
        pthr = jax.lax.cond(jnp.any(nucleus), lambda: jnp.where(nucleus, _nucleus_threshold(scaled, top_p), -jnp.inf),
                            lambda: jnp.full((B,), -jnp.inf))
        scaled = jnp.where(scaled >= pthr[:, None], scaled, -jnp.inf)
    return scaled


def sample_rows(logits, keys, temperature, top_k, top_p=None, tiers=TOP_K_TIERS, barrier=True):
    """One token per row of logits (B, V), each row with its own key, temperature (0 = greedy), top_k (0 = all)
    and top_p (1 = all): the argmax, or an inverse-CDF draw from softmax(kept_logits). A batch of greedy rows
    pays for the argmax only."""
    greedy = temperature <= 0
    best = argmax(logits)

    def draw():
        scaled = kept_logits(logits, temperature, top_k, top_p, tiers, barrier)
        u = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys)
        # max(scaled) without another pass over the vocabulary: the top logit is always kept, and dividing by a
        # positive temperature keeps it on top (the same max argmax takes, which XLA computes once)
        top = jnp.max(logits, axis=-1, keepdims=True) / jnp.where(greedy, 1.0, temperature)[:, None]
        drawn = inverse_cdf(jnp.exp(scaled - top), u)
        return jnp.where(greedy, best, drawn)

    return jax.lax.cond(jnp.all(greedy), lambda: best, draw).astype(jnp.int32)


def _rule(B, temperature, top_k, top_p):
    """One sampling rule (Python numbers) as per-row arrays for kept_logits/sample_rows, and its tiers."""
    rows = lambda value, dtype: jnp.full((B,), value, dtype)
    return (rows(temperature, jnp.float32), rows(top_k or 0, jnp.int32),
            None if top_p in (None, 1.0) else rows(top_p, jnp.float32)), ((top_k,) if top_k else ())


def sample_next_token(logits, key, temperature=1.0, top_k=None, top_p=None):
    """One token per row of logits (B, V) under one rule; row b draws with fold_in(key, b)."""
    _check_sampling(temperature, top_k, top_p)
    B = logits.shape[0]
    (t, k, p), tiers = _rule(B, temperature, top_k, top_p)
    keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(B))
    return sample_rows(logits, keys, t, k, p, tiers)


def rule_probs(logits, temperature=1.0, top_k=None, top_p=None):
    """The full-vocabulary probabilities (..., V) a rule samples from (one-hot argmax when greedy)."""
    if temperature == 0:
        return jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
    flat = logits.reshape(-1, logits.shape[-1])
    (t, k, p), tiers = _rule(flat.shape[0], temperature, top_k, top_p)
    return jax.nn.softmax(kept_logits(flat, t, k, p, tiers), axis=-1).reshape(logits.shape)


# -----------------------------------------------------------------------------
# The tool state machine


def stop_tokens(tokenizer) -> tuple[int, int]:
    """The tokens that end a reply: <|assistant_end|> and <|bos|> (a model that starts a new document is done)."""
    return tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()


class Reply:
    """One reply's tool state machine and text stream (nanochat's RowState, plus incremental decoding).

    `feed` each generated token (forced ones included). `<|python_start|>expr<|python_end|>` is a tool call:
    `run_tool(expr)` runs and, when it returns text, `<|output_start|>result<|output_end|>` is to be forced into
    the row. With text=True, text between special tokens is decoded with an incremental UTF-8 decoder (a
    character split over several tokens comes out whole) and the reply is kept as assistant-message parts and
    stream events:
        {"type": "token", "text": str}                     text the model wrote (consecutive tokens coalesced)
        {"type": "tool", "kind": "call"|"output", "text"}  a complete tool call, then the tool's output
    run_tool=None follows the tokens without running anything (a display of someone else's stream).
    """

    def __init__(self, tokenizer, run_tool: Callable[[str], str | None] | None = None, *, text: bool = True):
        sp = tokenizer.encode_special
        self.tokenizer, self.run_tool, self.track_text = tokenizer, run_tool, text
        self.python_start, self.python_end = sp("<|python_start|>"), sp("<|python_end|>")
        self.output_start, self.output_end = sp("<|output_start|>"), sp("<|output_end|>")
        self.stop_tokens = set(stop_tokens(tokenizer))
        self.specials = {sp(name) for name in tokenizer.get_special_tokens()}
        self.mode = "text"  # text | python | python_output
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # the current text part
        self.pending = ""  # text not yet sent
        self.block: list[int] = []  # tokens of the current tool call or output
        self.parts: list[dict] = []
        self.events: list[dict] = []
        self.ended = False

    def feed(self, token: int) -> tuple[bool, list[int] | None]:
        """Take one generated token -> (reply ended, tokens to force next or None)."""
        if self.ended or token in self.stop_tokens:
            self.ended = True
            return True, None
        if token == self.python_start and self.mode == "text":
            self._close_text()
            self.mode, self.block = "python", []
        elif token == self.python_end and self.mode == "python":
            expr = self._close_block("call")
            result = self.run_tool(expr) if self.run_tool is not None and expr.strip() else None
            if result is not None:
                body = self.tokenizer.encode(result)[: FORCED_CAPACITY - 2]
                return False, [self.output_start, *body, self.output_end]
        elif token == self.output_start and self.mode == "text":
            self._close_text()
            self.mode, self.block = "python_output", []
        elif token == self.output_end and self.mode == "python_output":
            self._close_block("output")
        elif self.mode != "text":
            self.block.append(token)
        elif self.track_text and token not in self.specials:  # a stray special token in text carries no text
            piece = self.decoder.decode(self.tokenizer.decode_single_token_bytes(token))
            self.text += piece
            self.pending += piece
        return False, None

    def _flush_pending(self) -> None:
        if self.pending:
            self.events.append({"type": "token", "text": self.pending})
            self.pending = ""

    def _close_text(self) -> None:
        tail = self.decoder.decode(b"", final=True)
        self.text += tail
        self.pending += tail
        self._flush_pending()
        if self.text:
            self.parts.append({"type": "text", "text": self.text})
        self.text = ""
        self.decoder.reset()

    def _close_block(self, kind: str) -> str:
        text = self.tokenizer.decode(self.block)
        if self.track_text:
            self.events.append({"type": "tool", "kind": kind, "text": text})
            self.parts.append({"type": self.mode, "text": text})
        self.mode, self.block = "text", []
        return text

    def take_events(self) -> list[dict]:
        """Events since the last call (pending text is sent as one token event)."""
        self._flush_pending()
        events, self.events = self.events, []
        return events

    def finish(self) -> list[dict]:
        """Close whatever part is open (an unfinished tool call is shown as it stands); returns the parts."""
        if self.mode == "text":
            self._close_text()
        else:
            self._close_block("call" if self.mode == "python" else "output")
        return self.parts


def run_python(code: str, timeout: float = 5.0) -> str | None:
    """The sandbox half of the tool: run code like an interactive prompt (a final expression's value is
    printed) and return what it printed, its error line, or None when it printed nothing."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        tree = None  # let the sandbox report it in Python's own words
    if tree is not None and tree.body and isinstance(tree.body[-1], ast.Expr):
        value = tree.body[-1].value
        show = ast.parse("if _ is not None: print(repr(_))").body[0]
        tree.body[-1:] = [ast.Assign(targets=[ast.Name("_", ast.Store())], value=value), show]
        code = ast.unparse(ast.fix_missing_locations(tree))
    result = execute_code(code, timeout=timeout)
    text = result.stdout.strip() if result.success else (result.error or "error")
    return text or None


# -----------------------------------------------------------------------------
# Device state and the two programs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Slots:
    """What lives on the device between calls, one row per slot."""

    cache: KVCache
    logits: jax.Array  # (N, V) fp32: each row's next-token distribution
    forced: jax.Array  # (N, F) int32: per-row queue of tokens to force (a tool's output)
    forced_len: jax.Array  # (N,) int32
    forced_pos: jax.Array  # (N,) int32: next queue entry to emit


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Controls:
    """Per-row settings the host sends with each decode call (small arrays, (N,) or (N, F))."""

    active: jax.Array  # bool: the row is generating
    remaining: jax.Array  # int32: tokens it may still generate
    offset: jax.Array  # int32: tokens it generated so far (the RNG counter)
    seed: jax.Array  # int32
    lane: jax.Array  # int32: which of a request's samples the row is (the RNG's second level)
    temperature: jax.Array  # float32; 0 = greedy
    top_k: jax.Array  # int32; 0 = no cut
    top_p: jax.Array  # float32; 1 = no nucleus cut
    push: jax.Array  # bool: give this row a new forced queue before the call
    push_queue: jax.Array  # (N, F) int32
    push_len: jax.Array  # int32


def controls(n: int, *, active=True, remaining=0, offset=0, seed=0, lane=0, temperature=1.0, top_k=0, top_p=1.0,
             pushes: dict[int, list[int]] | None = None) -> Controls:
    """Controls for n rows from per-row sequences or one value for all; pushes: {row: tokens to force}."""
    row = lambda x, dtype: np.broadcast_to(np.asarray(x, dtype), (n,)).copy()
    queue, qlen = np.zeros((n, FORCED_CAPACITY), np.int32), np.zeros(n, np.int32)
    for i, tokens in (pushes or {}).items():
        queue[i, : len(tokens)], qlen[i] = tokens, len(tokens)
    return Controls(active=row(active, bool), remaining=row(remaining, np.int32), offset=row(offset, np.int32),
                    seed=row(np.asarray(seed, np.int64) % 2**31, np.int32), lane=row(lane, np.int32),
                    temperature=row(temperature, np.float32), top_k=row(top_k, np.int32),
                    top_p=row(top_p, np.float32), push=qlen > 0, push_queue=queue, push_len=qlen)


def empty_slots(model, rows: int, capacity: int) -> Slots:
    zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
    return Slots(cache=model.init_cache(rows, capacity), logits=jnp.zeros((rows, model.config.vocab_size), jnp.float32),
                 forced=zeros(rows, FORCED_CAPACITY), forced_len=zeros(rows), forced_pos=zeros(rows))


def _prefill(graphdef, params, slots: Slots, start, tokens, lengths, *, copies: int = 1) -> Slots:
    """Prefill padded prompts (B, T) and write them, each into `copies` consecutive rows, from row `start` on."""
    model = nnx.merge(graphdef, params)
    cast_for_compute(model)
    B = tokens.shape[0]
    logits, part = model.forward_cached(tokens, model.init_cache(B, tokens.shape[1]), logits_at=lengths - 1, fresh=True)
    many = lambda x: jnp.repeat(x, copies, axis=0)
    at = lambda x, new: jax.lax.dynamic_update_slice(x, many(new).astype(x.dtype), (start,) + (0,) * (x.ndim - 1))
    cache = slots.cache
    zero = jnp.zeros((B,), jnp.int32)
    cache = KVCache(k=tuple(at(c, n) for c, n in zip(cache.k, part.k)),  # stale entries past T are never attended to
                    v=tuple(at(c, n) for c, n in zip(cache.v, part.v)),
                    pos=at(cache.pos, lengths), prev_embedding=at(cache.prev_embedding, part.prev_embedding))
    return Slots(cache=cache, logits=at(slots.logits, logits), forced=slots.forced,
                 forced_len=at(slots.forced_len, zero), forced_pos=at(slots.forced_pos, zero))


def _move(slots: Slots, src, dst) -> Slots:
    """Copy every per-row array's rows src (M,) to rows dst (M,) (all read before any is written): the scheduler
    packing its live rows low. A repeated (src, dst) pair is harmless (it writes the same row twice)."""
    return jax.tree.map(lambda x: x.at[dst].set(x[src]), slots)


def _extract(slots: Slots, *, rows: int, span: int) -> Slots:
    """The part of slots a run of decode chunks works on: the first `rows` rows, their first `span` cache
    positions. Decoding it directly (its rows and span are the whole of it) copies nothing in or out."""
    r = slice(0, rows)
    return Slots(cache=take_rows(slots.cache, rows, span), logits=slots.logits[r], forced=slots.forced[r],
                 forced_len=slots.forced_len[r], forced_pos=slots.forced_pos[r])


def _flush(slots: Slots, part: Slots) -> Slots:
    """Write an extracted part (after decoding it) back into slots; positions past its span are untouched."""
    return jax.tree.map(lambda x, new: jax.lax.dynamic_update_slice(x, new, (0,) * x.ndim), slots, part)


def _start(graphdef, params, tokens, lengths, *, copies: int, rows: int, capacity: int) -> Slots:
    """Fresh slots of `rows` rows with the prompts prefilled from row 0 (the Engine's and generate's start)."""
    slots = empty_slots(nnx.merge(graphdef, params), rows, capacity)
    return _prefill(graphdef, params, slots, 0, tokens, lengths, copies=copies)


def _decode(graphdef, params, slots: Slots, ctl: Controls, limit, *, rows, span, chunk, stop_tokens, tool_end, tiers,
            replicated=None):
    """Up to `limit` (<= chunk) decode steps over the first `rows` slots
    -> (slots, tokens (rows, chunk), forced (rows, chunk) bool, steps).

    Attention reads only the first `span` cache positions, which must hold every live row to the end of the
    call: reading the whole cache for every row at every step would make a batch of short conversations cost
    like a batch of full contexts. The at most `chunk` positions written per row are copied back at the end,
    unless `rows` and `span` are all of the slots (an _extract-ed part), which are then updated in place.

    A row is live from the start (if active) until it emits a stop token or spends its `remaining` budget;
    after that its position is frozen (it keeps computing, harmlessly, in place). The loop ends early when no
    row is live or when a live row emitted `tool_end` (the host must run the tool before that row goes on).
    `replicated`: a sharding the outputs the host reads are pinned to (every device of a multi-process mesh).
    """
    model = nnx.merge(graphdef, params)
    cast_for_compute(model)
    weights = params if replicated is None and narrow_weights(params, model.dtype) else None  # see narrow_weights
    forced = jnp.where(ctl.push[:, None], ctl.push_queue, slots.forced)
    forced_len = jnp.where(ctl.push, ctl.push_len, slots.forced_len)
    forced_pos = jnp.where(ctl.push, 0, slots.forced_pos)
    r = slice(0, rows)
    f_queue, f_len = forced[r], forced_len[r]
    temperature, top_k, top_p, remaining = ctl.temperature[r], ctl.top_k[r], ctl.top_p[r], ctl.remaining[r]
    streams = jax.vmap(lambda s, lane: jax.random.fold_in(jax.random.key(s), lane))(ctl.seed[r], ctl.lane[r])
    offsets = ctl.offset[r]
    stops = jnp.asarray(tuple(stop_tokens) or (-1,), jnp.int32)
    row_ids = jnp.arange(rows)

    def cond(c):
        _, _, _, _, _, step, live, paused, _ = c
        return (step < limit) & jnp.any(live) & ~paused

    def body(c):
        cache, logits, f_pos, out, was_forced, step, live, _, weights = c
        m = model
        if weights is not None:
            m, weights = loop_weights(graphdef, weights)
        keys = jax.vmap(jax.random.fold_in)(streams, offsets + step)
        sampled = sample_rows(logits, keys, temperature, top_k, top_p, tiers, barrier=replicated is None)
        is_forced = f_pos < f_len
        token = jnp.where(is_forced, f_queue[row_ids, jnp.minimum(f_pos, f_queue.shape[1] - 1)], sampled)
        new_logits, new_cache = m.forward_cached(token[:, None], cache)
        new_cache = dataclasses.replace(new_cache, pos=jnp.where(live, new_cache.pos, cache.pos))
        ended = jnp.isin(token, stops) | (step + 1 >= remaining)
        paused = jnp.any(live & ~ended & (token == tool_end))
        return (new_cache, new_logits[:, 0], f_pos + (is_forced & live), out.at[:, step].set(token),
                was_forced.at[:, step].set(is_forced), step + 1, live & ~ended, paused, weights)

    live = ctl.active[r] & (remaining > 0)
    init = (take_rows(slots.cache, rows, span), slots.logits[r], forced_pos[r], jnp.zeros((rows, chunk), jnp.int32),
            jnp.zeros((rows, chunk), bool), jnp.int32(0), live, jnp.bool_(False), weights)
    cache, logits, f_pos, out, was_forced, steps, _, _, _ = jax.lax.while_loop(cond, body, init)
    whole = (rows, span) == extent(slots.cache)
    slots = Slots(cache=cache if whole else put_rows(slots.cache, cache, slots.cache.pos[r], chunk),
                  logits=slots.logits.at[r].set(logits),
                  forced=forced, forced_len=forced_len, forced_pos=forced_pos.at[r].set(f_pos))
    if replicated is not None:  # fetching an array split over another process's devices fails
        out, was_forced, steps = (jax.lax.with_sharding_constraint(x, replicated) for x in (out, was_forced, steps))
    return slots, out, was_forced, steps


class Programs:
    """The jitted programs for one model structure (closing over its graphdef, which holds Python lists and so
    cannot be a static jit argument) and the mesh its parameters live on.

    start(params, tokens, lengths, copies=, rows=, capacity=) -> Slots
    prefill(params, slots, start, tokens, lengths, copies=) -> Slots            (slots donated)
    move(slots, src, dst) -> Slots                                             (slots donated)
    extract(slots, rows=, span=) -> Slots; flush(slots, part) -> Slots          (flush: slots donated)
    decode(params, slots, controls, limit, rows=, span=, chunk=, stop_tokens=, tool_end=, tiers=)
        -> (slots, tokens, forced, steps)                                      (slots donated)
    """

    def __init__(self, graphdef, mesh=None, options: tuple = ()):
        self.graphdef, self.mesh, self.options = graphdef, mesh, options
        replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        jit = functools.partial(jax.jit, compiler_options=dict(options) or None)
        self.start = jit(functools.partial(_start, graphdef), static_argnames=("copies", "rows", "capacity"))
        self.prefill = jit(functools.partial(_prefill, graphdef), donate_argnames=("slots",), static_argnames=("copies",))
        self.move = jax.jit(_move, donate_argnames=("slots",))
        self.extract = jax.jit(_extract, static_argnames=("rows", "span"))
        self.flush = jax.jit(_flush, donate_argnames=("slots",))
        self.decode = jit(functools.partial(_decode, graphdef, replicated=replicated), donate_argnames=("slots",),
                          static_argnames=("rows", "span", "chunk", "stop_tokens", "tool_end", "tiers"))


_PROGRAMS: list[Programs] = []  # most recent last; a graphdef is unhashable, so it is found by equality


def programs_for(graphdef, mesh=None, options: tuple = ()) -> Programs:
    """The programs of one model structure: models (and servers) of the same shape share compilations.
    options: XLA compiler options as (name, value) pairs (`compiler_options`)."""
    for p in _PROGRAMS:
        if p.mesh == mesh and p.options == options and p.graphdef == graphdef:
            return p
    _PROGRAMS[:] = _PROGRAMS[-7:] + [Programs(graphdef, mesh, options)]
    return _PROGRAMS[-1]


def compiler_options(params) -> tuple:
    """XLA options for the generation programs of these parameters, as (name, value) pairs.

    On a CPU, int8 weights get 512-bit vectors where the processor has them (AVX-512): their matrix-vector
    products are XLA's own loops that convert each weight as they read it, bound by that conversion rather than
    by memory, and they run ~1.6x faster that wide (a 32k-vocabulary lm_head: ~0.30 -> ~0.18 ms on a Zen 4 core
    pair; batch-1 decode of a d4 model +25% in interleaved runs). Float weights go through library kernels or
    stream from memory and gain nothing (they lost a little in the same test), so they keep XLA's default.
    """
    if jax.default_backend() == "cpu" and any(x.dtype == jnp.int8 for x in jax.tree.leaves(params)):
        return (("xla_cpu_prefer_vector_width", 512),)
    return ()


def programs(model) -> tuple[Programs, nnx.State]:
    """(compiled programs, current parameters) for a model; parameters are read afresh on every call so
    in-place updates (RL) are always seen."""
    graphdef, params = nnx.split(model)
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    mesh = sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1 else None
    return programs_for(graphdef, mesh, compiler_options(params)), params


def decode_chunk(n: int) -> int:
    """Static chunk size (a power of two) that holds n decode steps."""
    return 1 << max(n - 1, 0).bit_length()


# -----------------------------------------------------------------------------
# Users of the core: generate (one call) and the streaming Engine


def generate(model, prompts, max_tokens, *, temperature=1.0, top_k=None, top_p=None, seed=0, stop_tokens=(),
             capacity=None) -> list[list[int]]:
    """Continue each prompt (a list of ids; lengths may differ) by up to max_tokens tokens, in one jitted loop.

    Row b samples as lane b of `seed`. A row ends after its first stop token, which is included. Returns the
    new tokens of each row.
    """
    _check_sampling(temperature, top_k, top_p)
    capacity = capacity or model.config.sequence_len
    tokens, lengths = pad_prompts(prompts, capacity, max_tokens)
    n, stop_tokens = len(prompts), tuple(int(t) for t in stop_tokens)
    progs, params = programs(model)
    slots = progs.start(params, tokens, lengths, copies=1, rows=n, capacity=capacity)
    ctl = controls(n, remaining=max_tokens, seed=seed, lane=np.arange(n), temperature=temperature, top_k=top_k or 0,
                   top_p=top_p or 1.0)
    span = attention_span(int(lengths.max()) + max_tokens, capacity)
    _, out, _, steps = progs.decode(params, slots, ctl, np.int32(max_tokens), rows=n, span=span,
                                    chunk=decode_chunk(max_tokens), stop_tokens=stop_tokens, tool_end=-1,
                                    tiers=(top_k,) if top_k else ())
    out, steps = jax.device_get((out, steps))
    return [_until_stop(row[: int(steps)].tolist(), stop_tokens) for row in out]


def _until_stop(tokens: list[int], stop_tokens) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop_tokens:
            return tokens[: i + 1]
    return tokens


class Engine:
    """nanochat's Engine on the jitted core: `generate` streams (token column, mask column) per step."""

    def __init__(self, model, tokenizer, *, capacity=None, use_sandbox=False, stream_chunk=STREAM_CHUNK,
                 draft_model=None, draft_steps=4, compact=False):
        self.model, self.draft_model, self.draft_steps = model, draft_model, draft_steps
        # compact=True: generate_many packs the rows still going into fewer slots once half of them have stopped.
        # It pays on a CPU, where a decode step's time grows with its rows, for long jobs (RL): each width is
        # one more compile (~1 s for the laptop demo's model), which a short job does not earn back
        self.compact = compact
        self.tokenizer = tokenizer
        lengths = [m.config.sequence_len for m in (model, draft_model) if m is not None]
        self.capacity = capacity or min(lengths)
        self.use_sandbox = use_sandbox  # False (default): calculator only, as nanochat; True: also run other code
        self.stream_chunk = stream_chunk
        self.python_end = tokenizer.encode_special("<|python_end|>")
        self.stop_tokens = stop_tokens(tokenizer)

    def run_tool(self, expr: str) -> str | None:
        """The calculator (arithmetic, str.count), as nanochat; with use_sandbox=True anything else runs in the
        sandbox (flaxchat.generate.sandbox, 5 s limit): opt-in, so training, evaluation and chat score the same tool.

        With several processes, process 0 runs it and every process forces its answer: a sandbox that timed
        out on one host only would otherwise send the processes' decode loops different ways (a hang).
        """
        if jax.process_count() > 1:
            return from_main_process(self._run_tool(expr) if is_main_process() else None)
        return self._run_tool(expr)

    def _run_tool(self, expr: str) -> str | None:
        result = use_calculator(expr)
        if result is None and self.use_sandbox:
            result = run_python(expr)
        return result

    def generate(self, tokens, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42, top_p=None):
        """Yield (token_column, mask_column) lists, one entry per row; mask 1 = sampled, 0 = forced by the tool.

        One prefill of `tokens` is shared by num_samples rows (lanes 0.. of `seed`). Stops when every row has
        emitted <|assistant_end|> or <|bos|>, after max_tokens columns, or when the KV cache is full. Entries
        of a row after its stop token are meaningless. With a draft model, one sample is drawn by speculative
        sampling (the same distribution; several samples use the plain loop).
        """
        check_prompt(tokens)
        if self.draft_model is not None and num_samples == 1:
            tokens = [int(t) for t in tokens]
            room = self.capacity - len(tokens)
            max_tokens = room if max_tokens is None else min(max_tokens, room)
            padded, lengths = pad_prompts([tokens], self.capacity, max(max_tokens, 1))
            yield from self._speculate(padded[0], lengths[0], max_tokens, temperature, top_k, top_p, seed)
            return
        for column, mask_column, _ in self.generate_many([tokens], num_samples, max_tokens, temperature, top_k,
                                                         [seed], top_p):
            yield column, mask_column

    def generate_many(self, prompts, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seeds=42,
                      top_p=None):
        """`generate` for several prompts in one batch (evaluation, RL rollouts): yield (token_column,
        mask_column, live) lists, where live[i] says row i had not stopped before this column (else its entry is
        meaningless). Rows p * num_samples + j are prompt p's samples, drawn as generate(prompts[p],
        num_samples, seed=seeds[p]) draws them (lane j of seeds[p]; `seeds` may be one int for every prompt).
        Each row stops at its stop token, after max_tokens tokens, or when its prompt's room in the KV cache is
        spent; the columns end when every row has stopped. A decode step reads the weights once for all its
        rows, so one batch of many prompts beats a call per prompt (the laptop demo's model on 2 CPU cores:
        1,176 tok/s at one row, 4,037 at 16).
        """
        for p in prompts:
            check_prompt(p)
        _check_sampling(temperature, top_k, top_p)
        prompts = [[int(t) for t in p] for p in prompts]
        n = len(prompts) * num_samples
        seeds = [seeds] * len(prompts) if isinstance(seeds, numbers.Integral) else list(seeds)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        padded, lengths = pad_prompts(prompts, self.capacity)  # every prompt leaves room for a token
        rooms = np.repeat(self.capacity - lengths, num_samples)
        budget = rooms if max_tokens is None else np.minimum(rooms, max_tokens)
        progs, params = programs(self.model)
        slots = progs.start(params, padded, lengths, copies=num_samples, rows=n, capacity=self.capacity)
        replies = [Reply(self.tokenizer, self.run_tool, text=False) for _ in range(n)]
        row_seeds, lanes = np.repeat(seeds, num_samples), np.tile(np.arange(num_samples), len(prompts))
        held = np.arange(n)  # held[s]: the row in slot s (-1: none); decode runs over these len(held) slots
        last = np.zeros(n, np.int64)  # each row's latest token: what a row no slot holds shows in a column
        pushes: dict[int, list[int]] = {}
        # the first call makes one token: time to first token is one prefill + one step
        emitted, chunk, longest = 0, 1, int(lengths.max())
        going_at = lambda k: np.array([not r.ended and k < b for r, b in zip(replies, budget)])  # rows going at k
        while (going := going_at(emitted)).any():
            if self.compact and going.sum() <= len(held) // 2 and len(held) > COMPACT_MIN_ROWS:
                slots, held = compact(progs, slots, held, going)
            on = held >= 0
            slot_row = np.zeros(n, int)  # controls cover all n slots; those past len(held) are inactive
            slot_row[:len(held)] = np.maximum(held, 0)
            active = np.zeros(n, bool)
            active[:len(held)] = on & going[slot_row[:len(held)]]
            limit = min(emitted + chunk, int(budget.max())) - emitted
            ctl = controls(n, active=active, remaining=np.where(active, np.maximum(budget[slot_row] - emitted, 0), 0),
                           offset=emitted, seed=row_seeds[slot_row], lane=lanes[slot_row], temperature=temperature,
                           top_k=top_k or 0, top_p=top_p or 1.0,
                           pushes={int(np.flatnonzero(held == r)[0]): tokens for r, tokens in pushes.items()})
            span = attention_span(longest + emitted + limit, self.capacity)  # every position this call can write
            slots, out, forced, steps = progs.decode(
                params, slots, ctl, np.int32(limit), rows=len(held), span=span, chunk=self.stream_chunk,
                stop_tokens=self.stop_tokens, tool_end=self.python_end, tiers=(top_k,) if top_k else ())
            out, forced, steps = jax.device_get((out, forced, steps))
            pushes = {}
            for t in range(int(steps)):
                live = going_at(emitted + t)
                last[held[on]] = out[on, t]
                sampled = np.ones(n, bool)
                sampled[held[on]] = ~forced[on, t]
                column = last.tolist()
                for i in np.flatnonzero(live):
                    _, push = replies[i].feed(column[i])
                    if push:  # the loop paused right after the python_end: forced from the next call on
                        pushes[int(i)] = push
                yield column, sampled.astype(int).tolist(), live.tolist()
            emitted, chunk = emitted + int(steps), min(2 * chunk, self.stream_chunk)

    def _speculate(self, prompt, length, max_tokens, temperature, top_k, top_p, seed):
        """One sample by speculative sampling, streamed as (column, mask) pairs like `generate`."""
        from flaxchat.generate import speculative

        rule = speculative._check(temperature, top_k, top_p, self.draft_steps)
        progs, params = speculative.programs(self.model, self.draft_model)
        spec, first = progs.start(params, prompt, length, jax.random.key(seed), capacity=self.capacity, rule=rule)
        reply = Reply(self.tokenizer, self.run_tool, text=False)
        queue, emitted, chunk = [(int(first), 1)], 0, 1
        while queue:
            push = None
            for token, mask in queue:
                yield [token], [mask]
                emitted += 1
                ended, push = reply.feed(token)
                if ended or emitted >= max_tokens:
                    return
            if push:  # the last token was the tool's end: its output goes into both caches, then on
                spec = progs.push(params, spec, push)
                queue = [(t, 0) for t in push]
                continue
            spec, out, n = progs.run(params, spec, np.int32(min(chunk, max_tokens - emitted)), k=self.draft_steps,
                                     rule=rule, stops=self.stop_tokens, tool_end=self.python_end, chunk=self.stream_chunk)
            queue = [(t, 1) for t in np.asarray(out)[: int(n)].tolist()]  # none: the cache is full
            chunk = min(2 * chunk, self.stream_chunk)

    def generate_batch(self, tokens, num_samples=1, **kwargs):
        """Non-streaming: (sequences, masks), each sequence = prompt + generated tokens without the terminal
        token (nanochat's return value); decode with tokenizer.decode(seq[len(tokens):]) for the text."""
        if self.draft_model is not None and num_samples == 1:
            stream = ((column, masks, [True]) for column, masks in self.generate(tokens, 1, **kwargs))
            return collect(stream, [tokens], 1, self.stop_tokens)[0]
        return self.generate_batches([tokens], num_samples, seeds=kwargs.pop("seed", 42), **kwargs)[0]

    def generate_batches(self, prompts, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seeds=42,
                         top_p=None):
        """generate_batch for several prompts in one batch (generate_many): [(sequences, masks)] per prompt."""
        stream = self.generate_many(prompts, num_samples, max_tokens, temperature, top_k, seeds, top_p)
        return collect(stream, prompts, num_samples, self.stop_tokens)


def compact(progs, slots: Slots, held: np.ndarray, going: np.ndarray) -> tuple[Slots, np.ndarray]:
    """Move the slots of the rows still going to the lowest slots; the next decode runs over the smallest power
    of two holding them, at least COMPACT_MIN_ROWS (on a CPU a decode step costs about its rows, and half of an
    RL batch's row-steps went to rows that had stopped). -> (slots, held)."""
    src = np.flatnonzero((held >= 0) & going[np.maximum(held, 0)])
    if len(src) == 0:
        return slots, held
    if (src != np.arange(len(src))).any():
        pad = np.full(len(held) - len(src), src[0])  # a fixed shape; a repeated (src, dst) pair is harmless
        slots = progs.move(slots, np.concatenate([src, pad]), np.concatenate([np.arange(len(src)), np.zeros_like(pad)]))
    width = max(1 << (len(src) - 1).bit_length(), COMPACT_MIN_ROWS)
    return slots, np.concatenate([held[src], np.full(width - len(src), -1)])


def check_prompt(tokens) -> None:
    if isinstance(tokens, (str, bytes)) or not all(isinstance(t, numbers.Integral) for t in tokens):
        raise ValueError("tokens must be a list of token ids (ints)")


def collect(stream, prompts, num_samples: int, stop_tokens) -> list[tuple[list[list[int]], list[list[int]]]]:
    """generate_many's (column, mask column, live) triples as nanochat's generate_batch returns them, grouped by
    prompt: for each prompt (sequences, masks), a sequence being the prompt and its sample's tokens up to
    (without) its stop token."""
    rows = [p for p in prompts for _ in range(num_samples)]
    results = [[int(t) for t in p] for p in rows]
    masks = [[0] * len(p) for p in rows]
    completed = [False] * len(rows)
    for column, mask_column, live in stream:
        for i, (token, mask) in enumerate(zip(column, mask_column)):
            if completed[i] or not live[i]:
                continue
            if token in stop_tokens:
                completed[i] = True
            else:
                results[i].append(token)
                masks[i].append(mask)
        if all(completed):
            break
    return [(results[p * num_samples:(p + 1) * num_samples], masks[p * num_samples:(p + 1) * num_samples])
            for p in range(len(prompts))]


# -----------------------------------------------------------------------------
# Measurement (scripts/bench.py --what generate)


def measure_generation(model, batch_size, prompt_len, max_new_tokens, seed=0, temperature=1.0, top_k=None,
                       repeats=3) -> dict:
    """Time prefill and the jitted decode loop on random prompts, every row making all max_new_tokens tokens.

    tok_per_s: generated tokens over all rows / decode time; ttft_s: prefill + the first sampled token,
    on the host; prefill_tok_per_s: prompt tokens over all rows / prefill time; e2e_tok_per_s: generated
    tokens / (prefill + decode); compile_s: first (compiling) run minus a warm one. Timings are medians
    over `repeats` warm runs.
    """
    capacity = model.config.sequence_len
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, model.config.vocab_size, (batch_size, prompt_len)).tolist()
    tokens, lengths = pad_prompts(prompts, capacity, max_new_tokens)
    progs, params = programs(model)
    span = attention_span(prompt_len + max_new_tokens, capacity)
    decode = functools.partial(progs.decode, rows=batch_size, span=span, chunk=decode_chunk(max_new_tokens),
                               stop_tokens=(), tool_end=-1, tiers=(top_k,) if top_k else ())
    ctl = controls(batch_size, remaining=max_new_tokens, seed=seed, lane=np.arange(batch_size),
                   temperature=temperature, top_k=top_k or 0)

    def prefill():
        return progs.start(params, tokens, lengths, copies=1, rows=batch_size, capacity=capacity)

    def one_run():
        t0 = time.perf_counter()
        slots = jax.block_until_ready(prefill())
        t1 = time.perf_counter()
        slots, out, _, steps = jax.block_until_ready(decode(params, slots, ctl, np.int32(max_new_tokens)))
        t2 = time.perf_counter()
        _, first, _, _ = decode(params, prefill(), ctl, np.int32(1))
        np.asarray(first[:, 0])  # the first tokens, on the host
        t3 = time.perf_counter()
        assert int(steps) == max_new_tokens
        return t1 - t0, t2 - t1, t3 - t2

    t0 = time.perf_counter()
    one_run()  # compiles prefill and decode
    cold = time.perf_counter() - t0
    runs = [one_run() for _ in range(repeats)]
    prefill_s, decode_s, ttft_s = (statistics.median(x) for x in zip(*runs))
    generated = batch_size * max_new_tokens
    return {
        "batch_size": batch_size, "prompt_len": prompt_len, "max_new_tokens": max_new_tokens,
        "temperature": temperature, "top_k": top_k,
        "tok_per_s": generated / decode_s,
        "decode_steps_per_s": max_new_tokens / decode_s,
        "ttft_s": ttft_s,
        "prefill_tok_per_s": batch_size * prompt_len / prefill_s,
        "e2e_tok_per_s": generated / (prefill_s + decode_s),
        "compile_s": max(cold - sum(statistics.median(x) for x in zip(*runs)), 0.0),
        "repeats": repeats,
    }
