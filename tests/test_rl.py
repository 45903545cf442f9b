"""RL: rewards, group-relative advantages, pass@k, rollout batches, the policy-gradient step, a tiny run."""

import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat.eval.chat import pass_at_k
from flaxchat.train.rl import group_advantages, policy_gradient_loss, rl_step, rollout_batches
from tasks.synthetic_chat import ArithmeticProblems


def test_reward_is_the_exact_final_answer():
    task = ArithmeticProblems(5, "val")
    conversation = task[0]
    answer = conversation["answer"]
    assert task.reward(conversation, f"Some working.\n#### {answer}") == 1.0
    assert task.reward(conversation, f"#### {answer} apples, I think") == 1.0  # words after the number are fine
    assert task.reward(conversation, [{"type": "text", "text": f"#### {answer}"}]) == 1.0  # message parts
    assert task.reward(conversation, f"The answer is {answer}.") == 0.0  # no "####": no answer
    assert task.reward(conversation, f"#### {answer}.0") == 0.0  # exact string after normalisation, as GSM8K
    assert task.reward(conversation, f"#### {int(answer) + 1}\n#### {answer}") == 0.0  # the first "####" counts
    assert task.reward(conversation, "") == 0.0
    assert task.reward(conversation, "####") == 0.0
    big = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "#### 1000"}]}
    assert task.reward(big, "#### 1,000") == 1.0  # thousands separators are dropped
    negative = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "#### -3"}]}
    assert task.reward(negative, "#### -3") == 1.0 and task.reward(negative, "#### 3") == 0.0


def test_advantages_sum_to_zero_per_group():
    rng = np.random.default_rng(0)
    for n in (2, 5, 16):
        rewards = rng.integers(0, 2, n).astype(float)
        adv = group_advantages(rewards)
        assert abs(adv.sum()) < 1e-5
        assert np.allclose(adv, rewards - rewards.mean())  # reward minus the mean, no std scaling
    assert np.all(group_advantages([1, 1, 1, 1]) == 0)  # a group that all agrees teaches nothing
    assert np.allclose(group_advantages([1, 0, 0, 0]), [0.75, -0.25, -0.25, -0.25])


def test_pass_at_k_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_rollout_batches_train_only_sampled_tokens():
    # prompt of 3 (mask 0), then sampled (1), forced tool output (0), sampled (1)
    seqs = [[1, 2, 3, 10, 11, 12, 13], [1, 2, 3, 20]]
    masks = [[0, 0, 0, 1, 0, 0, 1], [0, 0, 0, 1]]
    ((inputs, targets, adv),) = rollout_batches(seqs, masks, [0.5, -0.5], pad_token=99, device_batch_size=2, bucket=4)
    assert inputs.shape == targets.shape == (2, 8) and adv.tolist() == [0.5, -0.5]
    assert targets[0].tolist() == [-1, -1, 10, -1, -1, 13, -1, -1]
    assert targets[1].tolist() == [-1, -1, 20, -1, -1, -1, -1, -1]
    assert inputs[1].tolist() == [1, 2, 3, 20, 99, 99, 99, 99]
    with pytest.raises(ValueError, match="micro-batches"):
        rollout_batches(seqs, masks, [0, 0], 99, device_batch_size=3)
    # a micro-batch is as wide as its own longest rollout needs, rounded up to the bucket
    first, second = rollout_batches(seqs, masks, [0.5, -0.5], pad_token=99, device_batch_size=1, bucket=2)
    assert first[0].shape == (1, 6) and second[0].shape == (1, 4)
    assert second[1].tolist() == [[-1, -1, 20, -1]] and second[2].tolist() == [-0.5]


@pytest.mark.slow
def test_rl_step_moves_policy_toward_rewarded_samples():
    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT
    from flaxchat.train.optim import build_optimizer

    model = GPT(GPTConfig.from_depth(2, 32, 32, 64, "L", 64), rngs=nnx.Rngs(0))
    optimizer = build_optimizer(model)
    optimizer.opt_state.hyperparams["lr_multiplier"][...] = 0.2
    prompt, good, bad = [0, 5, 6, 7], [8, 9, 10], [11, 12, 13]

    def logp(completion):
        x = jnp.asarray([prompt + completion[:-1]])
        y = jnp.asarray([[-1] * (len(prompt) - 1) + completion])
        return -float(model(x, y, loss_reduction="sum"))

    # a mock reward: 1 for the "good" answer, 0 for the "bad" one; a group of two of each
    seqs = [prompt + good, prompt + bad, prompt + good, prompt + bad]
    masks = [[0] * len(prompt) + [1] * 3] * 4
    adv = group_advantages([1.0, 0.0, 1.0, 0.0])
    gap0 = logp(good) - logp(bad)
    for _ in range(3):
        loss = rl_step(model, optimizer, rollout_batches(seqs, masks, adv, pad_token=0, device_batch_size=2, bucket=8))
        assert np.isfinite(loss)
    gap = logp(good) - logp(bad)
    assert gap > gap0 + 1.0, (gap0, gap)

    # a group whose samples all got the same reward has zero advantages, so its policy gradient is exactly zero
    inputs, targets, a = rollout_batches(seqs, masks, group_advantages([1.0] * 4), 0, 2, bucket=8)[0]
    grads = nnx.grad(policy_gradient_loss)(model, jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(a))
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads))


