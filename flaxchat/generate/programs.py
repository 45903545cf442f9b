"""The generation core's device state and its jitted programs (the "model runner" of the generation core).

- `Slots`: a KV cache of N rows (`flaxchat.model.gpt.KVCache`, a position per row) with each row's next-token logits
  and a queue of tokens to force (a tool's output).
- prefill: prompts padded to a power-of-two bucket, run once, written into rows of the slots (one prompt may be
  copied into several rows: num_samples draws share its prefill); extend: a prompt's tail prefilled after what a row
  already holds (prefix reuse).
- decode: a `lax.while_loop` over every row of the slots it is given. Each row has its own sampling settings, seed,
  token budget and forced tokens (`Controls`); a row freezes when it stops; the loop returns early when every row
  stopped or a row closed a tool call, so the host can run the tool. Its state is a named dataclass (`Loop`).
- extract / flush: the (rows, span) part of the slots a run of decode chunks works on, and writing it back. Attention
  then reads only the positions the rows use: a batch of short conversations does not cost like full contexts.
- move: rows from one slot to another (packing live rows low); score: a prompt's log-probabilities.

`Programs` holds them jitted for one model structure; `programs(model)` finds them (models of the same shape share
compilations). Randomness is explicit: token n of row `lane` of a request with `seed` draws with
fold_in(fold_in(key(seed), lane), n), so the same seed gives the same tokens however the loop is cut into calls,
whichever slot the row lands in and whoever else is in the batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat.generate.reply import FORCED_CAPACITY
from flaxchat.generate.sampling import sample_rows, token_logprobs
from flaxchat.model import cpu
from flaxchat.model.gpt import KVCache, rms_norm

MIN_BUCKET = 16  # smallest padded prompt length


def bucket_length(n: int, capacity: int) -> int:
    """Padded length for an n-token prompt: the next power of two (at least MIN_BUCKET), at most capacity."""
    return min(max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length()), capacity)


def attention_span(positions_needed: int, capacity: int) -> int:
    """Cache positions a decode chunk attends over: a power of two (at least capacity/16, at least 64) holding
    `positions_needed`, at most the capacity. Few distinct spans keep the number of compiled programs small."""
    floor = max(64, capacity // 16)
    return min(max(floor, 1 << max(positions_needed - 1, 0).bit_length()), capacity)


def decode_chunk(n: int) -> int:
    """Static chunk size (a power of two) that holds n decode steps."""
    return 1 << max(n - 1, 0).bit_length()


def pad_prompts(prompts, capacity: int, max_new_tokens: int = 1, width: int | None = None):
    """Prompts (lists of ids) -> (tokens (B, width) int32, lengths (B,) int32), checked against the cache; width
    defaults to the longest prompt's bucket.

    Each row is padded with its own last token: a padded prefill then leaves the smear state (the embedding of the
    last token fed) exactly as an unpadded one would; the padding's K/V sit past the row's position and are never
    attended to.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (start it with <|bos|>)")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > capacity:
        raise ValueError(
            f"a {longest}-token prompt leaves no room for {max_new_tokens} new tokens in a "
            f"{capacity}-token KV cache; shorten the prompt"
        )
    width = width or bucket_length(longest, capacity)
    tokens = np.array([list(p) + [p[-1]] * (width - len(p)) for p in prompts], dtype=np.int32)
    return tokens, np.array([len(p) for p in prompts], dtype=np.int32)


