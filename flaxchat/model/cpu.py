"""XLA:CPU-only fast paths, behind one switch.

Everything here exists because XLA's CPU backend runs some forms of the same computation faster than others; on
GPUs and TPUs none of it runs. The model reaches it only through `enabled()` and the functions below.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend import source_info_util

# The traced helpers here (einsum, split_in_two) are not where an op comes from: a compiled program's source lines
# (hlo.op_sources, a profile's lines) and JAX's filtered tracebacks name the line that called them instead
source_info_util.register_exclusion(__file__)


def activation_dtype(dtype, backend: str | None = None):
    """The dtype a model of compute dtype `dtype` keeps its activations in: fp32 for bf16 on a CPU, else `dtype`.

    On a CPU bf16 is the products' dtype only, as under torch's autocast: operands rounded to bf16, fp32 results
    kept (see widened_products), norms, rotary, softmax and the residual stream in fp32. XLA:CPU rounds the result
    of every bf16 elementwise op back to bf16 and runs such a chain ~4x slower than in fp32 (a (4096, 1024)
    multiply-tanh-sigmoid chain on one Zen 5 core: 12.8 ms in bf16, 2.9 ms in fp32); with fp32 activations a bf16
    train step at nanochat's small CPU shape (d4, T=256, vocab 4096) runs ~1.35x an fp32 one instead of ~1.05x."""
    return jnp.float32 if jnp.dtype(dtype) == jnp.bfloat16 and (backend or jax.default_backend()) == "cpu" else dtype


def widened_products(*operands) -> bool:
    """Whether a product of these operands (all bf16) asks XLA for an fp32 result: on a CPU. XLA:CPU's library
    multiplies bf16 into fp32 with the CPU's bf16 instructions (AVX512-BF16, AMX) at up to twice its fp32 rate,
    while a bf16 result takes a path slower than fp32 (upcast operands). Accelerators accumulate bf16 in fp32
    inside their kernels anyway."""
    return jax.default_backend() == "cpu" and all(x.dtype == jnp.bfloat16 for x in operands)


def split_in_two(x, axis: int):
    """x with `axis` (of even length) split into two axes (2, n/2), to contract over both.

    A bf16 product that contracts the leading (row) axis of both operands (a weight gradient) or a stacked
    product of a matrix with its own transpose is one XLA:CPU's bf16 kernels do not take: XLA converts the
    operands and multiplies at the fp32 rate. Contracting over two axes instead, XLA first lays the operand out
    for the library's bf16 kernel (a transposing copy) and the product runs at the bf16 rate. The fused loss's
    lm_head gradient takes the same route in fp32 too (gpt._local_loss_and_grads)."""
    axis = axis % x.ndim
    return x.reshape(*x.shape[:axis], 2, x.shape[axis] // 2, *x.shape[axis + 1:])


def einsum(spec: str, a, b, out_dtype=None):
    """jnp.einsum(spec, a, b) for the model's and optimizer's products; out_dtype defaults to a's dtype.

    bf16 operands on a CPU (see widened_products) multiply into fp32 and round once to out_dtype, and so do
    both gradients (the cotangent is rounded to bf16 first, as in a bf16 backward pass): JAX's own transpose
    of such a product would multiply in fp32. Every other case is plain jnp.einsum. The result equals a bf16
    product's (one rounding of an fp32 accumulation) up to summation order."""
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    if widened_products(a, b):
        return _widened_einsum(spec, out_dtype, a, b)
    return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _widened_einsum(spec, out_dtype, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(out_dtype)


def _widened_einsum_fwd(spec, out_dtype, a, b):
    return _widened_einsum(spec, out_dtype, a, b), (a, b)


def _widened_einsum_bwd(spec, out_dtype, res, g):
    a, b = res
    inputs, out = spec.replace(" ", "").split("->")
    sa, sb = inputs.split(",")
    g = g.astype(a.dtype)
    da = jnp.einsum(f"{out},{sb}->{sa}", g, b, preferred_element_type=jnp.float32).astype(a.dtype)
    db = jnp.einsum(f"{sa},{out}->{sb}", a, g, preferred_element_type=jnp.float32).astype(b.dtype)
    return da, db


_widened_einsum.defvjp(_widened_einsum_fwd, _widened_einsum_bwd)
