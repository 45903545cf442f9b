"""Weight-only quantization for generation: int8 state is int8 with per-output-channel scales, quantized logits
stay close to fp32's (full and cached forwards), greedy generation mostly agrees, sharded == unsharded, the Engine
runs it, bad modes are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from flaxchat import sharding
from flaxchat.data.tokenizer import Tokenizer
from flaxchat.generate import speculative
from flaxchat.generate.engine import Engine, generate
from flaxchat.generate.programs import (
    DecodeSettings,
    compiler_options,
    controls,
    in_compute_dtype,
    pad_prompts,
    programs,
)
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT, Linear
from flaxchat.model.quantize import MODES, Int8Linear, quantize_for_generation, weight_bytes

CONFIG = GPTConfig(sequence_len=128, vocab_size=512, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)


def make_model(config=CONFIG, seed=0):
    """A GPT filled from numpy (faster than compiling nanochat's init, and no projection left at zero): matrices
    N(0, 1/fan_in) so every matmul keeps its input's scale, the per-layer scalars N(0, 0.1)."""
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0), dtype=jnp.float32))
    rng = np.random.default_rng(seed)
    fill = lambda x: jnp.asarray(rng.normal(0.0, x.shape[-1] ** -0.5 if x.ndim == 2 else 0.1, x.shape), jnp.float32)
    nnx.update(model, jax.tree.map(fill, nnx.state(model)))
    return model


def rel_err(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.fixture(scope="module")
def idx():
    return jnp.asarray(np.random.default_rng(1).integers(0, CONFIG.vocab_size, (2, 48)), jnp.int32)


@pytest.fixture(scope="module")
def reference(idx):
    return make_model()(idx)


def test_int8_state_has_int8_weights_and_per_channel_scales():
    model = quantize_for_generation(make_model(), "int8")
    quantized = [(p, m) for p, m in nnx.iter_modules(model) if isinstance(m, Int8Linear)]
    names = {p[-1] for p, _ in quantized}
    assert names == {"c_q", "c_k", "c_v", "c_proj", "c_fc", "lm_head"}
    assert len(quantized) == 6 * CONFIG.n_layer + 1  # q, k, v, attn proj, fc, mlp proj per block + lm_head
    for _, m in quantized:
        assert m.weight.dtype == jnp.int8 and m.scale.dtype == jnp.float32
        assert m.scale.shape == (m.weight.shape[0],)  # one scale per output channel
        assert int(jnp.max(jnp.abs(m.weight[...].astype(jnp.int32)))) >= 127  # absmax maps onto the full range
    # embeddings and the small gates are left as they were
    assert model.transformer.wte.weight.dtype == jnp.float32
    assert type(model.smear_gate) is Linear and model.smear_gate.weight.dtype == jnp.float32
    assert weight_bytes(model) < weight_bytes(make_model())


def test_int8_dequantizes_to_the_weight():
    ref = make_model()
    model = quantize_for_generation(make_model(), "int8")
    w, q = ref.transformer.h[0].mlp.c_fc.matrix(), model.transformer.h[0].mlp.c_fc
    step = q.scale[...][:, None]  # one quantization step per output row
    assert bool(jnp.allclose(step, jnp.max(jnp.abs(w), axis=1, keepdims=True) / 127.5))  # symmetric absmax
    assert bool(jnp.all(jnp.abs(q.matrix() - w) <= step / 2 + 1e-6))  # rounding error at most half a step


# int8 per-channel rounding adds ~0.6% relative error per matmul at these 64..256-wide rows (step/sqrt(12) over a
# row's rms); 13 independent matmuls compound it to ~2.2% in the logits. bf16 adds ~0.2% per matmul.
@pytest.mark.parametrize("mode,tol", [("none", 0.0), ("bf16", 0.01), ("int8", 0.03)])
def test_logits_close_to_fp32(idx, reference, mode, tol):
    model = quantize_for_generation(make_model(), mode)
    logits = model(idx)
    assert rel_err(logits, reference) <= tol
    cached, _ = model.forward_cached(idx, model.init_cache(idx.shape[0], CONFIG.sequence_len))
    assert rel_err(cached, logits) < 1e-5  # the cached path uses the same quantized matmuls
    # teacher-forced next-token choices agree almost everywhere
    agree = float(jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(reference, -1)))
    assert agree >= 0.9


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_greedy_generation_mostly_agrees(mode):
    prompts = [[1, 2, 3, 4], [50, 60, 70]]
    want = generate(make_model(), prompts, 8, temperature=0.0)
    got = generate(quantize_for_generation(make_model(), mode), prompts, 8, temperature=0.0)
    agree = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g))
    assert agree >= 12  # of 16: a near-tie may flip a token and the continuation after it