# -----------------------------------------------------------------------------
# Parameters and caches


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

    Entries past pos stay in memory but are invisible (a query never sees keys after its own position) and are
    overwritten as decoding resumes. The smear state is recomputed the way forward_cached computes it: the
    normalised embedding of the last token.
    """
    prev = rms_norm(model.transformer.wte(last_token, model.dtype))
    return dataclasses.replace(cache, pos=pos.astype(jnp.int32), prev_embedding=prev.astype(cache.prev_embedding.dtype))


# -----------------------------------------------------------------------------
# Device state


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Slots:
    """What lives on the device between calls, one row per slot."""

    cache: KVCache
    logits: jax.Array  # (N, V) fp32: each row's next-token distribution
    forced: jax.Array  # (N, F) int32: per-row queue of tokens to force (a tool's output)
    forced_len: jax.Array  # (N,) int32
    forced_pos: jax.Array  # (N,) int32: next queue entry to emit

    @property
    def extent(self) -> tuple[int, int]:
        """(rows, span): the slots and the cache positions each holds."""
        return self.cache.pos.shape[0], self.cache.k[0].shape[2]


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


def controls(
    n: int,
    *,
    active=True,
    remaining=0,
    offset=0,
    seed=0,
    lane=0,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    pushes: dict[int, list[int]] | None = None,
) -> Controls:
    """Controls for n rows from per-row sequences or one value for all; pushes: {row: tokens to force}."""
    row = lambda x, dtype: np.broadcast_to(np.asarray(x, dtype), (n,)).copy()
    queue, qlen = np.zeros((n, FORCED_CAPACITY), np.int32), np.zeros(n, np.int32)
    for i, tokens in (pushes or {}).items():
        queue[i, : len(tokens)], qlen[i] = tokens, len(tokens)
    return Controls(
        active=row(active, bool),
        remaining=row(remaining, np.int32),
        offset=row(offset, np.int32),
        seed=row(np.asarray(seed, np.int64) % 2**31, np.int32),
        lane=row(lane, np.int32),
        temperature=row(temperature, np.float32),
        top_k=row(top_k, np.int32),
        top_p=row(top_p, np.float32),
        push=qlen > 0,
        push_queue=queue,
        push_len=qlen,
    )


def empty_slots(model, rows: int, capacity: int) -> Slots:
    """Slots of `rows` rows over a `capacity`-position cache: nothing cached, no tokens to force."""
    zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
    return Slots(
        cache=model.init_cache(rows, capacity),
        logits=jnp.zeros((rows, model.config.vocab_size), jnp.float32),
        forced=zeros(rows, FORCED_CAPACITY),
        forced_len=zeros(rows),
        forced_pos=zeros(rows),
    )


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """The decode program's static settings (one compile per distinct value): at most `chunk` steps per call; a row
    stops at one of `stop_tokens`; the loop pauses after `tool_end` (the host runs the tool); `tiers`: the sampler's
    static top-k sizes; `top_logprobs` = k also returns each emitted token's logprob and k likeliest alternatives."""

    chunk: int
    stop_tokens: tuple[int, ...] = ()
    tool_end: int = -1
    tiers: tuple[int, ...] = ()
    top_logprobs: int | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Loop:
    """The decode loop's state, carried from step to step."""

    cache: KVCache
    logits: jax.Array  # (R, V): each row's next-token distribution
    forced_pos: jax.Array  # (R,): next entry of the row's forced queue
    tokens: jax.Array  # (R, chunk): what each step emitted
    forced: jax.Array  # (R, chunk) bool: the token came from the forced queue
    step: jax.Array  # (): steps taken
    live: jax.Array  # (R,) bool: the row has not stopped
    paused: jax.Array  # () bool: a live row closed a tool call
    weights: Any  # narrow weights carried through the loop (see narrow_weights), or None
    scores: Any  # None, or (logprob (R, chunk), top values (R, chunk, k), top ids (R, chunk, k))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Emitted:
    """What a decode call hands back to the host."""

    tokens: jax.Array  # (R, chunk) int32; entries past `steps`, or past a row's stop, mean nothing
    forced: jax.Array  # (R, chunk) bool
    steps: jax.Array  # () int32
    scores: Any  # as Loop.scores


# -----------------------------------------------------------------------------
# The programs


