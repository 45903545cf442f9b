"""Speculative sampling: a small draft model proposes, the model verifies several tokens in one forward pass.

Rejection sampling keeps the model's own distribution exactly (Leviathan et al. 2023, arXiv:2211.17192; Chen et
al. 2023, arXiv:2302.01318): the tokens are distributed as the model alone would sample them, and at temperature
0 they are its greedy tokens. It pays when the draft is much cheaper than the model and agrees with it often.

Built on the generation core: its sampling rule (flaxchat.generate.sampling: `traced_rule_probs`, `inverse_cdf`),
its cache helpers and prompt padding (flaxchat.generate.programs), its forced-queue size (flaxchat.generate.reply).
The state is explicit and the programs are jitted once per pair of model structures and shapes (the sampling rule
is a traced argument, so a new temperature, top_k or top_p compiles nothing). `SpeculativeRunner` plugs one row of
it into the slot driver (flaxchat.generate.batch), so the Engine and the server (`--draft-model` on chat_cli,
chat_web and bench) stream from it as from the batched runner, and a tool's output is forced into it between calls.

Both caches always hold the committed sequence minus its last token `last`. A round: the draft feeds `last`
and then samples x1..xk one at a time (k+1 forwards, so xk lands in its cache too); the model scores
[last, x1..xk] in one forward; xi is kept with probability min(1, p(xi)/q(xi)) up to the first rejection, which
is replaced by a draw from max(0, p - q) (normalised); if all k survive, a bonus token y comes from the model's
last distribution. A round commits x1..x_n, y, cut after a stop token or the tool's end token.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat.common import progress_bar
from flaxchat.generate.programs import (
    Emitted,
    bucket_length,
    cast_for_compute,
    compiler_options,
    decode_chunk,
    loop_weights,
    narrow_weights,
    pad_prompts,
    rewind,
)
from flaxchat.generate.reply import FORCED_CAPACITY, until_stop
from flaxchat.generate.sampling import check_sampling, inverse_cdf, traced_rule_probs
from flaxchat.model.gpt import KVCache, with_stacked_qkv


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Speculation:
    """One sequence's speculative state between calls."""

    target: KVCache  # batch 1: the committed sequence minus `last`
    draft: KVCache
    last: jax.Array  # () int32: the last committed token, not yet in the caches
    key: jax.Array
    rounds: jax.Array  # () int32: verification rounds so far
    accepted: jax.Array  # () int32: draft tokens the model kept


def _draw(key, p):
    return inverse_cdf(p, jax.random.uniform(key))


def _models(graphs, params):
    models = [nnx.merge(g, p) for g, p in zip(graphs, params)]
    for m in models:
        cast_for_compute(m)
    return models


def _start(graphs, params, prompt, length, key, *, capacity, rule):
    """Prefill both models with prompt[:length] (prompt (T,) padded) -> (Speculation, first token)."""
    target, draft = _models(graphs, params)

    def prefill(m):
        cache = m.init_cache(1, capacity)
        logits, cache = m.forward_cached(prompt[None], cache, logits_at=jnp.reshape(length - 1, (1,)), fresh=True)
        return logits[0], dataclasses.replace(cache, pos=jnp.reshape(length, (1,)).astype(jnp.int32))

    logits, tcache = prefill(target)
    _, dcache = prefill(draft)
    key, sub = jax.random.split(key)
    first = _draw(sub, traced_rule_probs(logits, *rule))  # the first token needs no draft: the prefill scored it
    zero = jnp.zeros((), jnp.int32)
    return Speculation(target=tcache, draft=dcache, last=first, key=key, rounds=zero, accepted=zero), first


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Rounds:
    """The verification loop's state, carried from round to round."""

    spec: Speculation
    out: jax.Array  # (chunk + k + 1,): the committed tokens
    n: jax.Array  # (): how many
    stopped: jax.Array  # () bool: a stop token or the tool's end was committed
    weights: Any  # narrow weights carried through the loop (programs.narrow_weights), or None


