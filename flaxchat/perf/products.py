"""The matrix products of a training step, each timed alone: how much of the step its products are.

`bench --what train --products` reads the train step's jaxpr, times every dot_general of it as XLA compiles it on
its own (the fastest of a few calls, the rate XLA's kernel reaches on that shape), and sums them times how often
the step runs each. Beside the step's time this says how much of it goes to products and how much to the rest
(elementwise passes, copies, reductions, overlap), and which lines of the program make the slow ones.
"""

from __future__ import annotations

import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import source_info_util

from flaxchat.perf.hlo import jaxpr_equations, source_line
from flaxchat.train.step import train_step


def equation_source(eqn) -> str:
    """Where a jaxpr equation came from, named as hlo.source_line names a compiled op's: "flaxchat/model/gpt.py:165
    Linear.multiply (transpose(jvp()))" (file, line, function, then the transformations it was made under)."""
    where = source_info_util.summarize(eqn.source_info)
    m = re.match(r"(.*):(\d+):\d+ \((.*)\)$", where)
    where = source_line(*m.groups()) if m else where
    stack = str(eqn.source_info.name_stack)
    return f"{where} ({stack})" if stack else where


def einsum_spec(lhs_ndim: int, rhs_ndim: int, dimension_numbers) -> str:
    """A dot_general's dimension numbers as an einsum spec: ((1,), (0,)), ((), ()) on 2-d operands -> "ab,bc->ac"."""
    (lc, rc), (lb, rb) = dimension_numbers
    partner = dict(zip((*lb, *lc), (*rb, *rc)))
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    lhs, rhs = [next(letters) for _ in range(lhs_ndim)], [None] * rhs_ndim
    for i, j in partner.items():
        rhs[j] = lhs[i]
    rhs = [x or next(letters) for x in rhs]
    out = [lhs[i] for i in lb] + [x for i, x in enumerate(lhs) if i not in partner]
    out += [x for j, x in enumerate(rhs) if j not in (*rb, *rc)]
    return f"{''.join(lhs)},{''.join(rhs)}->{''.join(out)}"


def dot_products(jaxpr):
    """(equation, executions per call) for every dot_general in jaxpr and the jaxprs inside it."""
    return ((eqn, n) for eqn, n in jaxpr_equations(jaxpr) if eqn.primitive.name == "dot_general")


def time_product(lhs, rhs, params, repeats: int, rng) -> tuple[float, int]:
    """(seconds, FLOPs) of one dot_general of these operand types and params, compiled and run alone: the fastest
    of `repeats` calls, the rate XLA's kernel reaches on that shape. Not the median: on a small shared VM the same
    product's calls come in runs of fast and slow ones (about twice as long), so a median of a few calls lands
    anywhere between the two, while the fastest of many repeats itself."""
    a, b = (jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in (lhs, rhs))
    product = jax.jit(
        lambda a, b: jax.lax.dot_general(
            a, b, params["dimension_numbers"], preferred_element_type=params["preferred_element_type"]
        )
    )
    out = product(a, b).block_until_ready()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        product(a, b).block_until_ready()
        samples.append(time.perf_counter() - t0)
    contracted = math.prod(lhs.shape[i] for i in params["dimension_numbers"][0][0])
    return min(samples), 2 * math.prod(out.shape) * contracted


def product_census(model, optimizer, batch, mesh, repeats: int = 10) -> dict:
    """Every matrix product of the train step (its dot_generals: forward, backward, loss, optimizer), each
    timed alone as XLA compiles it on its own (the fastest of `repeats` calls), times how often the step runs it.

    Their sum is how long the step's products take one after another at the rates XLA's kernels reach on
    those shapes in isolation; beside the step's time it says how much of the step the products are (the rest:
    elementwise passes, copies, reductions, overlap). One device: on a mesh the partitioner's products and Muon's
    shared-out stacks are not the jaxpr's."""
    graphdef, state = nnx.split((model, optimizer))

    def step(state, xs, ys):
        return train_step(*nnx.merge(graphdef, state), xs, ys)

    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(step)(state, *batch).jaxpr
    timed, groups = {}, {}
    rng = np.random.default_rng(0)
    for eqn, n in dot_products(jaxpr):
        lhs, rhs = (v.aval for v in eqn.invars)
        key = (
            lhs.shape,
            lhs.dtype,
            rhs.shape,
            rhs.dtype,
            eqn.params["dimension_numbers"],
            eqn.params["preferred_element_type"],
        )
        if key not in timed:
            timed[key] = time_product(lhs, rhs, eqn.params, repeats, rng)
        spec = einsum_spec(lhs.ndim, rhs.ndim, key[4])
        group = groups.setdefault((equation_source(eqn), spec, lhs.shape, rhs.shape), [0, 0.0, 0])
        group[0] += n
        group[1] += n * timed[key][0]
        group[2] += n * timed[key][1]
    alone = sum(g[1] for g in groups.values())
    flops = sum(g[2] for g in groups.values())
    top = sorted(groups.items(), key=lambda kv: -kv[1][1])[:12]
    # by the line of the program that made them (forward and backward together): where products run slow
    lines = {}
    for (src, *_), (n, s, f) in groups.items():
        line = lines.setdefault(src.split(" (")[0], [0, 0.0, 0])
        line[0] += n
        line[1] += s
        line[2] += f
    return {
        "calls": sum(g[0] for g in groups.values()),
        "distinct": len(timed),
        "gflop": flops / 1e9,
        "alone_s": alone,
        "flops_per_s": flops / alone,
        "top": [
            {
                "source": src,
                "spec": spec,
                "lhs": list(a),
                "rhs": list(b),
                "calls": n,
                "ms": 1e3 * s,
                "gflops": f / s / 1e9,
            }
            for (src, spec, a, b), (n, s, f) in top
        ],
        "by_line": [
            {"source": src, "calls": n, "gflop": f / 1e9, "ms": 1e3 * s, "gflops": f / s / 1e9}
            for src, (n, s, f) in sorted(lines.items(), key=lambda kv: -kv[1][1])
        ],
    }


def format_census(census: dict, step_s: float) -> str:
    """product_census's record as lines for stderr: the total beside the step's time, the slowest products, and
    every line of the program's products with their time and rate."""
    lines = [
        f"the step's {census['calls']} products ({census['distinct']} distinct shapes), each timed alone: "
        f"{1e3 * census['alone_s']:.1f} ms of the {1e3 * step_s:.1f} ms step "
        f"({100 * census['alone_s'] / step_s:.0f}%), {census['flops_per_s'] / 1e9:.0f} GFLOP/s"
    ]
    lines += [
        f"  {p['ms']:9.2f} ms  {p['gflops']:6.0f} GFLOP/s  x{p['calls']:<4} {p['spec']} {tuple(p['lhs'])} "
        f"{tuple(p['rhs'])} <- {p['source']}"
        for p in census["top"]
    ]
    lines.append("by line of the program (forward and backward together):")
    lines += [
        f"  {p['ms']:9.2f} ms  {p['gflops']:6.0f} GFLOP/s  {p['gflop']:7.2f} GFLOP  x{p['calls']:<5} {p['source']}"
        for p in census["by_line"]
    ]
    return "\n".join(lines)