def _prefill(graphdef, params, slots: Slots, start, tokens, lengths, *, copies: int = 1) -> Slots:
    """Prefill padded prompts (B, T) and write them, each into `copies` consecutive rows, from row `start` on."""
    model = nnx.merge(graphdef, params)
    cast_for_compute(model)
    B = tokens.shape[0]
    logits, part = model.forward_cached(tokens, model.init_cache(B, tokens.shape[1]), logits_at=lengths - 1, fresh=True)
    at = lambda x, new: jax.lax.dynamic_update_slice(
        x, jnp.repeat(new, copies, axis=0).astype(x.dtype), (start,) + (0,) * (x.ndim - 1)
    )
    cache, zero = slots.cache, jnp.zeros((B,), jnp.int32)
    cache = KVCache(
        k=tuple(at(c, n) for c, n in zip(cache.k, part.k)),  # stale entries past T are never attended to
        v=tuple(at(c, n) for c, n in zip(cache.v, part.v)),
        pos=at(cache.pos, lengths),
        prev_embedding=at(cache.prev_embedding, part.prev_embedding),
    )
    forced_len, forced_pos = at(slots.forced_len, zero), at(slots.forced_pos, zero)
    return Slots(cache, at(slots.logits, logits), slots.forced, forced_len, forced_pos)


def _extend(graphdef, params, slots: Slots, row, start, last, tokens, length, *, span: int) -> Slots:
    """Prefill a prompt's tail, tokens (1, T) padded (`length` real), after the first `start` cached positions of row
    `row`, whose token at start - 1 is `last` (prefix reuse: the row holds an earlier prompt and reply that begin
    the same way). Attention reads the row's first `span` positions (static, at least start + T); only the tail's T
    new keys and values are written back: a long row costs as much to copy as the tail's prefill. Entries past
    `start` are overwritten or never read, as after `rewind`."""
    model = nnx.merge(graphdef, params)
    cast_for_compute(model)
    T = tokens.shape[1]
    one = lambda x: jax.lax.dynamic_slice_in_dim(x, row, 1)
    c = slots.cache
    cache = KVCache(
        k=tuple(one(x)[:, :, :span] for x in c.k),  # (1, Hkv, span, D)
        v=tuple(one(x)[..., :span] for x in c.v),  # (1, Hkv, D, span)
        pos=one(c.pos),
        prev_embedding=one(c.prev_embedding),
    )
    cache = rewind(model, cache, jnp.reshape(start, (1,)), jnp.reshape(last, (1,)))
    logits, cache = model.forward_cached(tokens, cache, logits_at=jnp.reshape(length - 1, (1,)))
    tail = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, start, T, axis=axis)  # the T entries just written
    into = lambda x, new, at: jax.lax.dynamic_update_slice(x, new.astype(x.dtype), at)
    put = lambda x, new: into(x, new, (row,) + (0,) * (x.ndim - 1))
    zero = jnp.zeros((1,), jnp.int32)
    cache = KVCache(
        k=tuple(into(x, tail(new, 2), (row, 0, start, 0)) for x, new in zip(c.k, cache.k)),
        v=tuple(into(x, tail(new, 3), (row, 0, 0, start)) for x, new in zip(c.v, cache.v)),
        pos=put(c.pos, jnp.reshape(start + length, (1,)).astype(jnp.int32)),
        prev_embedding=put(c.prev_embedding, cache.prev_embedding),
    )
    return Slots(
        cache, put(slots.logits, logits), slots.forced, put(slots.forced_len, zero), put(slots.forced_pos, zero)
    )


def _start(graphdef, params, tokens, lengths, *, copies: int, rows: int, capacity: int) -> Slots:
    """Fresh slots of `rows` rows with the prompts prefilled from row 0 (one-shot generation's start)."""
    slots = empty_slots(nnx.merge(graphdef, params), rows, capacity)
    return _prefill(graphdef, params, slots, 0, tokens, lengths, copies=copies)


def _move(slots: Slots, src, dst, *, span: int) -> Slots:
    """Copy rows src (M,) to rows dst (M,) (all read before any is written): packing live rows low. Of the cache,
    only the first `span` positions (static: every moved row's content fits) are copied; a long cache's unused end
    would cost more to copy than a decode step. A repeated (src, dst) pair is harmless (it writes the same row
    twice)."""
    rows = lambda x: x.at[dst].set(x[src])
    c = slots.cache
    cache = KVCache(
        k=tuple(x.at[dst, :, :span].set(x[src, :, :span]) for x in c.k),  # (N, Hkv, S, D)
        v=tuple(x.at[dst, ..., :span].set(x[src, ..., :span]) for x in c.v),  # (N, Hkv, D, S)
        pos=rows(c.pos),
        prev_embedding=rows(c.prev_embedding),
    )
    return Slots(cache, rows(slots.logits), rows(slots.forced), rows(slots.forced_len), rows(slots.forced_pos))


