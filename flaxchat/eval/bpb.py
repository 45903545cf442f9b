"""Bits per byte: the tokenizer-independent validation metric (nanochat's definition).

Sum the loss over every target token that stands for real bytes, sum those bytes, divide, convert nats to bits.
Special tokens (token_bytes == 0) and ignored targets (-1) count for neither sum, so vocabularies of different
sizes compare apples to apples.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat.common import is_main_process, progress_bar
from flaxchat.model.cpu import in_sub_batches


def token_losses(model, inputs, targets):
    """Per-token losses (B, T), 0 where the target is ignored; on a CPU in sub-batches of rows
    (cpu.in_sub_batches)."""
    return in_sub_batches(model, lambda m, x, y: m(x, y, loss_reduction="none"), inputs, targets)


@nnx.jit
def _nats_and_bytes(model, inputs, targets, token_bytes):
    losses = token_losses(model, inputs, targets)
    valid = targets >= 0
    nbytes = jnp.where(valid, token_bytes[jnp.maximum(targets, 0)], 0)
    nats = jnp.sum(jnp.where(nbytes > 0, losses, 0.0))
    return nats, jnp.sum(nbytes)


def evaluate_bpb(model, batches, steps: int, token_bytes, progress: bool = False) -> float:
    """bpb over `steps` batches of (inputs, targets) from `batches`; inf if no byte was counted.

    Batches may be sharded global arrays; the sums are global, so every process gets the same number.
    """
    token_bytes = jnp.asarray(np.asarray(token_bytes), jnp.int32)
    total_nats, total_bytes = 0.0, 0
    it = iter(batches)
    for _ in progress_bar(range(steps), desc="val bpb", disable=not (progress and is_main_process()), leave=False):
        inputs, targets = next(it)
        nats, nbytes = _nats_and_bytes(model, inputs, targets, token_bytes)
        total_nats += float(nats)  # summed on host in float64, as nanochat sums on device in fp32/int64
        total_bytes += int(nbytes)
    if total_bytes == 0:
        return float("inf")
    return total_nats / (math.log(2) * total_bytes)
