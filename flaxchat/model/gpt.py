"""The GPT model in Flax NNX: nanochat's architecture, weight for weight.

- rotary position embeddings (base 100k, nanochat's rotation convention), no learned positions
- QK RMS-norm then x1.2; parameter-free RMSNorm everywhere, also right after the token embedding
- ReLU^2 MLP (4x), no biases, untied wte / lm_head, logit soft-cap 15
- GQA (n_kv_head <= n_head), sliding windows from `window_pattern`
- value embeddings on alternating layers mixed into V with a per-head 3*sigmoid gate
- smear (previous-token mix), backout (subtract the mid-layer residual), per-layer resid/x0 lambdas

Parameters are stored in nanochat's layout (Linear weight is (out, in), embeddings (vocab, dim)) and under
nanochat's names, so a state dict maps across with no transposes. Parameters carry logical axis names only;
`flaxchat.sharding` maps them onto a mesh. The attention kernels are in `flaxchat.model.attention`, the fused
lm_head + cross-entropy loss in `flaxchat.model.loss`. How the products, attention and loss are computed (the plain
forms, or on a CPU the forms XLA:CPU runs faster) is the model's `forms`, chosen once when it is built
(`flaxchat.model.cpu.Forms`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat import sharding
from flaxchat.common import compute_dtype
from flaxchat.model import cpu
from flaxchat.model.attention import (
    ATTENTION_IMPLEMENTATIONS,
    attention,
    cached_attention,
    resolve_attention,
    write_cache,
)
from flaxchat.model.config import GPTConfig
from flaxchat.model.loss import SOFTCAP, loss_sum, softcapped_logits, token_losses

ROPE_BASE = 100_000
VE_GATE_CHANNELS = 12
SMEAR_CHANNELS = 24
QK_SCALE = 1.2


# -----------------------------------------------------------------------------
# Initialisation: nanochat's table, in one place


def init_table(config: GPTConfig) -> dict:
    """name -> initializer(key, shape). Block matrices use uniform with the std of N(0, 1/n_embd)."""
    s = math.sqrt(3.0) * config.n_embd**-0.5  # uniform bound with the same std as normal(1/sqrt(n_embd))

    def normal(std):
        return lambda key, shape: std * jax.random.normal(key, shape, jnp.float32)

    def uniform(lo, hi):
        return lambda key, shape: jax.random.uniform(key, shape, jnp.float32, lo, hi)

    def zeros(key, shape):
        return jnp.zeros(shape, jnp.float32)

    n = config.n_layer
    return {
        "wte": normal(0.8),
        "lm_head": normal(0.001),
        "c_q": uniform(-s, s),
        "c_k": uniform(-s, s),
        "c_v": uniform(-s, s),
        "attn.c_proj": zeros,  # residual projections start at zero
        "c_fc": uniform(-0.4 * s, 0.4 * s),
        "mlp.c_proj": zeros,
        "value_embeds": uniform(-s, s),  # like c_v
        "ve_gate": uniform(0.0, 0.02),  # gates start slightly above neutral
        "smear_gate": uniform(0.0, 0.02),
        # stronger residual early, weaker deep; more x0 blending early
        "resid_lambdas": lambda key, shape: 1.15 - 0.10 * jnp.arange(n, dtype=jnp.float32) / max(n - 1, 1),
        "x0_lambdas": lambda key, shape: 0.20 - 0.15 * jnp.arange(n, dtype=jnp.float32) / max(n - 1, 1),
        "smear_lambda": zeros,
        "backout_lambda": lambda key, shape: jnp.full(shape, 0.2, jnp.float32),
    }


def _param(init, key, shape, axes, dtype=jnp.float32):
    # eager_sharding=False: the model can be built with or without a mesh; flaxchat.sharding places it.
    return nnx.Param(init(key, shape).astype(dtype), out_sharding=axes, eager_sharding=False)


# -----------------------------------------------------------------------------
# Building blocks


def rms_norm(x):
    """Parameter-free RMSNorm over the last dim, eps = the dtype's machine epsilon (as torch's rms_norm), in fp32."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + jnp.finfo(x.dtype).eps)
    return y.astype(x.dtype)