def _extract(slots: Slots, *, rows: int, span: int) -> Slots:
    """The first `rows` rows of the slots and their first `span` cache positions (what decode chunks work on)."""
    c = slots.cache
    cache = KVCache(
        k=tuple(x[:rows, :, :span] for x in c.k),
        v=tuple(x[:rows, ..., :span] for x in c.v),
        pos=c.pos[:rows],
        prev_embedding=c.prev_embedding[:rows],
    )
    return Slots(cache, slots.logits[:rows], slots.forced[:rows], slots.forced_len[:rows], slots.forced_pos[:rows])


def _flush(slots: Slots, part: Slots) -> Slots:
    """Write an extracted part (after decoding it) back into slots; positions past its span are untouched."""
    return jax.tree.map(lambda x, new: jax.lax.dynamic_update_slice(x, new, (0,) * x.ndim), slots, part)


def _decode(graphdef, params, slots: Slots, ctl: Controls, limit, *, settings: DecodeSettings, replicated=None):
    """Up to `limit` (<= settings.chunk) decode steps over every row of `slots` -> (slots, Emitted).

    A row is live from the start (if active) until it emits a stop token or spends its `remaining` budget; after
    that its position is frozen (it keeps computing, harmlessly, in place). The loop ends early when no row is live
    or when a live row emitted `tool_end` (the host must run the tool before that row goes on). Attention reads the
    slots' whole span: hand it an extracted part to read fewer positions. `replicated`: a sharding the outputs the
    host reads are pinned to (every device of a multi-process mesh).
    """
    model = nnx.merge(graphdef, params)
    cast_for_compute(model)
    rows, chunk = slots.extent[0], settings.chunk
    forced = jnp.where(ctl.push[:, None], ctl.push_queue, slots.forced)
    forced_len = jnp.where(ctl.push, ctl.push_len, slots.forced_len)
    streams = jax.vmap(lambda s, lane: jax.random.fold_in(jax.random.key(s), lane))(ctl.seed, ctl.lane)
    stops = jnp.asarray(settings.stop_tokens or (-1,), jnp.int32)
    barrier = replicated is None

    def step(s: Loop) -> Loop:
        m, weights = model, s.weights
        if weights is not None:
            m, weights = loop_weights(graphdef, weights)
        keys = jax.vmap(jax.random.fold_in)(streams, ctl.offset + s.step)
        sampled = sample_rows(s.logits, keys, ctl.temperature, ctl.top_k, ctl.top_p, settings.tiers, barrier=barrier)
        is_forced = s.forced_pos < forced_len
        queued = forced[jnp.arange(rows), jnp.minimum(s.forced_pos, FORCED_CAPACITY - 1)]
        token = jnp.where(is_forced, queued, sampled)
        scores = s.scores
        if scores is not None:  # static: the plain program carries None and computes nothing here
            new = token_logprobs(s.logits, token, settings.top_logprobs, barrier=barrier)
            scores = tuple(x.at[:, s.step].set(y) for x, y in zip(scores, new))
        logits, cache = m.forward_cached(token[:, None], s.cache)
        ended = jnp.isin(token, stops) | (s.step + 1 >= ctl.remaining)
        return Loop(
            cache=dataclasses.replace(cache, pos=jnp.where(s.live, cache.pos, s.cache.pos)),
            logits=logits[:, 0],
            forced_pos=s.forced_pos + (is_forced & s.live),
            tokens=s.tokens.at[:, s.step].set(token),
            forced=s.forced.at[:, s.step].set(is_forced),
            step=s.step + 1,
            live=s.live & ~ended,
            paused=jnp.any(s.live & ~ended & (token == settings.tool_end)),
            weights=weights,
            scores=scores,
        )

    scores = None
    if settings.top_logprobs is not None:
        k = min(settings.top_logprobs, slots.logits.shape[-1])
        scores = (jnp.zeros((rows, chunk)), jnp.zeros((rows, chunk, k)), jnp.zeros((rows, chunk, k), jnp.int32))
    start = Loop(
        cache=slots.cache,
        logits=slots.logits,
        forced_pos=jnp.where(ctl.push, 0, slots.forced_pos),
        tokens=jnp.zeros((rows, chunk), jnp.int32),
        forced=jnp.zeros((rows, chunk), bool),
        step=jnp.int32(0),
        live=ctl.active & (ctl.remaining > 0),
        paused=jnp.bool_(False),
        weights=params if replicated is None and narrow_weights(params, model.dtype) else None,
        scores=scores,
    )
    going = lambda s: (s.step < limit) & jnp.any(s.live) & ~s.paused
    end = jax.lax.while_loop(going, step, start)
    out = Emitted(tokens=end.tokens, forced=end.forced, steps=end.step, scores=end.scores)
    if replicated is not None:  # fetching an array split over another process's devices fails
        out = jax.lax.with_sharding_constraint(out, replicated)
    return Slots(end.cache, end.logits, forced, forced_len, end.forced_pos), out


