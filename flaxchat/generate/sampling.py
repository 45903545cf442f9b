"""The sampler: one token per row, each row with its own temperature, top-k, top-p and key.

Greedy rows take the argmax; sampled rows divide their logits by the temperature, cut them to the row's top_k
(through a few static top-k sizes, `TOP_K_TIERS`, so one compiled program serves every setting) and then to its
top_p nucleus, and draw by inverse CDF from one uniform. The decode programs (flaxchat.generate.programs) sample
through `sample_rows`; speculative sampling, whose acceptance test needs the whole distribution, through
`traced_rule_probs` (the rule as traced values, so one compiled program serves every setting) and `inverse_cdf`.

`token_logprobs` is what the OpenAI routes' `logprobs` report: the raw model distribution's log-probability of each
chosen token and its k likeliest alternatives, computed on the device, so a (tokens, vocabulary) array never
reaches the host (at a 65,536-token vocabulary a 2,048-token prompt's full log-probabilities are half a gigabyte).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_TOP_K = 200  # largest per-row top_k the server's sampler takes (0 = no top-k cut)
TOP_K_TIERS = (50, MAX_TOP_K)  # the server's static top-k sizes; a chunk uses the smallest covering its rows
# traced_rule_probs' top-k sizes: its callers take any top_k (no MAX_TOP_K cut), so one more tier keeps a few hundred
# cheap; a top_k past the last one pays for a full sort of the vocabulary
RULE_TOP_K_TIERS = (*TOP_K_TIERS, 1024)
MAX_TOP_LOGPROBS = 20  # most alternatives per token `logprobs` reports (OpenAI's chat limit); one static size


def check_sampling(temperature, top_k, top_p) -> None:
    """Refuse sampling settings the sampler cannot honour, with a sentence naming the setting."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be a positive integer or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")


def argmax(x):
    """argmax over the last axis (first index among ties), as int32.

    A max and a min: on a CPU jnp.argmax's variadic reduce over a large vocabulary costs a noticeable part of a
    small model's decode step, and these two plain reductions are much cheaper.
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
    on a CPU is far slower; a program partitioned over several devices cannot have them
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


def top_values(x, k: int, block: int = 32, barrier: bool = True):
    """The k largest entries of each row of x (B, V) and their indices -> (values (B, k), ids (B, k) int32), largest
    first. As in _kth_largest, top_k runs on the k blocks of `block` entries with the largest maxima (which hold the
    k largest values), not on all V: a CPU's top_k over a whole vocabulary is far slower."""
    fence = jax.lax.optimization_barrier if barrier else (lambda x: x)
    B, V = x.shape
    k = min(k, V)
    if k == 0:
        return jnp.zeros((B, 0), x.dtype), jnp.zeros((B, 0), jnp.int32)
    x = jnp.pad(x, ((0, 0), (0, (-V) % block)), constant_values=-jnp.inf)
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
    n = x.shape[1] // block
    if k < n:
        xb, ib = x.reshape(B, n, block), ids.reshape(B, n, block)
        _, best = fence(jax.lax.top_k(jnp.max(xb, axis=-1), k))  # (B, k) block ids
        x = jnp.take_along_axis(xb, best[:, :, None], axis=1).reshape(B, k * block)
        ids = jnp.take_along_axis(ib, best[:, :, None], axis=1).reshape(B, k * block)
    if k < x.shape[1]:
        values, at = fence(jax.lax.top_k(x, k))
    else:  # (a top_k of a whole axis is rewritten into a sort, and fails behind a barrier)
        at = jnp.argsort(-x, axis=-1, stable=True)[:, :k]
        values = jnp.take_along_axis(x, at, axis=-1)
    return values, jnp.take_along_axis(ids, at, axis=-1)


def token_logprobs(logits, tokens, k: int, barrier: bool = True):
    """Raw log-probabilities (log_softmax of logits (B, V), before any temperature or cut, as vLLM and OpenAI report
    them) -> (logprob of tokens (B,), the k largest (B, k), their ids (B, k)). The chosen token's value and an
    alternative's are the same float when they are the same token, so `logprob == max(top)` tests greediness."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)  # (B,)
    chosen = jnp.take_along_axis(logits, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0] - lse
    values, ids = top_values(logits, k, barrier=barrier)
    return chosen, values - lse[:, None], ids


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
        pthr = jax.lax.cond(
            jnp.any(nucleus),
            lambda: jnp.where(nucleus, _nucleus_threshold(scaled, top_p), -jnp.inf),
            lambda: jnp.full((B,), -jnp.inf),
        )
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
    return (
        rows(temperature, jnp.float32),
        rows(top_k or 0, jnp.int32),
        None if top_p in (None, 1.0) else rows(top_p, jnp.float32),
    ), ((top_k,) if top_k else ())


def sample_next_token(logits, key, temperature=1.0, top_k=None, top_p=None):
    """One token per row of logits (B, V) under one rule; row b draws with fold_in(key, b)."""
    check_sampling(temperature, top_k, top_p)
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


def traced_rule_probs(logits, temperature, top_k, top_p, tiers=RULE_TOP_K_TIERS):
    """rule_probs with the rule as traced scalars: temperature (<= 0 = greedy), top_k (0 = all), top_p (1 = all).

    Speculative sampling's programs take the rule as an argument rather than compiling it in, so a new setting
    costs no compile (issue finding 7). Greedy is the one-hot argmax under a lax.cond, so a greedy round pays for
    no cut; top_k runs through the static `tiers` plus the whole vocabulary (a full sort, only when a top_k above
    the largest tier asks), so every top_k is honoured exactly; the nucleus runs only when top_p < 1.
    """
    shape, V = logits.shape, logits.shape[-1]
    flat = logits.reshape(-1, V)
    rows = lambda value, dtype: jnp.full((flat.shape[0],), value, dtype)
    t, k, p = rows(temperature, jnp.float32), rows(top_k, jnp.int32), rows(top_p, jnp.float32)
    greedy = lambda: jax.nn.one_hot(argmax(flat), V, dtype=jnp.float32)
    sampled = lambda: jax.nn.softmax(kept_logits(flat, t, k, p, tuple(tiers) + (V,)), axis=-1)
    return jax.lax.cond(jnp.asarray(temperature) <= 0, greedy, sampled).reshape(shape)
