"""Inference: bucketed prefill, generation jitted end to end, the streaming Engine with tools, speculative sampling.

Everything here works on token ids; only `Engine` needs the tokenizer (for its special tokens and the tool).

- The KV cache is `flaxchat.gpt.KVCache`, explicit state of fixed capacity (model.config.sequence_len by
  default) with a position per row, so rows of one batch may hold prompts of different lengths.
- Prefill is one jitted call over the whole prompt, padded to a power-of-two bucket so a handful of prompt
  shapes ever compile.
- Decoding is one jitted `lax.while_loop`: sampling (temperature, top-k, top-p, greedy), forced tokens,
  per-row stop tokens and the step limit all live inside it. `generate` runs the whole answer in one call;
  the streaming `Engine` runs the same loop a few steps at a time and returns to Python only to stream
  tokens and to run the tool when a row closes a `<|python_start|>...<|python_end|>` block.
- `generate_speculative`: a small draft model proposes, the model verifies several tokens in one forward pass,
  and rejection sampling keeps the model's own distribution (Leviathan et al. 2023, Chen et al. 2023).

Randomness is explicit: step t of row b samples with fold_in(fold_in(key(seed), t), b), so the same seed gives
the same tokens however the loop is cut into calls, and a row's tokens do not depend on the other rows.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import numbers
import statistics
import time
import weakref
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat.common import from_main_process, is_main_process
from flaxchat.execution import execute_code, use_calculator
from flaxchat.gpt import KVCache, rms_norm, write_cache

MIN_BUCKET = 16  # smallest padded prompt length
STREAM_CHUNK = 16  # most decode steps per jitted call while streaming (a ~50 ms burst on a laptop CPU)
FORCED_CAPACITY = 128  # tokens a tool call may force into a row; longer outputs are cut to fit
MAX_STOP_TOKENS = 4  # stop ids are a fixed-size traced array, so changing them never recompiles


def bucket_length(n: int, capacity: int) -> int:
    """Padded length for an n-token prompt: the next power of two (at least MIN_BUCKET), at most capacity."""
    return min(max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length()), capacity)


# -----------------------------------------------------------------------------
# Sampling


def _check_sampling(temperature, top_k, top_p):
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be a positive integer or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")


def filter_logits(logits, temperature, top_k=None, top_p=None):
    """Logits (B, V) scaled by 1/temperature, cut to the top_k and to the top_p nucleus.

    Returns (values, ids): values (B, K) with -inf outside the nucleus, ids (B, K) their token ids, or None
    when no top-k/top-p cut was made (values are then the whole vocabulary in order).
    """
    V = logits.shape[-1]
    ids = None
    if top_k is not None and top_k < V:
        logits, ids = jax.lax.top_k(logits, top_k)  # sorted, largest first (as nanochat: top-k, then temperature)
    logits = logits / temperature
    if top_p is not None and top_p < 1.0:
        if ids is None:
            logits, ids = jax.lax.top_k(logits, V)  # a full sort: only paid when top_p is used without top_k
        probs = jax.nn.softmax(logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        logits = jnp.where(mass_before < top_p, logits, -jnp.inf)  # the most likely token always stays
    return logits, ids


def argmax(x):
    """argmax over the last axis (first index among ties), as int32.

    A max and a min: on CPU this is ~10x faster than jnp.argmax's variadic reduce, which costs a tenth of a
    small model's decode step over a 32k vocabulary.
    """
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), iota, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1)  # NaN rows: some index rather than out of range


def inverse_cdf(weights, u):
    """Index drawn with probability proportional to weights (..., K) >= 0, given uniforms u (...) in [0, 1).

    One uniform per draw and a cumulative sum (as torch.multinomial does) instead of K Gumbel variates,
    which cost more than the rest of a small model's decode step on a CPU.
    """
    cdf = jnp.cumsum(weights, axis=-1)
    target = u[..., None] * cdf[..., -1:]
    index = jnp.sum(cdf <= target, axis=-1)  # first i with cdf[i] > target: zero-weight entries are never picked
    iota = jax.lax.broadcasted_iota(jnp.int32, weights.shape, weights.ndim - 1)
    last = jnp.max(jnp.where(weights > 0, iota, 0), axis=-1)  # if u * total rounds up to total
    return jnp.minimum(index, last).astype(jnp.int32)


def _sample(logits, key, temperature, greedy, top_k, top_p):
    """(B, V) -> (B,) int32. Row b draws with fold_in(key, b), independent of the batch size."""
    if greedy:
        return argmax(logits)
    values, ids = filter_logits(logits, temperature, top_k, top_p)
    u = jax.vmap(lambda b: jax.random.uniform(jax.random.fold_in(key, b)))(jnp.arange(logits.shape[0]))
    choice = inverse_cdf(jnp.exp(values - jnp.max(values, axis=-1, keepdims=True)), u)
    if ids is not None:
        choice = jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]
    return choice.astype(jnp.int32)


def sample_next_token(logits, key, temperature=1.0, top_k=None, top_p=None):
    """One token per row of logits (B, V): argmax at temperature 0, else a draw from the filtered softmax."""
    _check_sampling(temperature, top_k, top_p)
    return _sample(logits, key, temperature, temperature == 0, top_k, top_p)


# -----------------------------------------------------------------------------
# Cache helpers (functions over KVCache)


def repeat_rows(cache: KVCache, n: int) -> KVCache:
    """A batch-1 cache copied into n rows (one prefill shared by n samples)."""
    return KVCache(
        k=tuple(jnp.repeat(k, n, axis=0) for k in cache.k),
        v=tuple(jnp.repeat(v, n, axis=0) for v in cache.v),
        pos=jnp.repeat(cache.pos, n, axis=0),
        prev_embedding=jnp.repeat(cache.prev_embedding, n, axis=0),
    )


def take_rows(cache: KVCache, rows: int, span: int) -> KVCache:
    """The first `rows` slots and the first `span` positions of the cache (what a decode chunk touches)."""
    take = lambda layers: tuple(c[:rows, :, :span] for c in layers)
    return KVCache(k=take(cache.k), v=take(cache.v), pos=cache.pos[:rows], prev_embedding=cache.prev_embedding[:rows])


def put_rows(cache: KVCache, part: KVCache, start, width: int) -> KVCache:
    """Write a decode chunk's work back: for each row, only the `width` positions from `start` (B,) on, which
    hold everything the chunk wrote (copying the whole working part back would cost as much as the chunk's
    attention). The window is clamped inside the part; positions it covers that the chunk did not write hold
    the values taken from the cache, so writing them back changes nothing."""
    rows, span = part.pos.shape[0], part.k[0].shape[2]
    width = min(width, span)
    start = jnp.clip(start, 0, span - width)
    cols = start[:, None] + jnp.arange(width)[None, :]  # (rows, width)

    def put_layers(layers, new):  # each layer: gather (rows, width, Hkv, D) from the part, scatter it in place
        return tuple(write_cache(c, n[jnp.arange(rows)[:, None], :, cols], start) for c, n in zip(layers, new))

    return KVCache(k=put_layers(cache.k, part.k), v=put_layers(cache.v, part.v), pos=cache.pos.at[:rows].set(part.pos),
                   prev_embedding=cache.prev_embedding.at[:rows].set(part.prev_embedding))


def attention_span(positions_needed: int, capacity: int) -> int:
    """Cache positions a decode chunk attends over: a power of two (at least capacity/16, at least 64) holding
    `positions_needed`, at most the capacity. Few distinct spans keep the number of compiled programs small."""
    floor = max(64, capacity // 16)
    return min(max(floor, 1 << max(positions_needed - 1, 0).bit_length()), capacity)


def in_compute_dtype(params, dtype):
    """Floating parameters cast to the compute dtype: decoding then reads half the bytes per step in bf16, and the
    numbers do not change (every forward casts each weight to that dtype before using it)."""
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x
    return jax.tree.map(cast, params)


def cast_for_compute(model) -> None:
    """in_compute_dtype on a (traced) model's parameters, in place."""
    nnx.update(model, in_compute_dtype(nnx.state(model, nnx.Param), model.dtype))