def _run(graphs, params, spec: Speculation, limit, *, k, rule, stops, tool_end, chunk):
    """Rounds until at least `limit` (<= chunk) tokens are committed, a committed token is a stop token or
    `tool_end`, or the cache is full -> (Speculation, tokens (chunk + k + 1,), count)."""
    target, draft = _models(graphs, params)
    probs = functools.partial(traced_rule_probs, temperature=rule[0], top_k=rule[1], top_p=rule[2])
    ends = jnp.asarray(tuple(stops) + (tool_end,), jnp.int32)
    capacity = spec.target.k[0].shape[2]

    def going(r: Rounds):
        return (r.n < limit) & ~r.stopped & (r.spec.target.pos[0] + k + 1 <= capacity)

    def round_(r: Rounds) -> Rounds:
        s, t, d, weights = r.spec, target, draft, r.weights
        if weights is not None:
            (t, wt), (d, wd) = (loop_weights(g, w) for g, w in zip(graphs, weights))
            weights = (wt, wd)
        key, k_draft, k_accept, k_fix = jax.random.split(s.key, 4)

        def draft_step(carry, j):
            cache, token = carry
            logits, cache = d.forward_cached(token[None, None], cache)
            q = probs(logits[0, 0])
            x = _draw(jax.random.fold_in(k_draft, j), q)
            return (cache, x), (x, q)

        (dcache, _), (xs, qs) = jax.lax.scan(draft_step, (s.draft, s.last), jnp.arange(k + 1))
        xs, qs = xs[:k], qs[:k]  # the (k+1)-th forward only put xk in the draft cache
        fed = jnp.concatenate([s.last[None], xs])  # (k+1,)
        logits, tcache = t.forward_cached(fed[None], s.target)
        ps = probs(logits[0])  # (k+1, V): ps[i] is the model's distribution after fed[i]
        px, qx = ps[jnp.arange(k), xs], qs[jnp.arange(k), xs]
        keep = jax.random.uniform(k_accept, (k,)) * qx < px  # u < p/q without dividing by q
        n_ok = jnp.sum(jnp.cumprod(keep)).astype(jnp.int32)
        q_next = jnp.concatenate([qs, jnp.zeros_like(qs[:1])])[n_ok]  # zero after k: the bonus draw is plain p
        residual = jnp.maximum(ps[n_ok] - q_next, 0.0)
        residual = jnp.where(jnp.sum(residual) > 0, residual, ps[n_ok])  # p == q: rejection had probability 0
        y = _draw(k_fix, residual / jnp.sum(residual))
        new = jnp.where(jnp.arange(k + 1) < n_ok, jnp.concatenate([xs, xs[:1]]), y)  # x1..x_n_ok, y
        # commit new[:cut + 1]: everything, or up to the first stop / tool end
        hit = jnp.isin(new, ends) & (jnp.arange(k + 1) <= n_ok)
        cut = jnp.where(jnp.any(hit), jnp.argmax(hit), n_ok).astype(jnp.int32)
        # both caches keep [.., last, new[:cut]]; new[cut] becomes `last` (fed[cut] is the last cached token)
        pos = s.target.pos + 1 + cut
        s = Speculation(
            target=rewind(t, tcache, pos, fed[cut][None]),
            draft=rewind(d, dcache, pos, fed[cut][None]),
            last=new[cut],
            key=key,
            rounds=s.rounds + 1,
            accepted=s.accepted + jnp.minimum(n_ok, cut),
        )
        out = jax.lax.dynamic_update_slice(r.out, new, (r.n,))
        return Rounds(spec=s, out=out, n=r.n + cut + 1, stopped=jnp.any(hit), weights=weights)

    weights = params if narrow_weights(params, target.dtype) else None  # int8/bf16 weights: see narrow_weights
    out = jnp.zeros((chunk + k + 1,), jnp.int32)
    end = jax.lax.while_loop(going, round_, Rounds(spec, out, jnp.int32(0), jnp.bool_(False), weights))
    return end.spec, end.out, end.n


def _force(graphs, params, spec: Speculation, queue, length):
    """Append forced tokens queue[:length] (a tool's output) after `last`; queue[length - 1] becomes `last`."""
    models = _models(graphs, params)
    fed = jnp.concatenate([spec.last[None], queue[:-1]])[None]  # [last, q0 .. q_{F-2}]; past length: ignored
    pos = spec.target.pos + length
    caches = []
    for m, cache in zip(models, (spec.target, spec.draft)):
        _, cache = m.forward_cached(fed, cache)  # writes past the capacity are dropped; past pos they are unseen
        caches.append(rewind(m, cache, pos, fed[:, length - 1]))
    return dataclasses.replace(spec, target=caches[0], draft=caches[1], last=queue[length - 1])


def traced_rule(rule) -> tuple:
    """A rule (temperature, top_k, top_p; None = off) as the programs' traced arguments: float32, int32 (0 = off),
    float32 (1 = off). Fixed dtypes, so every rule (Python or numpy numbers) has one signature and one compile."""
    temperature, top_k, top_p = rule
    return np.float32(temperature), np.int32(top_k or 0), np.float32(1.0 if top_p is None else top_p)