def rotary_cos_sin(positions, head_dim, dtype):
    """cos/sin tables for integer positions (...,) -> (..., head_dim/2) in `dtype`, computed in fp32."""
    inv_freq = 1.0 / (ROPE_BASE ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(freqs).astype(dtype), jnp.sin(freqs).astype(dtype)


def rotary_table(T: int, head_dim: int, dtype):
    """rotary_cos_sin of positions 0..T-1 as numpy constants, precomputed as nanochat keeps them in buffers (XLA
    would otherwise fuse cos/sin into every rotary multiply and evaluate them per element). The fp32 steps of the
    traced version are rounded the same way, so the frequencies are bit-equal; cos/sin are correctly rounded
    (within an ulp of XLA's and torch's)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    power = (float(ROPE_BASE) ** exponent.astype(np.float64)).astype(np.float32)
    inv_freq = (1.0 / power.astype(np.float64)).astype(np.float32)
    freqs = (np.arange(T, dtype=np.float32)[:, None] * inv_freq).astype(np.float64)
    return np.cos(freqs).astype(np.float32).astype(dtype), np.sin(freqs).astype(np.float32).astype(dtype)


def apply_rotary(x, cos, sin):
    """x (B, T, H, D); cos/sin (B or 1, T, 1, D/2). Rotates by -theta (nanochat's convention):
    (x1, x2) -> (x1 cos + x2 sin, x2 cos - x1 sin) for the two halves of each head."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=-1)


class Linear(nnx.Module):
    """Bias-free linear layer, weight (out, in) like torch's: y = x @ weight.T, in the input's dtype."""

    def __init__(self, in_features, out_features, *, init, axes, rngs, forms):
        self.weight = _param(init, rngs.params(), (out_features, in_features), axes)
        self.forms = forms  # the model's: how the product is computed

    def __call__(self, x, out_dtype=None):
        return self.product(x, self.weight[...], out_dtype)

    def product(self, x, w, out_dtype=None):
        """x (..., in) @ w (out, in).T with w in x's dtype; out_dtype: the result's dtype (default x's). The einsum
        "...i,oi->...o", or on a CPU another form of it (Forms.linear)."""
        return self.forms.linear(x, w, out_dtype)

    def matrix(self):
        """The (out, in) weight as a float array (model.quantize's int8 variant dequantizes here)."""
        return self.weight[...]


def stackable(layers) -> bool:
    """Whether Linear layers' products can run as one over their weights stacked: plain Linears (not int8, not
    adapted by LoRA) computing alike, their weights of one dtype."""
    first = layers[0]
    return all(type(m) is Linear and m.forms == first.forms for m in layers) and (
        len({m.weight[...].dtype for m in layers}) == 1
    )


def stacked_product(x, layers, stacked=None):
    """x through several Linear layers at once: one product over their weights stacked, split back per layer (q, k
    and v). A decode step has a few rows, and one (rows, C) x (C, 3C) product costs less than three small ones.
    Layers of another kind (int8, adapted by LoRA) go one by one, and so do weights stored in another dtype than x
    (bf16 weights for generation): converted one by one, each conversion fuses into its own product. `stacked`: the
    weights stacked ahead (a generation model's, see with_stacked_qkv)."""
    weights = [m.weight[...] for m in layers]
    if not stackable(layers) or weights[0].dtype != x.dtype:
        return tuple(m(x) for m in layers)
    y = layers[0].product(x, jnp.concatenate(weights) if stacked is None else stacked)
    return tuple(jnp.split(y, np.cumsum([w.shape[0] for w in weights[:-1]]).tolist(), axis=-1))


class StackedWeight(nnx.Param):
    """q, k and v's weights stacked once, held beside them by a model built for generation (with_stacked_qkv)."""


def with_stacked_qkv(model):
    """The model for generation: a copy sharing its arrays whose attention layers also hold q, k and v's weights
    stacked (`c_qkv`). A decode program stacks them itself otherwise, a copy of every attention weight once per
    call, which short chunks (tokens streamed as they are made) would pay on every call."""
    model = nnx.merge(*nnx.split(model))
    for attn in [m for _, m in nnx.iter_graph(model) if isinstance(m, CausalSelfAttention)]:
        layers = (attn.c_q, attn.c_k, attn.c_v)
        if stackable(layers):
            attn.c_qkv = StackedWeight(jnp.concatenate([m.weight[...] for m in layers]))
    return model


class Embedding(nnx.Module):
    def __init__(self, num, dim, *, init, axes, rngs, dtype=jnp.float32):
        self.weight = _param(init, rngs.params(), (num, dim), axes, dtype)

    def __call__(self, idx, dtype):
        # the table's FSDP shards are gathered before the lookup (its vocab split stays): a lookup into a table
        # split along its width crashes XLA's partitioner inside the data-parallel shard_map of the train step
        table = sharding.constrain(self.weight[...], ("vocab", None))
        # Looked up in fp32 (the convert fuses into the gather): the lookup's gradient is a scatter-add over the
        # batch's tokens, and into a bf16 table it rounds to bf16 after every add. A token seen 5,000 times then
        # got about 256 times its gradient, and on a GPU a bf16 scatter-add whose indices repeat that often is
        # far slower than a fp32 one (XLA issue 26371). Summed in fp32 (the GPU's atomic add: see
        # sharding.native_gpu_atomics) and rounded once, as torch's embedding backward does.
        return jnp.take(table.astype(jnp.float32), idx, axis=0).astype(dtype)


class CausalSelfAttention(nnx.Module):
    def __init__(self, config: GPTConfig, layer_idx: int, init: dict, rngs: nnx.Rngs, forms):
        C, H, Hkv, D = config.n_embd, config.n_head, config.n_kv_head, config.head_dim
        self.n_head, self.n_kv_head, self.head_dim = H, Hkv, D
        self.forms = forms  # the model's, for the attention kernel
        self.c_q = Linear(C, H * D, init=init["c_q"], axes=("heads", "embed"), rngs=rngs, forms=forms)
        self.c_k = Linear(C, Hkv * D, init=init["c_k"], axes=("kv_heads", "embed"), rngs=rngs, forms=forms)
        self.c_v = Linear(C, Hkv * D, init=init["c_v"], axes=("kv_heads", "embed"), rngs=rngs, forms=forms)
        self.c_proj = Linear(H * D, C, init=init["attn.c_proj"], axes=("embed", "heads"), rngs=rngs, forms=forms)
        self.ve_gate = (
            Linear(VE_GATE_CHANNELS, Hkv, init=init["ve_gate"], axes=(None, None), rngs=rngs, forms=forms)
            if config.has_ve(layer_idx)
            else None
        )

    def qkv(self, x, ve, cos, sin, fused=False):
        """fused: q, k and v from one product over their stacked weights (stacked_product), as prefill and decode
        ask (a decode step has a few rows; a prefill stacks too, so that its keys and values are bit for bit those a
        later cached call computes)."""
        B, T, _ = x.shape
        heads, kv_heads = ("batch", None, "heads", None), ("batch", None, "kv_heads", None)
        layers, stacked = (self.c_q, self.c_k, self.c_v), getattr(self, "c_qkv", None)
        stacked = None if stacked is None else stacked[...]
        q, k, v = stacked_product(x, layers, stacked) if fused else (m(x) for m in layers)
        q = sharding.constrain(q.reshape(B, T, self.n_head, self.head_dim), heads)  # (B, T, H, D)
        k = sharding.constrain(k.reshape(B, T, self.n_kv_head, self.head_dim), kv_heads)  # (B, T, Hkv, D)
        v = sharding.constrain(v.reshape(B, T, self.n_kv_head, self.head_dim), kv_heads)
        if ve is not None:  # value residual (ResFormer), gated per kv head in (0, 3)
            gate = 3.0 * jax.nn.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))  # (B, T, Hkv)
            ve = sharding.constrain(ve.reshape(B, T, self.n_kv_head, self.head_dim), kv_heads)
            v = v + gate[..., None] * ve
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k = rms_norm(q) * QK_SCALE, rms_norm(k) * QK_SCALE
        return q, k, v

    def __call__(self, x, ve, cos, sin, window, cache=None, attention_impl="xla", fresh=False):
        """cache: (k_cache, v_cache, pos) to attend over and write into, or None; fresh: the cache is empty (every
        row at position 0), so the new tokens attend only to each other (a prompt's prefill: causal attention,
        chunked on a CPU; the fused GPU/TPU kernels are left to training, whose lengths they are tuned for)."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x, ve, cos, sin, fused=cache is not None)  # prefill and decode: stacked
        new_cache = None
        if cache is None:
            y = attention(q, k, v, window, attention_impl, self.forms)
            y = sharding.constrain(y, ("batch", None, "heads", None))
        elif fresh:
            y = attention(q, k, v, window, "chunked" if attention_impl == "chunked" else "xla", self.forms)
        else:
            y = cached_attention(q, k, v, *cache, window)
        if cache is not None:
            k_cache, v_cache, pos = cache
            new_cache = (write_cache(k_cache, k, pos, 2, after=y), write_cache(v_cache, v, pos, 3, after=y))
        out_dtype = self.forms.residual_dtype(x.dtype)  # (a CPU's attention may answer in bf16 beside fp32 x)
        return self.c_proj(y.reshape(B, T, -1), out_dtype=out_dtype), new_cache


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, init: dict, rngs: nnx.Rngs, forms):
        C = config.n_embd
        self.c_fc = Linear(C, 4 * C, init=init["c_fc"], axes=("mlp", "embed"), rngs=rngs, forms=forms)
        self.c_proj = Linear(4 * C, C, init=init["mlp.c_proj"], axes=("embed", "mlp"), rngs=rngs, forms=forms)

    def __call__(self, x):
        h = sharding.constrain(self.c_fc(x), ("batch", None, "mlp"))  # (B, T, 4C)
        return self.c_proj(jnp.square(jax.nn.relu(h)))


class Block(nnx.Module):
    def __init__(self, config: GPTConfig, layer_idx: int, init: dict, rngs: nnx.Rngs, forms):
        self.attn = CausalSelfAttention(config, layer_idx, init, rngs, forms)
        self.mlp = MLP(config, init, rngs, forms)

    def __call__(self, x, ve, cos, sin, window, cache=None, attention_impl="xla", fresh=False):
        y, new_cache = self.attn(rms_norm(x), ve, cos, sin, window, cache, attention_impl, fresh)
        x = x + y
        x = x + self.mlp(rms_norm(x))
        return x, new_cache


class Transformer(nnx.Module):
    """Holds wte and the blocks, so parameter paths read `transformer.wte.weight`, `transformer.h.0...` as nanochat."""

    def __init__(self, config: GPTConfig, init: dict, rngs: nnx.Rngs, forms, embed_dtype=jnp.float32):
        self.wte = Embedding(
            config.padded_vocab_size,
            config.n_embd,
            init=init["wte"],
            axes=("vocab", "embed"),
            rngs=rngs,
            dtype=embed_dtype,
        )
        self.h = nnx.List([Block(config, i, init, rngs, forms) for i in range(config.n_layer)])


# -----------------------------------------------------------------------------
# The model


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Fixed-capacity cache as explicit state: per-layer K/V, each row's position, the smear state."""

    k: tuple  # per layer (B, Hkv, S, D): separate buffers, each updated in place while decoding
    v: tuple  # per layer (B, Hkv, D, S): positions on the minor axis (see cached_attention)
    pos: jax.Array  # (B,) int32: tokens already in the cache for each row
    prev_embedding: jax.Array  # (B, C): normalised embedding of each row's last token (for smear)