def rewind(model, cache: KVCache, pos, last_token) -> KVCache:
    """Move each row back to position `pos` (B,) whose last cached token is `last_token` (B,).

    Entries past pos stay in memory but are invisible (a query never sees keys after its own position) and
    are overwritten as decoding resumes. The smear state is recomputed the way forward_cached computes it:
    the normalised embedding of the last token.
    """
    prev = rms_norm(model.transformer.wte(last_token, model.dtype))
    return dataclasses.replace(cache, pos=pos.astype(jnp.int32), prev_embedding=prev.astype(cache.prev_embedding.dtype))


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
# The decode loop


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything the jitted decode loop carries from one step (and one call) to the next."""

    cache: KVCache
    logits: jax.Array  # (B, V) fp32: the distribution of each row's next token
    key: jax.Array  # PRNG key of the whole generation
    step: jax.Array  # () int32: columns generated so far
    tokens: jax.Array  # (B, N) int32: generated columns
    sampled: jax.Array  # (B, N) bool: True where sampled, False where forced (nanochat's mask 1 / 0)
    done: jax.Array  # (B,) bool: row emitted a stop token
    forced: jax.Array  # (B, F) int32: per-row queue of tokens to force (a tool's output)
    forced_len: jax.Array  # (B,) int32: queue length
    forced_pos: jax.Array  # (B,) int32: next queue entry to emit
    paused: jax.Array  # () bool: a row emitted the tool's end token; Python must run the tool


def _prefill(graphdef, params, tokens, lengths, key, *, num_rows, capacity):
    """Prefill padded prompts (Bp, T) and return the decode state for num_rows rows (Bp = 1 is shared)."""
    model = nnx.merge(graphdef, params)
    cast_for_compute(model)
    Bp = tokens.shape[0]
    cache = model.init_cache(Bp, capacity)
    logits, cache = model.forward_cached(tokens, cache, logits_at=lengths - 1)  # (Bp, V): each row's last real token
    cache = dataclasses.replace(cache, pos=lengths.astype(jnp.int32))
    if num_rows != Bp:
        cache, logits = repeat_rows(cache, num_rows), jnp.repeat(logits, num_rows, axis=0)
    zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
    return DecodeState(
        cache=cache, logits=logits, key=key, step=jnp.zeros((), jnp.int32),
        tokens=zeros(num_rows, capacity), sampled=jnp.zeros((num_rows, capacity), bool),
        done=jnp.zeros((num_rows,), bool), forced=zeros(num_rows, FORCED_CAPACITY),
        forced_len=zeros(num_rows), forced_pos=zeros(num_rows), paused=jnp.zeros((), bool),
    )


def _replicated(state, replicated):
    """Pin what the host reads (tokens, masks, step, done) to every device of the mesh: fetching an array split
    over another process's devices fails, and XLA's own layout choice is not a promise."""
    if replicated is None:
        return state
    pin = lambda x: jax.lax.with_sharding_constraint(x, replicated)
    return dataclasses.replace(state, tokens=pin(state.tokens), sampled=pin(state.sampled), step=pin(state.step),
                               done=pin(state.done))


def _decode(graphdef, params, state, limit, temperature, stops, tool_end, *, greedy, top_k, top_p, span, width,
            replicated=None):
    """Run decode steps until `limit` columns exist, every row has stopped, or a row closed a tool call.

    stops: (MAX_STOP_TOKENS,) int32 ids padded with -1; tool_end: the id that pauses the loop, or -1. Both are
    traced, as are limit and temperature, so only the sampling rule (greedy, top_k, top_p) and the cache
    window select a program. Attention reads only the first `span` cache positions (which must hold every
    position this call writes); the at most `width` positions written per row are copied back at the end.
    """
    model = nnx.merge(graphdef, params)
    cast_for_compute(model)
    full = state.cache
    state = dataclasses.replace(state, cache=take_rows(full, full.pos.shape[0], span))
    rows = jnp.arange(state.done.shape[0])
    last_slot = state.forced.shape[1] - 1

    def cond(s):
        return (s.step < limit) & ~jnp.all(s.done) & ~s.paused

    def body(s):
        sampled = _sample(s.logits, jax.random.fold_in(s.key, s.step), temperature, greedy, top_k, top_p)
        is_forced = s.forced_pos < s.forced_len
        token = jnp.where(is_forced, s.forced[rows, jnp.minimum(s.forced_pos, last_slot)], sampled)
        paused = jnp.any((token == tool_end) & ~s.done)
        logits, cache = model.forward_cached(token[:, None], s.cache)
        return DecodeState(
            cache=cache, logits=logits[:, 0], key=s.key, step=s.step + 1,
            tokens=s.tokens.at[:, s.step].set(token), sampled=s.sampled.at[:, s.step].set(~is_forced),
            done=s.done | jnp.isin(token, stops), forced=s.forced, forced_len=s.forced_len,
            forced_pos=s.forced_pos + is_forced, paused=paused,
        )

    state = jax.lax.while_loop(cond, body, dataclasses.replace(state, paused=jnp.zeros((), bool)))
    return _replicated(dataclasses.replace(state, cache=put_rows(full, state.cache, full.pos, width)), replicated)


@functools.partial(jax.jit, donate_argnames=("state",))
def _push_forced(state, rows, queue, lengths):
    """Give the rows where `rows` (B,) is True a new forced-token queue (B, F) of `lengths` (B,) tokens."""
    return dataclasses.replace(
        state,
        forced=jnp.where(rows[:, None], queue, state.forced),
        forced_len=jnp.where(rows, lengths, state.forced_len),
        forced_pos=jnp.where(rows, 0, state.forced_pos),
    )


class _Programs:
    """The jitted prefill and decode programs for one model structure (closing over its graphdef, which
    holds Python lists and so cannot be a static jit argument) and the mesh its parameters live on."""

    def __init__(self, graphdef, mesh=None):
        self.graphdef, self.mesh = graphdef, mesh
        replicated = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.prefill = jax.jit(functools.partial(_prefill, graphdef), static_argnames=("num_rows", "capacity"))
        self.decode = jax.jit(functools.partial(_decode, graphdef, replicated=replicated), donate_argnames=("state",),
                              static_argnames=("greedy", "top_k", "top_p", "span", "width"))


_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _programs(model) -> tuple[_Programs, nnx.State]:
    """(compiled programs, current parameters) for a model; programs are reused while its structure holds,
    and parameters are read afresh on every call so in-place updates (RL) are always seen."""
    graphdef, params = nnx.split(model)
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    mesh = sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1 else None
    programs = _PROGRAMS.get(model)
    if programs is None or programs.graphdef != graphdef or programs.mesh != mesh:
        programs = _PROGRAMS[model] = _Programs(graphdef, mesh)
    return programs, params


def _sampling_kwargs(temperature, top_k, top_p):
    _check_sampling(temperature, top_k, top_p)
    return dict(greedy=temperature == 0, top_k=top_k, top_p=None if top_p == 1.0 else top_p)


def _decode_args(limit, temperature, stop_tokens=(), tool_end=None):
    """The traced arguments of the decode program after its state."""
    stop_tokens = tuple(stop_tokens)
    if len(stop_tokens) > MAX_STOP_TOKENS:
        raise ValueError(f"at most {MAX_STOP_TOKENS} stop tokens, got {len(stop_tokens)}")
    stops = np.full(MAX_STOP_TOKENS, -1, np.int32)
    stops[: len(stop_tokens)] = stop_tokens
    return np.int32(limit), np.float32(temperature), stops, np.int32(-1 if tool_end is None else tool_end)


def generate(model, prompts, max_tokens, *, temperature=1.0, top_k=None, top_p=None, seed=0, stop_tokens=(),
             capacity=None) -> list[list[int]]:
    """Continue each prompt (a list of ids; lengths may differ) by up to max_tokens tokens, in one jitted loop.

    A row ends after its first stop token, which is included. Returns the new tokens of each row.
    """
    capacity = capacity or model.config.sequence_len
    tokens, lengths = pad_prompts(prompts, capacity, max_tokens)
    programs, params = _programs(model)
    state = programs.prefill(params, tokens, lengths, jax.random.key(seed), num_rows=len(prompts), capacity=capacity)
    span = attention_span(int(lengths.max()) + max_tokens, capacity)
    state = programs.decode(params, state, *_decode_args(max_tokens, temperature, stop_tokens),
                            **_sampling_kwargs(temperature, top_k, top_p), span=span, width=span)
    columns, step = jax.device_get((state.tokens, state.step))
    return [_until_stop(row[:step].tolist(), stop_tokens) for row in columns]


def _until_stop(tokens: list[int], stop_tokens) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop_tokens:
            return tokens[: i + 1]
    return tokens


# -----------------------------------------------------------------------------
# The Engine: streaming, num_samples rows from one prefill, the tool state machine


class RowState:
    """Where one row stands in the tool state machine (nanochat's RowState)."""

    def __init__(self, current_tokens=None):
        self.current_tokens = current_tokens or []  # prompt + everything generated
        self.forced_tokens = deque()  # tokens waiting to be forced (mirrors the device queue)
        self.in_python_block = False
        self.python_expr_tokens = []
        self.completed = False


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


class Engine:
    """nanochat's Engine on a jitted loop: `generate` streams (token column, mask column) per step."""

    def __init__(self, model, tokenizer, *, capacity=None, use_sandbox=False, stream_chunk=STREAM_CHUNK):
        self.model = model
        self.tokenizer = tokenizer
        self.capacity = capacity or model.config.sequence_len
        self.use_sandbox = use_sandbox  # False (default): calculator only, as nanochat; True: also run other code
        self.stream_chunk = stream_chunk
        special = tokenizer.encode_special
        self.python_start, self.python_end = special("<|python_start|>"), special("<|python_end|>")
        self.output_start, self.output_end = special("<|output_start|>"), special("<|output_end|>")
        self.stop_tokens = (special("<|assistant_end|>"), tokenizer.get_bos_token_id())

    def run_tool(self, expr: str) -> str | None:
        """The calculator (arithmetic, str.count), as nanochat; with use_sandbox=True anything else runs in the
        sandbox (flaxchat.execution, 5 s limit): opt-in, so training, evaluation and chat score the same tool.

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

        One prefill of `tokens` is shared by num_samples rows. Stops when every row has emitted
        <|assistant_end|> or <|bos|>, after max_tokens columns, or when the KV cache is full.
        """
        if isinstance(tokens, (str, bytes)) or not all(isinstance(t, numbers.Integral) for t in tokens):
            raise ValueError("tokens must be a list of token ids (ints)")
        tokens = [int(t) for t in tokens]
        room = self.capacity - len(tokens)
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        padded, lengths = pad_prompts([tokens], self.capacity, max(max_tokens, 1))
        programs, params = _programs(self.model)
        state = programs.prefill(params, padded, lengths, jax.random.key(seed), num_rows=num_samples,
                                 capacity=self.capacity)
        sampling = _sampling_kwargs(temperature, top_k, top_p)
        rows = [RowState(list(tokens)) for _ in range(num_samples)]
        emitted, chunk = 0, 1  # the first call makes one token: time to first token is one prefill + one step
        while emitted < max_tokens and not all(r.completed for r in rows):
            limit = min(emitted + chunk, max_tokens)
            args = _decode_args(limit, temperature, self.stop_tokens, self.python_end)
            span = attention_span(len(tokens) + limit, self.capacity)  # every position this call can write
            state = programs.decode(params, state, *args, **sampling, span=span, width=self.stream_chunk)
            columns, masks, step = jax.device_get((state.tokens, state.sampled, state.step))
            queues = {}
            for t in range(emitted, int(step)):
                column = columns[:, t].tolist()
                queues.update(self._advance(rows, column))
                yield column, masks[:, t].astype(int).tolist()
            emitted, chunk = int(step), min(2 * chunk, self.stream_chunk)
            if queues:  # the loop paused right after the python_end, so these are forced from the next step on
                state = self._force(state, queues)

    def _advance(self, rows, column) -> dict[int, list[int]]:
        """nanochat's per-row state machine for one column; returns {row: tokens to force} for closed tool calls."""
        queues = {}
        for i, (state, token) in enumerate(zip(rows, column)):
            if state.forced_tokens:
                state.forced_tokens.popleft()  # the device forced this very token
            state.current_tokens.append(token)
            if state.completed:
                continue  # nothing a finished row does is used, so its tool calls are not run
            if token in self.stop_tokens:
                state.completed = True
            elif token == self.python_start:
                state.in_python_block, state.python_expr_tokens = True, []
            elif token == self.python_end and state.in_python_block:
                state.in_python_block = False
                if state.python_expr_tokens:
                    result = self.run_tool(self.tokenizer.decode(state.python_expr_tokens))
                    if result is not None:
                        body = self.tokenizer.encode(result)[: FORCED_CAPACITY - 2]
                        state.forced_tokens.extend([self.output_start, *body, self.output_end])
                        queues[i] = list(state.forced_tokens)
                state.python_expr_tokens = []
            elif state.in_python_block:
                state.python_expr_tokens.append(token)
        return queues

    def _force(self, state, queues: dict[int, list[int]]):
        """Give rows their tool output to force (a row's device queue is always empty when a new one comes)."""
        B = state.done.shape[0]
        queue, lengths, rows = np.zeros((B, FORCED_CAPACITY), np.int32), np.zeros(B, np.int32), np.zeros(B, bool)
        for i, tokens in queues.items():
            queue[i, : len(tokens)], lengths[i], rows[i] = tokens, len(tokens), True
        return _push_forced(state, rows, queue, lengths)

    def generate_batch(self, tokens, num_samples=1, **kwargs):
        """Non-streaming: (sequences, masks), each sequence = prompt + generated tokens without the terminal
        token (nanochat's return value); decode with tokenizer.decode(seq[len(tokens):]) for the text."""
        results = [list(tokens) for _ in range(num_samples)]
        masks = [[0] * len(tokens) for _ in range(num_samples)]
        completed = [False] * num_samples
        for column, mask_column in self.generate(tokens, num_samples, **kwargs):
            for i, (token, mask) in enumerate(zip(column, mask_column)):
                if completed[i]:
                    continue
                if token in self.stop_tokens:
                    completed[i] = True
                else:
                    results[i].append(token)
                    masks[i].append(mask)
            if all(completed):
                break
        return results, masks


# -----------------------------------------------------------------------------
# Speculative sampling


def _probs(logits, temperature, greedy, top_k, top_p):
    """Full-vocabulary probabilities (..., V) of the sampling rule: one-hot argmax when greedy."""
    if greedy:
        return jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
    flat = logits.reshape(-1, logits.shape[-1])
    values, ids = filter_logits(flat, temperature, top_k, top_p)
    p = jax.nn.softmax(values, axis=-1)
    if ids is not None:
        p = jnp.zeros_like(flat).at[jnp.arange(flat.shape[0])[:, None], ids].set(p)
    return p.reshape(logits.shape)


def _draw(key, p):
    return inverse_cdf(p, jax.random.uniform(key))


def speculative_program(model, draft_model, *, max_tokens, draft_steps=4, temperature=1.0, top_k=None, top_p=None,
                        stop_tokens=(), capacity=None):
    """(run, target_params, draft_params) where run(target_params, draft_params, prompt (T,), length, key)
    -> (tokens (N,), count, rounds, accepted) samples one continuation of prompt[:length]. Pure, so it can
    be jitted (generate_speculative) or vmapped over keys (the distribution test).

    Both caches always hold the committed sequence minus its last token `last`. A round: the draft feeds
    `last` and then samples x1..xk one at a time (k+1 forwards, so xk lands in its cache too); the model
    scores [last, x1..xk] in one forward; xi is kept with probability min(1, p(xi)/q(xi)) up to the first
    rejection, which is replaced by a draw from max(0, p - q) (normalised); if all k survive, a bonus token
    comes from the model's last distribution. Each committed token is then distributed exactly as the model
    alone would sample it; greedy (one-hot p and q) keeps the model's greedy tokens.
    """
    _check_sampling(temperature, top_k, top_p)
    if draft_steps < 1:
        raise ValueError(f"draft_steps must be >= 1, got {draft_steps}")
    k, greedy = draft_steps, temperature == 0
    capacity = capacity or min(model.config.sequence_len, draft_model.config.sequence_len)
    stops = jnp.asarray(tuple(stop_tokens), jnp.int32)
    probs = functools.partial(_probs, temperature=temperature, greedy=greedy, top_k=top_k, top_p=top_p)
    t_graph, t_params = nnx.split(model)
    d_graph, d_params = nnx.split(draft_model)

    def prefill(m, prompt, length):
        logits, cache = m.forward_cached(prompt[None], m.init_cache(1, capacity), logits_at=jnp.reshape(length - 1, (1,)))
        return logits[0], dataclasses.replace(cache, pos=jnp.reshape(length, (1,)).astype(jnp.int32))

    def run(tp, dp, prompt, length, key):
        target, draft = nnx.merge(t_graph, tp), nnx.merge(d_graph, dp)
        logits, tcache = prefill(target, prompt, length)
        _, dcache = prefill(draft, prompt, length)
        key, sub = jax.random.split(key)
        first = _draw(sub, probs(logits))  # the first token needs no draft: the prefill already scored it
        out = jnp.zeros((max_tokens + k + 1,), jnp.int32).at[0].set(first)
        init = (tcache, dcache, first, out, jnp.int32(1), key, jnp.int32(0), jnp.int32(0), jnp.isin(first, stops))

        def cond(s):
            tcache, _, _, _, n, _, _, _, stopped = s
            return (n < max_tokens) & ~stopped & (tcache.pos[0] + k + 1 <= capacity)

        def body(s):
            tcache, dcache, last, out, n, key, rounds, accepted, _ = s
            key, k_draft, k_accept, k_fix = jax.random.split(key, 4)

            def draft_step(carry, j):
                cache, token = carry
                logits, cache = draft.forward_cached(token[None, None], cache)
                q = probs(logits[0, 0])
                x = _draw(jax.random.fold_in(k_draft, j), q)
                return (cache, x), (x, q)

            (dcache_new, _), (xs, qs) = jax.lax.scan(draft_step, (dcache, last), jnp.arange(k + 1))
            xs, qs = xs[:k], qs[:k]  # the (k+1)-th forward only put xk in the draft cache
            fed = jnp.concatenate([last[None], xs])  # (k+1,)
            logits, tcache_new = target.forward_cached(fed[None], tcache)
            ps = probs(logits[0])  # (k+1, V): ps[i] is the model's distribution after fed[i]
            px, qx = ps[jnp.arange(k), xs], qs[jnp.arange(k), xs]
            keep = jax.random.uniform(k_accept, (k,)) * qx < px  # u < p/q without dividing by q
            n_ok = jnp.sum(jnp.cumprod(keep)).astype(jnp.int32)
            q_next = jnp.concatenate([qs, jnp.zeros_like(qs[:1])])[n_ok]  # zero after k: the bonus draw is plain p
            residual = jnp.maximum(ps[n_ok] - q_next, 0.0)
            residual = jnp.where(jnp.sum(residual) > 0, residual, ps[n_ok])  # p == q: rejection had probability 0
            y = _draw(k_fix, residual / jnp.sum(residual))
            new = jnp.where(jnp.arange(k + 1) < n_ok, jnp.concatenate([xs, xs[:1]]), y)  # x1..x_n_ok, y, (y...)
            out = jax.lax.dynamic_update_slice(out, new, (n,))
            # keep [.., last, x1..x_n_ok] in both caches; y becomes the new `last`
            tcache_new = rewind(target, tcache_new, tcache.pos + 1 + n_ok, fed[n_ok][None])
            dcache_new = rewind(draft, dcache_new, dcache.pos + 1 + n_ok, fed[n_ok][None])
            stopped = jnp.any(jnp.isin(new, stops) & (jnp.arange(k + 1) <= n_ok))
            return (tcache_new, dcache_new, y, out, n + n_ok + 1, key, rounds + 1, accepted + n_ok, stopped)

        tcache, dcache, last, out, n, key, rounds, accepted, stopped = jax.lax.while_loop(cond, body, init)
        return out, n, rounds, accepted

    return run, t_params, d_params


def generate_speculative(model, draft_model, prompt_tokens, max_tokens, draft_steps=4, temperature=1.0, top_k=None,
                         top_p=None, seed=0, stop_tokens=(), capacity=None, return_stats=False):
    """Continue prompt_tokens by up to max_tokens tokens with draft_model proposing draft_steps at a time.

    The tokens follow the model's own sampling distribution exactly (its greedy output at temperature 0).
    Ends after the first stop token (included), or early if the KV cache fills. With return_stats, also
    returns {"rounds", "accepted", "acceptance_rate"} (accepted draft tokens / proposed).
    """
    capacity = capacity or min(model.config.sequence_len, draft_model.config.sequence_len)
    tokens, lengths = pad_prompts([prompt_tokens], capacity, max_tokens)
    run, tp, dp = speculative_program(model, draft_model, max_tokens=max_tokens, draft_steps=draft_steps,
                                      temperature=temperature, top_k=top_k, top_p=top_p,
                                      stop_tokens=stop_tokens, capacity=capacity)
    out, n, rounds, accepted = jax.device_get(jax.jit(run)(tp, dp, tokens[0], lengths[0], jax.random.key(seed)))
    result = _until_stop(out[: min(int(n), max_tokens)].tolist(), tuple(stop_tokens))
    if not return_stats:
        return result
    rate = int(accepted) / max(int(rounds) * draft_steps, 1)
    return result, {"rounds": int(rounds), "accepted": int(accepted), "acceptance_rate": rate}


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
    programs, params = _programs(model)
    kwargs = _sampling_kwargs(temperature, top_k, None)
    span = attention_span(prompt_len + max_new_tokens, capacity)

    def prefill():
        return programs.prefill(params, tokens, lengths, jax.random.key(seed), num_rows=batch_size, capacity=capacity)

    def one_run():
        t0 = time.perf_counter()
        state = jax.block_until_ready(prefill())
        t1 = time.perf_counter()
        state = programs.decode(params, state, *_decode_args(max_new_tokens, temperature), **kwargs, span=span, width=span)
        state = jax.block_until_ready(state)
        t2 = time.perf_counter()
        first = prefill()
        first = programs.decode(params, first, *_decode_args(1, temperature), **kwargs, span=span, width=span)
        np.asarray(first.tokens[:, 0])  # the first tokens, on the host
        t3 = time.perf_counter()
        assert int(state.step) == max_new_tokens
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