class SpeculativePrograms:
    """start / run / force jitted for one (model, draft) pair of structures; the sampling rule is traced, so one
    compile per shape (capacity; k, stops, tool_end, chunk) serves every temperature, top_k and top_p."""

    def __init__(self, graphs, options: tuple = ()):
        self.graphs, self.options = graphs, options
        jit = functools.partial(jax.jit, compiler_options=dict(options) or None)  # see programs.compiler_options
        self.jitted_start = jit(functools.partial(_start, graphs), static_argnames=("capacity",))
        self.jitted_run = jit(
            functools.partial(_run, graphs),
            donate_argnames=("spec",),
            static_argnames=("k", "stops", "tool_end", "chunk"),
        )
        self.force = jit(functools.partial(_force, graphs), donate_argnames=("spec",))

    def start(self, params, prompt, length, key, *, capacity, rule):
        """Prefill both models -> (Speculation, first token) under rule (temperature, top_k, top_p)."""
        return self.jitted_start(params, prompt, length, key, capacity=capacity, rule=traced_rule(rule))

    def run(self, params, spec: Speculation, limit, *, k, rule, stops, tool_end, chunk):
        """Rounds under rule until `limit` tokens, a stop or tool end, or a full cache (see _run)."""
        return self.jitted_run(
            params, spec, limit, k=k, rule=traced_rule(rule), stops=stops, tool_end=tool_end, chunk=chunk
        )

    def push(self, params, spec: Speculation, tokens) -> Speculation:
        """spec with `tokens` (a tool's output, host ints) forced in after its last token, through the one
        compiled `force` (the tokens padded to FORCED_CAPACITY)."""
        queue = np.zeros(FORCED_CAPACITY, np.int32)
        queue[: len(tokens)] = tokens
        return self.force(params, spec, queue, np.int32(len(tokens)))


_PROGRAMS: list[SpeculativePrograms] = []


def programs(model, draft_model) -> tuple[SpeculativePrograms, tuple]:
    """(programs, (target params, draft params)): compiled once per pair of structures, params read afresh."""
    (tg, tp), (dg, dp) = nnx.split(model), nnx.split(draft_model)
    if model.config.vocab_size != draft_model.config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft_model.config.vocab_size}) differs from the model's "
            f"({model.config.vocab_size}); it must use the same tokenizer"
        )
    options = compiler_options((tp, dp))
    for p in _PROGRAMS:
        if p.options == options and p.graphs[0] == tg and p.graphs[1] == dg:
            return p, (tp, dp)
    _PROGRAMS[:] = _PROGRAMS[-3:] + [SpeculativePrograms((tg, dg), options)]
    return _PROGRAMS[-1], (tp, dp)


class SpeculativeRunner:
    """One row of speculative sampling, as a runner for the slot driver (flaxchat.generate.batch): the Engine's one
    sample and the server's one conversation at a time (--draft-model) stream from it like from the batched runner.
    The row's sampling rule is set at its prefill; a tool's output goes into both caches and comes back as forced
    tokens. Generated tokens' logprobs are not computed (its rounds do not need them)."""

    slots, ahead = 1, None

    def __init__(self, model, draft_model, *, draft_steps: int, capacity: int, chunk: int, stop_tokens, tool_end):
        speculative_rule(1.0, None, None, draft_steps)  # checks draft_steps
        self.programs, self.params = programs(with_stacked_qkv(model), with_stacked_qkv(draft_model))
        self.draft_steps, self.capacity, self.chunk = draft_steps, capacity, chunk
        self.stop_tokens, self.tool_end = tuple(stop_tokens), tool_end
        self.reset()

    def reset(self) -> None:
        self.spec, self.rule, self.first = None, None, []

    def prefill(self, start: int, requests: list, copies: int = 1) -> None:
        (request,) = requests
        self.rule = speculative_rule(request.temperature, request.top_k or None, request.top_p, self.draft_steps)
        tokens, lengths = pad_prompts([request.prompt], self.capacity)
        key = jax.random.key(request.seed)
        self.spec, first = self.programs.start(
            self.params, tokens[0], lengths[0], key, capacity=self.capacity, rule=self.rule
        )
        self.first = [int(first)]  # the prefill's token: handed out by the next decode call

    def move(self, src, dst, positions) -> bool:
        return False  # one row: nothing to pack

    def decode(self, rows: list, pushes: dict[int, list[int]], limit: int):
        (request,) = rows
        tokens, forced = self.first, False
        if 0 in pushes:  # the tool's output goes into both caches; the reply gets it as forced tokens
            tokens, forced = pushes[0], True
            self.spec = self.programs.push(self.params, self.spec, tokens)
        elif not tokens:
            limit = min(limit, request.max_tokens - request.completion_tokens)
            self.spec, out, n = self.programs.run(self.params, self.spec, np.int32(limit), **self._static())
            tokens = np.asarray(out)[: int(n)].tolist()  # none: no room for another round in the cache
        self.first = []
        return Emitted(np.array([tokens], np.int32), np.full((1, len(tokens)), forced), len(tokens), None)

    def _static(self) -> dict:
        return dict(
            k=self.draft_steps, rule=self.rule, stops=self.stop_tokens, tool_end=self.tool_end, chunk=self.chunk
        )

    def warmup(self, progress: bool = False) -> float:
        """Compile the prefill of every prompt bucket and a round (under greedy settings); returns seconds."""
        t0, rule = time.perf_counter(), (0.0, None, None)
        buckets = sorted({bucket_length(1 << p, self.capacity) for p in range(self.capacity.bit_length())})
        with progress_bar(total=len(buckets) + 1, desc="compiling", unit="program", disable=not progress) as bar:
            for T in buckets:
                self.spec, _ = self.programs.start(
                    self.params,
                    np.zeros(T, np.int32),
                    np.int32(1),
                    jax.random.key(0),
                    capacity=self.capacity,
                    rule=rule,
                )
                bar.update()
            self.rule = traced_rule(rule)
            jax.block_until_ready(self.programs.run(self.params, self.spec, np.int32(1), **self._static()))
            bar.update()
        self.reset()
        return time.perf_counter() - t0


