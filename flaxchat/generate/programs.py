"""The generation core's device state and its jitted programs.

- `Slots`: a KV cache of N rows (`flaxchat.model.gpt.KVCache`, fixed capacity, a position per row) with each row's
  next-token logits and a queue of tokens to force (a tool's output).
- One jitted prefill: prompts padded to a power-of-two bucket, run once, written into rows of the slots (one
  prompt may be copied into several rows: num_samples draws share its prefill).
- One jitted decode loop (`lax.while_loop`) over the lowest `rows` slots, attending over only the first `span`
  cache positions (the used part, a power of two). Each row has its own sampling settings, seed, token budget
  and forced tokens (`Controls`); a row freezes when it stops; the loop returns early when every row stopped or
  a row closed a tool call, so the host can run the tool.
- Moving rows between slots, and extracting a (rows, span) part to decode and flushing it back (the server's
  scheduler keeps one part across chunks).
- Log-probabilities when asked (the OpenAI routes' `logprobs`): the decode loop can also return each emitted
  token's raw logprob and top alternatives, and `score` gives a prompt's, both reduced on the device to a few
  numbers per token; without `top_logprobs` the decode loop computes nothing extra.
- Compiling ahead (`Precompiler`): programs lowered from abstract shapes and compiled in a thread of their own,
  most wanted first, while another thread runs the ones already compiled (the server's warmup).

`Programs` holds them jitted for one model structure; `programs(model)` finds them (models of the same shape
share compilations). Randomness is explicit: token n of row `lane` of a request with `seed` draws with
fold_in(fold_in(key(seed), lane), n), so the same seed gives the same tokens however the loop is cut into calls,
whichever slot the row lands in and whoever else is in the batch. The cache helpers here (`rewind`,
`loop_weights`, ...) also serve speculative sampling.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat.common import progress_bar
from flaxchat.generate.reply import FORCED_CAPACITY
from flaxchat.generate.sampling import sample_rows, token_logprobs
from flaxchat.model import cpu
from flaxchat.model.attention import write_cache
from flaxchat.model.gpt import KVCache, rms_norm

log = logging.getLogger(__name__)

MIN_BUCKET = 16  # smallest padded prompt length


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
        raise ValueError(
            f"a {longest}-token prompt leaves no room for {max_new_tokens} new tokens in a "
            f"{capacity}-token KV cache; shorten the prompt"
        )
    width = bucket_length(longest, capacity)
    tokens = np.array([list(p) + [p[-1]] * (width - len(p)) for p in prompts], dtype=np.int32)
    return tokens, np.array([len(p) for p in prompts], dtype=np.int32)


# -----------------------------------------------------------------------------
# Cache helpers (functions over KVCache)


def take_rows(cache: KVCache, rows: int, span: int) -> KVCache:
    """The first `rows` slots and the first `span` positions of the cache (what a decode chunk touches)."""
    return KVCache(
        k=tuple(c[:rows, :, :span] for c in cache.k),
        v=tuple(c[:rows, ..., :span] for c in cache.v),
        pos=cache.pos[:rows],
        prev_embedding=cache.prev_embedding[:rows],
    )


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

    return KVCache(
        k=put_layers(cache.k, part.k, 2),
        v=put_layers(cache.v, part.v, 3),
        pos=cache.pos.at[:rows].set(part.pos),
        prev_embedding=cache.prev_embedding.at[:rows].set(part.prev_embedding),
    )


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
# Device state and the programs


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
    cache = KVCache(
        k=tuple(at(c, n) for c, n in zip(cache.k, part.k)),  # stale entries past T are never attended to
        v=tuple(at(c, n) for c, n in zip(cache.v, part.v)),
        pos=at(cache.pos, lengths),
        prev_embedding=at(cache.prev_embedding, part.prev_embedding),
    )
    return Slots(
        cache=cache,
        logits=at(slots.logits, logits),
        forced=slots.forced,
        forced_len=at(slots.forced_len, zero),
        forced_pos=at(slots.forced_pos, zero),
    )


def _move(slots: Slots, src, dst) -> Slots:
    """Copy every per-row array's rows src (M,) to rows dst (M,) (all read before any is written): the scheduler
    packing its live rows low. A repeated (src, dst) pair is harmless (it writes the same row twice)."""
    return jax.tree.map(lambda x: x.at[dst].set(x[src]), slots)


def _extract(slots: Slots, *, rows: int, span: int) -> Slots:
    """The part of slots a run of decode chunks works on: the first `rows` rows, their first `span` cache
    positions. Decoding it directly (its rows and span are the whole of it) copies nothing in or out."""
    r = slice(0, rows)
    return Slots(
        cache=take_rows(slots.cache, rows, span),
        logits=slots.logits[r],
        forced=slots.forced[r],
        forced_len=slots.forced_len[r],
        forced_pos=slots.forced_pos[r],
    )


def _flush(slots: Slots, part: Slots) -> Slots:
    """Write an extracted part (after decoding it) back into slots; positions past its span are untouched."""
    return jax.tree.map(lambda x, new: jax.lax.dynamic_update_slice(x, new, (0,) * x.ndim), slots, part)


def _start(graphdef, params, tokens, lengths, *, copies: int, rows: int, capacity: int) -> Slots:
    """Fresh slots of `rows` rows with the prompts prefilled from row 0 (the Engine's and generate's start)."""
    slots = empty_slots(nnx.merge(graphdef, params), rows, capacity)
    return _prefill(graphdef, params, slots, 0, tokens, lengths, copies=copies)


def _decode(
    graphdef,
    params,
    slots: Slots,
    ctl: Controls,
    limit,
    *,
    rows,
    span,
    chunk,
    stop_tokens,
    tool_end,
    tiers,
    top_logprobs=None,
    replicated=None,
):
    """Up to `limit` (<= chunk) decode steps over the first `rows` slots
    -> (slots, tokens (rows, chunk), forced (rows, chunk) bool, steps, scores).

    scores: None, or with `top_logprobs` = k the raw log-probabilities of what each step emitted (sampling.
    token_logprobs): (logprob (rows, chunk), top k values (rows, chunk, k), their ids (rows, chunk, k)).

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
        _, _, _, _, _, step, live, paused, _, _ = c
        return (step < limit) & jnp.any(live) & ~paused

    def body(c):
        cache, logits, f_pos, out, was_forced, step, live, _, weights, scores = c
        m = model
        if weights is not None:
            m, weights = loop_weights(graphdef, weights)
        keys = jax.vmap(jax.random.fold_in)(streams, offsets + step)
        sampled = sample_rows(logits, keys, temperature, top_k, top_p, tiers, barrier=replicated is None)
        is_forced = f_pos < f_len
        token = jnp.where(is_forced, f_queue[row_ids, jnp.minimum(f_pos, f_queue.shape[1] - 1)], sampled)
        if scores is not None:  # static: the fast path carries None and computes nothing here
            new = token_logprobs(logits, token, top_logprobs, barrier=replicated is None)
            scores = tuple(s.at[:, step].set(x) for s, x in zip(scores, new))
        new_logits, new_cache = m.forward_cached(token[:, None], cache)
        new_cache = dataclasses.replace(new_cache, pos=jnp.where(live, new_cache.pos, cache.pos))
        ended = jnp.isin(token, stops) | (step + 1 >= remaining)
        paused = jnp.any(live & ~ended & (token == tool_end))
        return (
            new_cache,
            new_logits[:, 0],
            f_pos + (is_forced & live),
            out.at[:, step].set(token),
            was_forced.at[:, step].set(is_forced),
            step + 1,
            live & ~ended,
            paused,
            weights,
            scores,
        )

    live = ctl.active[r] & (remaining > 0)
    scores = None
    if top_logprobs is not None:
        k = min(top_logprobs, slots.logits.shape[-1])
        scores = (
            jnp.zeros((rows, chunk), jnp.float32),
            jnp.zeros((rows, chunk, k), jnp.float32),
            jnp.zeros((rows, chunk, k), jnp.int32),
        )
    init = (
        take_rows(slots.cache, rows, span),
        slots.logits[r],
        forced_pos[r],
        jnp.zeros((rows, chunk), jnp.int32),
        jnp.zeros((rows, chunk), bool),
        jnp.int32(0),
        live,
        jnp.bool_(False),
        weights,
        scores,
    )
    cache, logits, f_pos, out, was_forced, steps, _, _, _, scores = jax.lax.while_loop(cond, body, init)
    whole = (rows, span) == extent(slots.cache)
    slots = Slots(
        cache=cache if whole else put_rows(slots.cache, cache, slots.cache.pos[r], chunk),
        logits=slots.logits.at[r].set(logits),
        forced=forced,
        forced_len=forced_len,
        forced_pos=forced_pos.at[r].set(f_pos),
    )
    if replicated is not None:  # fetching an array split over another process's devices fails
        out, was_forced, steps, scores = jax.lax.with_sharding_constraint((out, was_forced, steps, scores), replicated)
    return slots, out, was_forced, steps, scores