def add_kernel_flags(parser) -> None:
    """--attention and --remat, the scripts' flags for GPT's kernel choices."""
    parser.add_argument(
        "--attention",
        type=str,
        default="auto",
        choices=ATTENTION_IMPLEMENTATIONS,
        help="attention kernel: auto = cuDNN on GPU, Splash on TPU, chunked on CPU (printed at start)",
    )
    parser.add_argument(
        "--remat",
        type=str,
        default="none",
        choices=list(REMAT_POLICIES),
        help="recompute in the backward pass to save memory: none, dots (keep matmul outputs), full",
    )


def _block_runner(window, attention_impl):
    """block(x, ...) with its static arguments bound, for nnx.remat (which takes positional arguments only)."""
    return lambda block, x, ve, cos, sin: block(x, ve, cos, sin, window, None, attention_impl)


REMAT_POLICIES = {
    "none": None,  # keep every activation the backward pass needs
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep projections, recompute the rest
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only each block's input
}


class GPT(nnx.Module):
    """nanochat's GPT. dtype: compute dtype (activations, matmuls; also the embedding tables' storage, as
    nanochat stores them, except for fp16); bf16 on a CPU multiplies in bf16 and keeps the training forward's
    activations in fp32 (Forms.activation_dtype). attention: see `resolve_attention`.
    remat: what each block keeps for the backward pass (REMAT_POLICIES); "dots" or "full" trade recomputation for
    activation memory. forms: how the products, attention and loss are computed (flaxchat.model.cpu.Forms); by
    default the plain forms, or on a CPU the paths FLAXCHAT_CPU_PATHS leaves on (cpu.forms_for)."""

    def __init__(
        self,
        config: GPTConfig,
        *,
        rngs: nnx.Rngs,
        dtype=None,
        attention: str = "auto",
        remat: str = "none",
        forms=None,
    ):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"unknown remat {remat!r}; choose one of {', '.join(REMAT_POLICIES)}")
        self.config = config
        self.dtype = dtype if dtype is not None else compute_dtype()
        self.forms = forms if forms is not None else cpu.forms_for(self.dtype)
        self.activation_dtype = self.forms.activation_dtype(self.dtype)  # training forwards (forward_cached: dtype)
        self.attention = resolve_attention(attention, dtype=self.dtype, head_dim=config.head_dim, forms=self.forms)
        self.remat = remat
        self.window_sizes = config.window_sizes()
        init = init_table(config)
        Vp, C, L = config.padded_vocab_size, config.n_embd, config.n_layer
        kv_dim = config.n_kv_head * config.head_dim
        embed_dtype = jnp.float32 if self.dtype == jnp.float16 else self.dtype
        self.transformer = Transformer(config, init, rngs, self.forms, embed_dtype)
        self.lm_head = Linear(C, Vp, init=init["lm_head"], axes=("vocab", "embed"), rngs=rngs, forms=self.forms)
        self.resid_lambdas = _param(init["resid_lambdas"], rngs.params(), (L,), (None,))
        self.x0_lambdas = _param(init["x0_lambdas"], rngs.params(), (L,), (None,))
        self.smear_gate = Linear(
            SMEAR_CHANNELS, 1, init=init["smear_gate"], axes=(None, None), rngs=rngs, forms=self.forms
        )
        self.smear_lambda = _param(init["smear_lambda"], rngs.params(), (1,), (None,))
        self.backout_lambda = _param(init["backout_lambda"], rngs.params(), (1,), (None,))
        self.value_embeds = nnx.Dict(
            {
                str(i): Embedding(
                    Vp, kv_dim, init=init["value_embeds"], axes=("vocab", "embed"), rngs=rngs, dtype=embed_dtype
                )
                for i in range(L)
                if config.has_ve(i)
            }
        )

    # --- forward pieces -------------------------------------------------------

    def _smear(self, x, prev):
        """Mix the previous token's embedding into each position. x (B,T,C); prev (B,C) or None (none before)."""
        gate = self.smear_lambda[...].astype(x.dtype) * jax.nn.sigmoid(self.smear_gate(x[..., :SMEAR_CHANNELS]))
        before = x[:, :-1] if prev is None else jnp.concatenate([prev[:, None].astype(x.dtype), x[:, :-1]], axis=1)
        if prev is None:
            return jnp.concatenate([x[:, :1], x[:, 1:] + gate[:, 1:] * before], axis=1)
        return x + gate * before

    def _trunk(self, idx, x, cos, sin, cache=None, fresh=False):
        """Blocks + backout + final norm. Returns (B, T, C) and the updated per-layer K/V (or None)."""
        x0 = x
        backout_layer = self.config.n_layer // 2
        x_backout = x
        new_k, new_v = [], []
        for i, block in enumerate(self.transformer.h):
            x = self.resid_lambdas[i].astype(x.dtype) * x + self.x0_lambdas[i].astype(x.dtype) * x0
            x = sharding.constrain(x, ("batch", None, None))  # the residual stream: rows split, width whole
            ve = self.value_embeds[str(i)](idx, x.dtype) if str(i) in self.value_embeds else None
            layer_cache = None if cache is None else (cache.k[i], cache.v[i], cache.pos)
            if cache is None and self.remat != "none":
                run = _block_runner(self.window_sizes[i], self.attention)
                x, kv = nnx.remat(run, policy=REMAT_POLICIES[self.remat])(block, x, ve, cos, sin)
            else:
                x, kv = block(x, ve, cos, sin, self.window_sizes[i], layer_cache, self.attention, fresh)
            if kv is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
            if i == backout_layer:
                x_backout = x
        x = x - self.backout_lambda[...].astype(x.dtype) * x_backout
        return rms_norm(x), (new_k, new_v)

    def __call__(self, idx, targets=None, loss_reduction="mean", logits_at=None):
        """idx (B, T) int -> logits (B, T, vocab) fp32, or the loss if targets are given (-1 = ignore).

        loss_reduction: "mean" over non-ignored targets, "sum", or "none" (per-token (B, T), 0 where ignored).
        logits_at (B,) int, without targets: only each row's logits at that index of T, (B, vocab), so that a
        multiple-choice evaluation does not pay for (T, vocab) logits it throws away.
        """
        B, T = idx.shape
        cos, sin = rotary_table(T, self.config.head_dim, self.activation_dtype)
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
        x = rms_norm(self.transformer.wte(idx, self.activation_dtype))
        x = self._smear(x, None)
        x, _ = self._trunk(idx, x, cos, sin)
        w = self.lm_head.matrix()
        x = x.reshape(B * T, -1).astype(self.dtype)  # the lm_head's products in the compute dtype
        if targets is None and logits_at is not None:
            x = jnp.take_along_axis(x.reshape(B, T, -1), logits_at[:, None, None], axis=1)[:, 0]  # (B, C)
            return softcapped_logits(x, w, self.config.vocab_size, self.forms)
        if targets is None:
            return softcapped_logits(x, w, self.config.vocab_size, self.forms).reshape(B, T, -1)
        xf, tf = x, targets.reshape(B * T).astype(jnp.int32)
        if loss_reduction == "none":
            return token_losses(xf, w, tf, self.config.vocab_size, self.forms).reshape(B, T)
        total = loss_sum(xf, w, tf, self.config.vocab_size, self.forms)
        if loss_reduction == "sum":
            return total
        if loss_reduction == "mean":
            return total / jnp.maximum(jnp.sum(tf >= 0), 1)
        raise ValueError(f"loss_reduction must be mean, sum or none, got {loss_reduction!r}")

    def init_cache(self, batch_size, max_len, dtype=None) -> KVCache:
        c = self.config
        dtype = dtype or self.dtype
        zeros = lambda *shape: tuple(jnp.zeros(shape, dtype) for _ in range(c.n_layer))
        return KVCache(
            k=zeros(batch_size, c.n_kv_head, max_len, c.head_dim),
            v=zeros(batch_size, c.n_kv_head, c.head_dim, max_len),
            pos=jnp.zeros((batch_size,), jnp.int32),
            prev_embedding=jnp.zeros((batch_size, c.n_embd), dtype),
        )

    def forward_cached(self, idx, cache: KVCache, logits_at=None, fresh=False):
        """Run idx (B, T) at each row's cache position; returns logits (B, T, vocab) fp32 and the new cache.

        Prefill and decode (T=1) are the same function; a row at position 0 has no previous token to smear from.
        logits_at (B,) int: return only each row's logits at that index of T, (B, vocab), so a prefill does not
        pay for (T, vocab) logits it throws away. fresh (static): the cache is empty (a prompt's prefill), so
        attention need not read it.
        """
        B, T = idx.shape
        positions = cache.pos[:, None] + jnp.arange(T)[None, :]  # (B, T)
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.dtype)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        x = rms_norm(self.transformer.wte(idx, self.dtype))
        prev = jnp.where((cache.pos > 0)[:, None], cache.prev_embedding.astype(x.dtype), 0.0)
        new_prev = x[:, -1]
        x = self._smear(x, prev)
        x, (ks, vs) = self._trunk(idx, x, cos, sin, cache, fresh)
        new_cache = KVCache(
            k=tuple(ks), v=tuple(vs), pos=cache.pos + T, prev_embedding=new_prev.astype(cache.prev_embedding.dtype)
        )
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)  # (B, 1, C)
            return self._head(x[:, 0]), new_cache
        return self._head(x.reshape(B * T, -1)).reshape(B, T, -1), new_cache

    def _head(self, x):
        """x (N, C) -> soft-capped fp32 logits (N, vocab), through the lm_head module so a quantized head
        (flaxchat.model.quantize) applies its own matmul; the same numbers as softcapped_logits for a float head (the
        product rounded to the compute dtype, then soft-capped in fp32)."""
        logits = self.lm_head(x, out_dtype=jnp.float32)[:, : self.config.vocab_size].astype(self.dtype)
        logits = logits.astype(jnp.float32)
        return SOFTCAP * jnp.tanh(logits / SOFTCAP)

    # --- accounting (nanochat's definitions) ---------------------------------

    def num_matmul_params(self) -> int:
        """Parameters that multiply the token stream (every Linear weight): 2 FLOPs each per token forward."""
        return sum(m.weight.size for _, m in nnx.iter_graph(self) if isinstance(m, Linear))

    def estimate_flops(self) -> int:
        """Training FLOPs per token: 6 per matmul param + attention (12*h*q*effective window per layer)."""
        c = self.config
        h, q, t = c.n_head, c.head_dim, c.sequence_len
        attn = sum(12 * h * q * min(w, t) for w in self.window_sizes)
        return 6 * self.num_matmul_params() + attn

    def num_scaling_params(self) -> dict:
        """Parameter counts by group, for scaling-law bookkeeping (nanochat's groups)."""
        size = lambda tree: sum(x.size for x in jax.tree.leaves(nnx.state(tree, nnx.Param)))
        counts = {
            "wte": size(self.transformer.wte),
            "value_embeds": size(self.value_embeds),
            "lm_head": size(self.lm_head),
            "transformer_matrices": size(self.transformer.h),
            "scalars": sum(
                p.size
                for p in (
                    self.resid_lambdas,
                    self.x0_lambdas,
                    self.smear_gate.weight,
                    self.smear_lambda,
                    self.backout_lambda,
                )
            ),
        }
        counts["total"] = sum(counts.values())
        return counts