def speculative_rule(temperature, top_k, top_p, draft_steps) -> tuple:
    """Checked settings -> the sampling rule the programs take, as `traced_rule` spells it (top_k 0 and top_p 1 are
    off)."""
    check_sampling(temperature, top_k, top_p)
    if draft_steps < 1:
        raise ValueError(f"draft_steps must be >= 1, got {draft_steps}")
    return traced_rule((temperature, top_k, top_p))


def generate_speculative(
    model,
    draft_model,
    prompt_tokens,
    max_tokens,
    draft_steps=4,
    temperature=1.0,
    top_k=None,
    top_p=None,
    seed=0,
    stop_tokens=(),
    capacity=None,
    return_stats=False,
):
    """Continue prompt_tokens by up to max_tokens tokens with draft_model proposing draft_steps at a time.

    The tokens follow the model's own sampling distribution exactly (its greedy output at temperature 0).
    Ends after the first stop token (included), or early if the KV cache fills. With return_stats, also
    returns {"rounds", "accepted", "acceptance_rate"} (accepted draft tokens / proposed).
    """
    rule = speculative_rule(temperature, top_k, top_p, draft_steps)
    capacity = capacity or min(model.config.sequence_len, draft_model.config.sequence_len)
    tokens, lengths = pad_prompts([prompt_tokens], capacity, max_tokens)
    progs, params = programs(model, draft_model)
    stops = tuple(int(t) for t in stop_tokens)
    spec, first = progs.start(params, tokens[0], lengths[0], jax.random.key(seed), capacity=capacity, rule=rule)
    result = [int(first)]
    if result[0] not in stops and max_tokens > 1:
        spec, out, n = progs.run(
            params,
            spec,
            np.int32(max_tokens - 1),
            k=draft_steps,
            rule=rule,
            stops=stops,
            tool_end=-1,
            chunk=decode_chunk(max_tokens),
        )
        result += np.asarray(out)[: int(n)].tolist()
    result = until_stop(result[:max_tokens], stops)
    if not return_stats:
        return result
    rounds, accepted = int(spec.rounds), int(spec.accepted)
    rate = accepted / max(rounds * draft_steps, 1)
    return result, {"rounds": rounds, "accepted": accepted, "acceptance_rate": rate}


def add_draft_flags(parser) -> None:
    """--draft-model and --draft-steps, the generation scripts' flags for speculative sampling."""
    parser.add_argument(
        "--draft-model",
        default=None,
        metavar="[SOURCE:]TAG",
        help="speculative sampling: a smaller checkpoint with the same tokenizer (e.g. d4, or base:d4; "
        "SOURCE defaults to the model's) proposes --draft-steps tokens that the model checks in "
        "one forward pass. Replies follow the same distribution (the same text at temperature "
        "0); faster when the model is much larger than the draft and they often agree",
    )
    parser.add_argument("--draft-steps", type=int, default=4, help="tokens the draft proposes per round (default: 4)")
