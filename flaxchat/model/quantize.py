"""Weight-only quantization for generation: the matmul weights stored in bf16, or in int8 with one scale per
output channel, so batch-1 decoding (which reads every weight once per token) reads 2x or 4x fewer bytes.

Which weights: every block projection (c_q, c_k, c_v, attn/mlp c_proj, c_fc) and the lm_head. The embeddings
stay as they are (a lookup reads one row per token, not the table) and so do the tiny gates (ve_gate,
smear_gate). Activations stay in the compute dtype: this is weight-only quantization.

int8 uses qwix (Google's JAX quantization library) for the quantization itself: symmetric absmax per output
channel, `qwix.quantize(w, int8, channelwise_axes=[0])`. Its NNX PTQ path (`qwix.quantize_model` with a
`PtqProvider`) is not used, because with this model it (a) intercepts one method only (forward_cached or
__call__, not both), (b) cannot reach the lm_head, whose weight belongs to a child module but is multiplied in
GPT's frame, and (c) after quantizing, fails on Linear's `self.weight[...].astype(x.dtype)` (WithAux.astype
does not accept a QArray). Instead the quantized layer below is an explicit module: its state is plain int8
and fp32 arrays, so the engine's jitted programs run it unchanged (cast_for_compute casts floating parameters
only, so the int8 values stay int8).

In the decode loop XLA's loop-invariant code motion would hoist the int8 -> float conversion of every weight out
of the `lax.while_loop` (so the loop would read float copies); the engine carries narrow weights through its loops
behind an optimisation barrier instead (`flaxchat.generate.programs.loop_weights`), and the conversion fuses into each
matrix-vector product, which then reads the int8 bytes. A prefill converts once per call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from flaxchat.model.gpt import GPT, Linear

MODES = ("none", "bf16", "int8")
QUANTIZED = ("c_q", "c_k", "c_v", "c_proj", "c_fc", "lm_head")  # Linear attribute names whose weights change


class Int8Linear(Linear):
    """A Linear whose weight is int8 (out, in) with one scale per output channel: weight ~= int8 * scale[:, None].

    The scale is constant along the contraction, so it multiplies the (..., out) result once rather than every
    weight (qwix's own weight-only einsum dequantizes the whole matrix first).
    """

    def __init__(self, linear: Linear):  # pylint: disable=super-init-not-called
        w = linear.weight
        q = qwix.quantize(w[...].astype(jnp.float32), jnp.int8, channelwise_axes=[0])  # scale (out, 1)
        axes = w.get_metadata().get("out_sharding") or (None, None)
        self.weight = nnx.Param(q.qvalue, out_sharding=axes, eager_sharding=False)  # (out, in) int8
        self.scale = nnx.Param(q.scale[:, 0], out_sharding=axes[:1], eager_sharding=False)  # (out,) fp32
        # the model's forms, but the products in the activations' dtype (no bf16 products beside wider activations)
        self.forms = dataclasses.replace(linear.forms, products=None)

    def __call__(self, x, out_dtype=None):
        y = self.product(x, self.weight[...], out_dtype)
        return y * self.scale[...].astype(y.dtype)

    def matrix(self):
        return qwix.dequantize(qwix.QArray(self.weight[...], self.scale[...][:, None].astype(jnp.float32)))


def _parent(model, path):
    return functools.reduce(lambda m, k: m[k] if isinstance(k, int) else getattr(m, k), path, model)


def quantize_for_generation(model: GPT, mode: str) -> GPT:
    """Store the model's matmul weights for generation, in place; returns the model.

    mode: "none" (as is), "bf16" (weights in bf16), "int8" (int8 + per-output-channel fp32 scales). The
    quantized model runs flaxchat.generate.engine (generate, Engine) and its plain forward; it is not for training.
    """
    if mode not in MODES:
        raise ValueError(f"unknown quantize mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "none":
        return model
    targets = [(path, m) for path, m in nnx.iter_modules(model) if type(m) is Linear and path and path[-1] in QUANTIZED]
    for path, linear in targets:
        if mode == "bf16":
            linear.weight = linear.weight.replace(value=linear.weight[...].astype(jnp.bfloat16))
        else:
            setattr(_parent(model, path[:-1]), path[-1], Int8Linear(linear))
    return model


def add_quantize_flag(parser) -> None:
    """--quantize, the generation scripts' flag for quantize_for_generation."""
    parser.add_argument(
        "--quantize",
        choices=MODES,
        default="none",
        help="matmul weights for generation: none (as trained), bf16, or int8 (weight-only, one "
        "scale per output channel, via qwix); embeddings stay as they are (default: none)",
    )


def weight_bytes(model) -> int:
    """Bytes of every parameter (what a batch-1 decode step reads, give or take the embeddings' rows)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
