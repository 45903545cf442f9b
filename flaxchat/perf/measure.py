"""Benchmark helpers behind scripts/bench.py: generation, speculative sampling and the data loader, timed.

Each returns a JSON-able dict of rates and settings; the script prints it. They live here, apart from the
library they time, so the generation core and the data loader carry no measurement code. bench_generate and
bench_data take bench's parsed flags (`args`) and give the records it prints for --what generate and --what data.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import numpy as np
from flax import nnx

from flaxchat.common import compute_dtype
from flaxchat.data.dataloader import make_loader
from flaxchat.data.tokenizer import get_tokenizer
from flaxchat.generate.engine import generate
from flaxchat.generate.programs import DecodeSettings, attention_span, controls, decode_chunk, pad_prompts, programs
from flaxchat.generate.speculative import generate_speculative
from flaxchat.model.config import config_from_flags
from flaxchat.model.gpt import GPT
from flaxchat.model.quantize import quantize_for_generation, weight_bytes
from flaxchat.perf.machine import peak_memory_gb
from flaxchat.train.checkpoint import load_named_model


def measure_generation(
    model, batch_size, prompt_len, max_new_tokens, seed=0, temperature=1.0, top_k=None, repeats=3
) -> dict:
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
    span = attention_span(prompt_len + max_new_tokens, capacity)  # the cache holds only the positions decoded
    settings = DecodeSettings(decode_chunk(max_new_tokens), tiers=(top_k,) if top_k else ())
    decode = functools.partial(progs.decode, settings=settings)
    ctl = controls(
        batch_size,
        remaining=max_new_tokens,
        seed=seed,
        lane=np.arange(batch_size),
        temperature=temperature,
        top_k=top_k or 0,
    )

    def prefill():
        return progs.start(params, tokens, lengths, copies=1, rows=batch_size, capacity=span)

    def one_run():
        t0 = time.perf_counter()
        slots = jax.block_until_ready(prefill())
        t1 = time.perf_counter()
        slots, out = jax.block_until_ready(decode(params, slots, ctl, np.int32(max_new_tokens)))
        t2 = time.perf_counter()
        _, first = decode(params, prefill(), ctl, np.int32(1))
        np.asarray(first.tokens[:, 0])  # the first tokens, on the host
        t3 = time.perf_counter()
        assert int(out.steps) == max_new_tokens
        return t1 - t0, t2 - t1, t3 - t2

    t0 = time.perf_counter()
    one_run()  # compiles prefill and decode
    cold = time.perf_counter() - t0
    runs = [one_run() for _ in range(repeats)]
    prefill_s, decode_s, ttft_s = (statistics.median(x) for x in zip(*runs))
    generated = batch_size * max_new_tokens
    return {
        "batch_size": batch_size,
        "prompt_len": prompt_len,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_k": top_k,
        "tok_per_s": generated / decode_s,
        "decode_steps_per_s": max_new_tokens / decode_s,
        "ttft_s": ttft_s,
        "prefill_tok_per_s": batch_size * prompt_len / prefill_s,
        "e2e_tok_per_s": generated / (prefill_s + decode_s),
        "compile_s": max(cold - sum(statistics.median(x) for x in zip(*runs)), 0.0),
        "repeats": repeats,
    }


def measure_speculative(
    model, draft_model, prompt, max_new_tokens, *, draft_steps=4, temperature=0.0, top_k=None, seed=0, repeats=3
) -> dict:
    """Time one continuation of `prompt` (ids) with and without the draft, every token made (no stop tokens).

    tok_per_s / plain_tok_per_s: generated tokens over wall time, prefill included (a chat reply's view);
    acceptance_rate: draft tokens kept / proposed; compile_s: first (compiling) runs minus warm ones.
    """

    def plain():
        return generate(model, [prompt], max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)[0]

    def fast():
        return generate_speculative(
            model,
            draft_model,
            prompt,
            max_new_tokens,
            draft_steps=draft_steps,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            return_stats=True,
        )

    def timed(f):
        t0 = time.perf_counter()
        out = f()
        return time.perf_counter() - t0, out

    cold = timed(plain)[0] + timed(fast)[0]
    plain_s = statistics.median(timed(plain)[0] for _ in range(repeats))
    runs = [timed(fast) for _ in range(repeats)]
    fast_s = statistics.median(t for t, _ in runs)
    tokens, stats = runs[0][1]
    if temperature == 0:  # greedy: speculative must give the model's own tokens
        assert tokens == plain(), "speculative greedy tokens differ from the model's"
    return {
        "max_new_tokens": max_new_tokens,
        "draft_steps": draft_steps,
        "temperature": temperature,
        "tok_per_s": len(tokens) / fast_s,
        "plain_tok_per_s": max_new_tokens / plain_s,
        "speedup": (len(tokens) / fast_s) / (max_new_tokens / plain_s),
        "acceptance_rate": stats["acceptance_rate"],
        "rounds": stats["rounds"],
        "compile_s": max(cold - plain_s - fast_s, 0.0),
        "repeats": repeats,
    }


def measure_throughput(
    tokenizer,
    batch_size: int = 8,
    seq_len: int = 512,
    num_batches: int = 50,
    warmup: int = 5,
    data_dir: str | None = None,
    split: str = "train",
    **loader_kwargs,
) -> dict[str, float]:
    """Tokens per second the loader alone delivers (batches/s x B x T), batches placed on the default device."""
    loader = make_loader(tokenizer, batch_size, seq_len, split, data_dir=data_dir, **loader_kwargs)
    try:
        for _ in range(warmup):
            next(loader)[0].block_until_ready()
        t0 = time.perf_counter()
        for _ in range(num_batches):
            next(loader)[0].block_until_ready()
        dt = time.perf_counter() - t0
    finally:
        loader.close()
    return {
        "tokens_per_s": num_batches * batch_size * seq_len / dt,
        "batches_per_s": num_batches / dt,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "num_batches": num_batches,
        "seconds": dt,
    }


# -----------------------------------------------------------------------------
# bench --what generate / data


def bench_generate(args) -> dict:
    """--checkpoint's model (or a random one of the flags' shape), --quantize'd, timed by measure_generation; with
    --draft-model, speculative sampling from a text prompt against plain sampling (measure_speculative)."""
    dtype = compute_dtype(args.dtype)
    if args.checkpoint:
        model = load_named_model(args.checkpoint, "sft", "--checkpoint", dtype=dtype)
    else:
        model = GPT(config_from_flags(args, args.vocab_size), rngs=nnx.Rngs(0), dtype=dtype)
    model = quantize_for_generation(model, args.quantize)
    info = {"quantize": args.quantize, "weight_mb": weight_bytes(model) / 2**20, "checkpoint": args.checkpoint}
    if not args.draft_model:
        out = measure_generation(
            model, args.batch_size, args.prompt_len, args.max_new_tokens, temperature=args.temperature
        )
        return {"what": "generate", **out, **info, "peak_mem_gb": peak_memory_gb()}
    source = args.checkpoint.rpartition(":")[0] or "sft"
    draft = load_named_model(args.draft_model, source, "--draft-model", dtype=dtype)
    draft = quantize_for_generation(draft, args.quantize)
    tokenizer = get_tokenizer()  # a text prompt: how often the draft agrees depends on real text
    prompt = [tokenizer.get_bos_token_id()] + tokenizer.encode("Once upon a time, there was a little")
    out = measure_speculative(
        model, draft, prompt, args.max_new_tokens, draft_steps=args.draft_steps, temperature=args.temperature
    )
    return {
        "what": "generate",
        "speculative": True,
        "draft_model": args.draft_model,
        **out,
        **info,
        "draft_weight_mb": weight_bytes(draft) / 2**20,
        "peak_mem_gb": peak_memory_gb(),
    }


def bench_data(args) -> dict:
    """The Grain loader's tokens per second over the base dir's tokenizer and shards (measure_throughput)."""
    tokenizer = get_tokenizer()
    out = measure_throughput(tokenizer, batch_size=args.device_batch_size, seq_len=args.max_seq_len)
    return {"what": "data", "tok_per_s": out["tokens_per_s"], **out, "vocab_size": tokenizer.get_vocab_size()}