def _score(graphdef, params, tokens, *, top: int):
    """A prompt's log-probabilities on the device: tokens (1, T) -> (logprob of token t+1 at each position t (T,),
    the `top` likeliest next tokens' logprobs (T, top) and ids (T, top)); the last position's logprob reads a
    wrapped-around token and means nothing. Only these leave the device: never the (T, V) log-probabilities."""
    model = nnx.merge(graphdef, params)
    logits = model(tokens)[0]  # (T, V)
    return token_logprobs(logits, jnp.roll(tokens[0], -1), top)


class Programs:
    """The jitted programs for one model structure (closing over its graphdef, which holds Python lists and so
    cannot be a static jit argument) and the mesh its parameters live on.

    start(params, tokens, lengths, copies=, rows=, capacity=) -> Slots
    prefill(params, slots, start, tokens, lengths, copies=) -> Slots            (slots donated)
    move(slots, src, dst) -> Slots                                             (slots donated)
    extract(slots, rows=, span=) -> Slots; flush(slots, part) -> Slots          (flush: slots donated)
    decode(params, slots, controls, limit, rows=, span=, chunk=, stop_tokens=, tool_end=, tiers=, top_logprobs=)
        -> (slots, tokens, forced, steps, scores)                              (slots donated)
    score(params, tokens, top=) -> (logprobs (T,), top values (T, top), top ids (T, top))
    """

    def __init__(self, graphdef, mesh=None, options: tuple = ()):
        self.graphdef, self.mesh, self.options = graphdef, mesh, options
        replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        jit = functools.partial(jax.jit, compiler_options=dict(options) or None)
        self.start = jit(functools.partial(_start, graphdef), static_argnames=("copies", "rows", "capacity"))
        self.prefill = jit(
            functools.partial(_prefill, graphdef), donate_argnames=("slots",), static_argnames=("copies",)
        )
        self.move = jax.jit(_move, donate_argnames=("slots",))
        self.extract = jax.jit(_extract, static_argnames=("rows", "span"))
        self.flush = jax.jit(_flush, donate_argnames=("slots",))
        self.decode = jit(
            functools.partial(_decode, graphdef, replicated=replicated),
            donate_argnames=("slots",),
            static_argnames=("rows", "span", "chunk", "stop_tokens", "tool_end", "tiers", "top_logprobs"),
        )
        self.score = jit(functools.partial(_score, graphdef), static_argnames=("top",))


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
# Compiling ahead