@pytest.mark.eight_devices
def test_int8_sharded_generation_equals_unsharded():
    prompts = [[1, 2, 3, 4], [50, 60, 70]]
    want = generate(quantize_for_generation(make_model(), "int8"), prompts, 8, temperature=0.0)
    mesh = sharding.make_mesh(data=2, tensor=4)
    # quantized after sharding (scripts.eval's order) and sharded after quantizing: the scales follow the rows
    first = quantize_for_generation(sharding.shard_model(make_model(), mesh), "int8")
    second = sharding.shard_model(quantize_for_generation(make_model(), "int8"), mesh)
    assert second.lm_head.scale[...].sharding.spec == P("tensor")
    for model in (first, second):
        assert generate(model, prompts, 8, temperature=0.0) == want


def test_engine_generates_with_the_int8_model():
    tok = Tokenizer.train_from_iterator(iter(["The cat sat on the mat. 2+2 is 4.\n" * 20]), 300)
    config = GPTConfig(sequence_len=64, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    model = quantize_for_generation(make_model(config), "int8")
    engine = Engine(model, tok)
    prompt = tok.encode("The cat", prepend=tok.get_bos_token_id())
    sequences, masks = engine.generate_batch(prompt, num_samples=2, max_tokens=6, temperature=1.0, seed=0)
    assert len(sequences) == 2 and all(len(s) > len(prompt) for s in sequences)
    assert all(0 <= t < config.vocab_size for s in sequences for t in s)
    # cast_for_compute casts floating parameters only: the int8 weights reach the compiled programs as int8
    params = in_compute_dtype(nnx.state(model, nnx.Param), jnp.bfloat16)
    assert params["lm_head"]["weight"].dtype == jnp.int8


def test_bad_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown quantize mode 'int4'; choose one of none, bf16, int8"):
        quantize_for_generation(make_model(), "int4")
    assert MODES == ("none", "bf16", "int8")


def float_copies_of_int8_matrices(hlo: str, params) -> list[str]:
    """Instructions of a compiled program's entry computation (outside its loops) that make a float array the shape
    of one of params' int8 matrices."""
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    shapes = {f"f32[{a},{b}]" for a, b in (x.shape for x in jax.tree.leaves(params) if x.dtype == jnp.int8)}
    assert shapes
    computed = [line.split("=", 1)[1] for line in entry.splitlines() if " = " in line and "parameter(" not in line]
    return [line for line in computed if any(line.strip().startswith(s) for s in shapes)]


def test_int8_decode_loop_reads_int8_weights(users_codegen):
    """The decode loop converts the int8 weights inside each step (fused into its matrix-vector products): no
    float copy of a weight matrix is made outside the loop, and greedy decoding equals the uncached forward.
    On a CPU the int8 programs compile with 512-bit vectors (the compile below would fail on an unknown option);
    float models keep XLA's defaults."""
    model = quantize_for_generation(make_model(), "int8")
    progs, params = programs(model)
    assert progs.options == (("xla_cpu_prefer_vector_width", 512),)
    assert programs(make_model())[0].options == compiler_options(nnx.state(make_model())) == ()
    padded, lengths = pad_prompts([[1, 2, 3, 4]], 64, 8)
    slots = progs.start(params, padded, lengths, copies=1, rows=1, capacity=64)
    hlo = (
        progs.decode.lower(params, slots, controls(1, remaining=8), np.int32(8), settings=DecodeSettings(8))
        .compile(compiler_options=users_codegen)
        .as_text()
    )
    assert not float_copies_of_int8_matrices(hlo, params)
    forward = nnx.jit(lambda m, idx: m(idx))  # one program: the sequence right-padded to 16 (causal, so harmless)
    seq = [1, 2, 3, 4]
    for _ in range(6):
        seq.append(int(jnp.argmax(forward(model, jnp.asarray([seq + [0] * (16 - len(seq))]))[0, len(seq) - 1])))
    assert generate(model, [[1, 2, 3, 4]], 6, temperature=0.0)[0] == seq[4:]


def test_int8_speculative_loop_reads_int8_weights(users_codegen):
    """Speculative sampling with an int8 model and an int8 draft: the rounds convert the weights inside the loop
    too, and greedy speculative decoding equals the int8 model's own greedy tokens."""
    model = quantize_for_generation(make_model(), "int8")
    draft = quantize_for_generation(make_model(GPTConfig(**{**CONFIG.to_dict(), "n_layer": 1}), seed=3), "int8")
    progs, params = speculative.programs(model, draft)
    assert progs.options == (("xla_cpu_prefer_vector_width", 512),)
    padded, lengths = pad_prompts([[1, 2, 3, 4]], 64, 8)
    greedy = (0.0, None, None)
    spec, _ = progs.start(params, padded[0], lengths[0], jax.random.key(0), capacity=64, rule=greedy)
    rule = speculative.traced_rule(greedy)  # the arguments progs.run passes its jitted program
    lowered = progs.jitted_run.lower(params, spec, np.int32(8), k=2, rule=rule, stops=(), tool_end=-1, chunk=8)
    hlo = lowered.compile(compiler_options=users_codegen).as_text()
    assert not float_copies_of_int8_matrices(hlo, params)
    plain = generate(model, [[1, 2, 3, 4]], 10, temperature=0.0)[0]
    assert speculative.generate_speculative(model, draft, [1, 2, 3, 4], 10, draft_steps=2, temperature=0.0) == plain