@pytest.mark.slow
def test_rl_step_skips_zero_advantage_batches_with_the_same_update(monkeypatch):
    """rl_step runs no pass over micro-batches of all-zero advantages and gives each micro-batch its own width, yet
    its gradient and loss are those of computing every micro-batch and averaging over all of them (nanochat's
    passes), on one device and on the 8-device mesh. Plain SGD, so that the step moves the weights by that gradient
    times the rate (a large rate, so that the move dwarfs the weights' rounding)."""
    import optax

    import flaxchat.train.rl as rl
    from flaxchat import sharding
    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT

    def make():  # weights moved off nanochat's init (zero projections), so that every one has a gradient
        model = GPT(GPTConfig.from_depth(2, 32, 32, 64, "L", 64), rngs=nnx.Rngs(0))
        params = nnx.state(model, nnx.Param)
        keys = jax.random.split(jax.random.key(1), len(jax.tree.leaves(params)))
        noisy = [p + 0.05 * jax.random.normal(k, p.shape, p.dtype) for p, k in zip(jax.tree.leaves(params), keys)]
        nnx.update(model, jax.tree.unflatten(jax.tree.structure(params), noisy))
        return model

    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(6, 14, size=8), rng.integers(6, 30, size=16)])
    seqs = [list(rng.integers(1, 64, size=int(n))) for n in lengths]
    masks = [[0] * 3 + [1] * (len(s) - 3) for s in seqs]
    # three micro-batches of eight: mixed rewards, all 1, all 0; the last two have zero advantages
    adv = np.concatenate([group_advantages(r) for r in ([1.0, 0.0] * 4, [1.0] * 8, [0.0] * 8)])
    batches = rollout_batches(seqs, masks, adv, pad_token=0, device_batch_size=8, bucket=8)
    assert [np.any(b[2]) for b in batches] == [True, False, False]

    # the reference: every micro-batch padded to the longest rollout of all, every pass computed, as nanochat does
    width = max(b[0].shape[1] for b in batches)
    wide = [
        tuple(np.pad(x, [(0, 0), (0, width - x.shape[1])], constant_values=c) for x, c in ((i, 0), (t, -1)))
        for i, t, _ in batches
    ]
    assert batches[0][0].shape[1] < width  # the first micro-batch is narrower than the longest
    model = make()
    before = [np.asarray(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]
    grad = nnx.jit(nnx.value_and_grad(policy_gradient_loss))
    losses, grads = [], None
    for (inputs, targets), (_, _, a) in zip(wide, batches):
        lp, g = grad(model, jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(a))
        losses.append(float(lp))
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    assert losses[1:] == [0.0, 0.0]
    want = [np.asarray(g) / 3 for g in jax.tree.leaves(grads)]
    assert all(np.abs(g).max() > 0 for g in want)
    atol = 1e-5 * max(np.abs(g).max() for g in want)  # a scalar's gradient sums terms that nearly cancel

    passes = []
    add = rl.add_policy_gradient
    monkeypatch.setattr(rl, "add_policy_gradient", lambda *a: passes.append(a[2].shape) or add(*a))
    mesh = sharding.make_mesh(8, 1, 1)
    for on_mesh in (False, True):
        passes.clear()
        model = sharding.create_sharded(make, mesh) if on_mesh else make()
        optimizer = nnx.Optimizer(model, optax.sgd(1e3), wrt=nnx.Param)
        with jax.set_mesh(mesh) if on_mesh else contextlib.nullcontext():
            loss = rl_step(model, optimizer, batches, mesh if on_mesh else None)
        assert loss == pytest.approx(np.mean(losses), rel=1e-6)
        assert passes == [batches[0][0].shape]  # one pass, at the first micro-batch's own width
        after = jax.tree.leaves(nnx.state(model, nnx.Param))
        for b, p, g in zip(before, after, want):
            np.testing.assert_allclose((b - np.asarray(p)) / 1e3, g, rtol=1e-4, atol=atol, err_msg=f"mesh: {on_mesh}")


def save_tiny_sft(base_dir, tag="d2"):
    from flaxchat.data.tokenizer import get_tokenizer
    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT
    from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir

    # context 128: a generated question (~70 tokens with the tests' 512-token vocabulary) plus an answer must fit
    model = GPT(GPTConfig.from_depth(2, 32, 32, 128, "L", get_tokenizer().get_vocab_size()), rngs=nnx.Rngs(0))
    ckpt = Checkpointer(checkpoint_dir("sft", tag, str(base_dir)), async_save=False)
    ckpt.save(5, model, meta={"val_bpb": 1.0}, metrics={"val_bpb": 1.0})
    ckpt.close()


def test_rollouts_of_several_questions_share_a_batch(tiny_base_dir):
    """sample_groups and the pass@k eval put several questions in one Engine batch (at most `rows` rollouts,
    at least one question), and each question's samples are those a call of its own draws."""
    from flaxchat.data.tokenizer import get_tokenizer
    from flaxchat.eval.chat import evaluate_pass_at_k, sample_groups
    from flaxchat.generate.engine import Engine
    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT

    tokenizer = get_tokenizer()
    model = GPT(GPTConfig.from_depth(2, 32, 32, 128, "L", tokenizer.get_vocab_size()), rngs=nnx.Rngs(0))
    task = ArithmeticProblems(5, "val")
    conversations, seeds = [task[i] for i in range(5)], [11, 12, 13, 14, 15]
    engine = Engine(model, tokenizer)
    calls = []
    batches = engine.generate_batches
    engine.generate_batches = lambda prompts, *a, **k: calls.append(len(prompts)) or batches(prompts, *a, **k)
    sampling = dict(max_tokens=6, temperature=1.0, top_k=50)
    groups = sample_groups(engine, tokenizer, task, conversations, seeds, 4, 8, **sampling)
    assert calls == [2, 2, 1]  # 8 rows: two questions of 4 samples a batch
    for conversation, seed, (sequences, masks, rewards) in zip(conversations, seeds, groups):
        prompt = tokenizer.render_for_completion(conversation)
        assert (sequences, masks) == batches([prompt], 4, seeds=[seed], **sampling)[0]
        assert len(rewards) == 4
    calls.clear()
    sample_groups(engine, tokenizer, task, conversations[:2], seeds[:2], 4, 2, **sampling)
    assert calls == [1, 1]  # fewer rows than a group: one question a batch
    calls.clear()
    wide = evaluate_pass_at_k(engine, tokenizer, task, 5, 2, 6, 1.0, 50, seed=3, rows=64)
    assert calls == [5]
    assert (
        evaluate_pass_at_k(engine, tokenizer, task, 5, 2, 6, 1.0, 50, seed=3, rows=2) == wide and calls[1:] == [1] * 5
    )


@pytest.mark.slow
def test_tiny_rl_run_writes_metrics_and_checkpoints(tiny_base_dir):
    from flaxchat.train.checkpoint import load_model
    from scripts.rl import main

    save_tiny_sft(tiny_base_dir)
    out = main(
        [
            "--task",
            "arithmetic",
            "--train-size",
            "16",
            "--eval-size",
            "4",
            "--num-steps",
            "2",
            "--examples-per-step",
            "2",
            "--num-samples",
            "8",
            "--device-batch-size",
            "8",
            "--max-new-tokens",
            "6",
            "--eval-every",
            "2",
            "--eval-examples",
            "2",
            "--eval-samples",
            "2",
            "--save-every",
            "1",
            "--eval-greedy",
            "1",
        ]
    )
    rows = [json.loads(line) for line in open(tiny_base_dir / "chatrl_checkpoints" / "d2" / "metrics.jsonl")]
    train_rows = [r for r in rows if "reward" in r]
    assert [r["step"] for r in train_rows] == [1, 2] and all(0 <= r["reward"] <= 1 for r in train_rows)
    assert train_rows[0]["lrm"] == 1.0 and train_rows[1]["lrm"] == 0.5
    evals = [r for r in rows if "pass@1" in r]
    assert [r["step"] for r in evals] == [0, 2] and all("pass@2" in r and "greedy@1" in r for r in evals)
    assert out["first"]["step"] == 0 and (tiny_base_dir / "chatrl_checkpoints" / "d2" / "rl.png").exists()
    model, _, meta = load_model("rl", "d2")
    assert meta["step"] == 2 and meta["task"] == "arithmetic" and meta["source"]["step"] == 5


def test_bad_flags_are_one_line_errors(tiny_base_dir, capsys):
    from scripts.rl import main

    with pytest.raises(SystemExit, match="no sft checkpoints"):
        main(["--task", "arithmetic"])
    for argv, message in [
        (["--num-samples", "12", "--device-batch-size", "8"], "multiple of --device-batch-size"),
        (["--num-samples", "1", "--device-batch-size", "1"], "at least 2"),
        (["--sample-rows", "-1"], "--sample-rows must be 0 (auto) or positive"),
    ]:
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err