def abstract(tree):
    """The shapes and dtypes of a tree's arrays (JAX or NumPy) as jax.ShapeDtypeStruct: what `jitted.lower` needs to
    compile a program before its first call, without reading (or racing another thread for) any buffer. Without
    shardings: lowered for the default device, as a call with single-device arrays is, so that call finds the
    program in jit's cache (a ShapeDtypeStruct that names its sharding lowers, and compiles, apart)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=bool(getattr(x, "weak_type", False))), tree
    )


class Precompiler:
    """Runs compile jobs in order in a thread of its own; another thread (the scheduler's, which owns the device
    state) takes the keys of those done with `take()` and from then on calls their programs.

    A job is (key, a function that lowers programs from abstract shapes and compiles them: `jitted.lower(...)
    .compile()`). The executable stays with jit's cached lowering, so the owner's later `jitted(...)` call with
    arrays of those shapes runs it without compiling; nothing here touches a device buffer. A job that fails is
    logged and skipped (its key never comes back: the owner keeps using what it has). `progress`: a bar of the
    jobs done, on stderr."""

    def __init__(self, jobs: list[tuple[Hashable, Callable[[], object]]], progress: bool = False, desc: str = ""):
        self.jobs, self.progress, self.desc = list(jobs), progress, desc or "compiling"
        self._done: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flaxchat-precompiler", daemon=True)
        self.pending, self.seconds = len(self.jobs), None

    def start(self) -> "Precompiler":
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            with progress_bar(total=len(self.jobs), desc=self.desc, unit="program", disable=not self.progress) as bar:
                for key, compile_job in self.jobs:
                    if self._stop.is_set():
                        break
                    try:
                        compile_job()
                    except Exception:
                        log.exception("compiling %s in the background failed; serving without it", key)
                    else:
                        with self._lock:
                            self._done.append(key)
                    self.pending -= 1
                    bar.update()
        finally:
            self.seconds = time.perf_counter() - t0
            self._finished.set()

    def take(self) -> list:
        """Keys of the jobs finished since the last call (from any thread; the owner's)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every job has run; True if they have."""
        return self._finished.wait(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Run no further jobs; wait (at most `timeout` seconds) for the one compiling to end."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
