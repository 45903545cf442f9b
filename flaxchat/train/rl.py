"""The RL update of scripts.rl (nanochat's chat_rl): group-relative advantages, rollouts as micro-batches, and the
policy-gradient step with DAPO's token-level normalisation.

nanochat calls it "GRPO" in quotes; it is closer to plain REINFORCE: on-policy, so no PPO ratio or clipping and no
KL term to a reference model; a sample's advantage is its reward minus the mean reward of its group (the samples of
one question), not a z-score; the loss is normalised per token, not per sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat import sharding

SEQ_BUCKET = 32  # rollout batches are padded to a multiple of this many tokens: a few shapes, a few compiles


def group_advantages(rewards) -> np.ndarray:
    """Reward minus the group mean (nanochat: no division by the standard deviation). Sums to zero."""
    rewards = np.asarray(rewards, np.float32)
    return rewards - rewards.mean()


def policy_gradient_loss(model, inputs, targets, advantages):
    """-sum(logp * advantage) / valid tokens of this micro-batch: DAPO's token-level normalisation."""
    logp = -model(inputs, targets, loss_reduction="none")  # (B, T), 0 where the target is -1
    num_valid = jnp.maximum(jnp.sum(targets >= 0), 1)
    return -jnp.sum(logp * advantages[:, None]) / num_valid


@nnx.jit(donate_argnums=1)
def add_policy_gradient(model, grads, inputs, targets, advantages):
    """grads + one micro-batch's policy gradient, and its loss."""
    loss, g = nnx.value_and_grad(policy_gradient_loss)(model, inputs, targets, advantages)
    return jax.tree.map(jnp.add, grads, g), loss


_zeros_like = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree))


@nnx.jit(donate_argnums=(0, 1, 2))
def apply_policy_gradient(model, optimizer, grads, passes):
    """One optimizer step on the gradients summed over `passes` micro-batches, averaged."""
    optimizer.update(model, jax.tree.map(lambda g: g / passes, grads))


def rl_step(model, optimizer, batches, mesh=None) -> float:
    """One optimizer step on rollouts: batches is a list of micro-batches (inputs (B, T), targets (B, T),
    advantages (B,)), each as wide as its own rollouts need (rollout_batches); returns the mean loss.

    Each of the P micro-batches is normalised by its own valid-token count and the P gradients and losses are
    averaged, as nanochat divides each pass by (valid tokens x passes). A micro-batch whose advantages are all zero
    (a group whose samples all earned the same reward) has a zero loss and zero gradients, so it runs no pass at all;
    it still counts in P. Each width compiles once (widths are multiples of SEQ_BUCKET). With a mesh, rows are
    split over its data x fsdp devices.
    """
    put = (lambda a: a) if mesh is None else (lambda a: jax.device_put(a, sharding.batch_sharding(mesh, a.ndim)))

    grads, losses = _zeros_like(nnx.state(model, nnx.Param)), []
    for inputs, targets, advantages in batches:
        if np.any(advantages):
            grads, loss = add_policy_gradient(model, grads, put(inputs), put(targets), put(advantages))
            losses.append(loss)
    apply_policy_gradient(model, optimizer, grads, jnp.float32(len(batches)))
    return sum(float(loss) for loss in losses) / len(batches)


def rollout_batches(sequences, masks, advantages, pad_token, device_batch_size, bucket=SEQ_BUCKET):
    """Rollouts (token lists with the Engine's masks) -> micro-batches of device_batch_size rollouts, in order, each
    (inputs (B, T), targets (B, T), advantages (B,)) with T its longest rollout rounded up to `bucket`.

    Targets are -1 where the mask is 0 (prompt, tool outputs, padding), so only sampled tokens are trained. With
    nanochat's group sizes a micro-batch is one question's samples, padded to its own longest, as nanochat pads.
    """
    n = len(sequences)
    if n % device_batch_size:
        raise ValueError(f"{n} rollouts do not split into micro-batches of {device_batch_size}")
    batches = []
    for start in range(0, n, device_batch_size):
        seqs, ms = sequences[start : start + device_batch_size], masks[start : start + device_batch_size]
        width = -(-(max(len(s) for s in seqs) - 1) // bucket) * bucket
        ids = np.full((len(seqs), width + 1), pad_token, np.int32)
        mask = np.zeros((len(seqs), width + 1), np.int32)
        for i, (seq, m) in enumerate(zip(seqs, ms)):
            ids[i, : len(seq)], mask[i, : len(m)] = seq, m
        targets = ids[:, 1:].copy()
        targets[mask[:, 1:] == 0] = -1
        batches.append((ids[:, :-1], targets, np.asarray(advantages[start : start + device_batch_size], np.float32)))
    return batches