def _score(graphdef, params, tokens, *, top: int):
    """A prompt's log-probabilities on the device: tokens (1, T) -> (logprob of token t+1 at each position t (T,),
    the `top` likeliest next tokens' logprobs (T, top) and ids (T, top)); the last position's logprob reads a
    wrapped-around token and means nothing. Only these leave the device: never the (T, V) log-probabilities."""
    model = nnx.merge(graphdef, params)
    logits = model(tokens)[0]  # (T, V)
    return token_logprobs(logits, jnp.roll(tokens[0], -1), top)


class Programs:
    """The jitted programs for one model structure (closing over its graphdef, which holds Python lists and so cannot
    be a static jit argument) and the mesh its parameters live on. Donated: the slots of prefill, move, flush and
    decode.

    start(params, tokens, lengths, copies=, rows=, capacity=) -> Slots
    prefill(params, slots, start, tokens, lengths, copies=) -> Slots
    extend(params, slots, row, start, last, tokens, length, span=) -> Slots
    decode(params, slots, controls, limit, settings=) -> (Slots, Emitted)
    extract(slots, rows=, span=) -> Slots;  flush(slots, part) -> Slots;  move(slots, src, dst, span=) -> Slots
    score(params, tokens, top=) -> (logprobs (T,), top values (T, top), top ids (T, top))
    """

    def __init__(self, graphdef, mesh=None, options: tuple = ()):
        self.graphdef, self.mesh, self.options = graphdef, mesh, options
        replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        jit = functools.partial(jax.jit, compiler_options=dict(options) or None)
        self.start = jit(functools.partial(_start, graphdef), static_argnames=("copies", "rows", "capacity"))
        self.prefill = jit(functools.partial(_prefill, graphdef), donate_argnames="slots", static_argnames="copies")
        self.extend = jit(functools.partial(_extend, graphdef), donate_argnames="slots", static_argnames="span")
        self.move = jax.jit(_move, donate_argnames="slots", static_argnames="span")
        self.extract = jax.jit(_extract, static_argnames=("rows", "span"))
        self.flush = jax.jit(_flush, donate_argnames="slots")
        self.decode = jit(
            functools.partial(_decode, graphdef, replicated=replicated),
            donate_argnames="slots",
            static_argnames="settings",
        )
        self.score = jit(functools.partial(_score, graphdef), static_argnames="top")


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
    """XLA options for the generation programs of these parameters, as (name, value) pairs (cpu.int8_options)."""
    return cpu.int8_options(params)


def programs(model) -> tuple[Programs, nnx.State]:
    """(compiled programs, current parameters) for a model; parameters are read afresh on every call so in-place
    updates (RL) are always seen."""
    graphdef, params = nnx.split(model)
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    mesh = sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1 else None
    return programs_for(graphdef, mesh, compiler_options(params)), params
