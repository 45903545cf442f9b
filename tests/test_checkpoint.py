import os
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from flaxchat import sharding
from flaxchat.export.nanochat import to_nanochat_state_dict
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT
from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir, find_model_tag, load_model

CFG = GPTConfig(sequence_len=32, vocab_size=128, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def same_params(a, b):
    sa, sb = to_nanochat_state_dict(a), to_nanochat_state_dict(b)
    return all(np.array_equal(sa[k], sb[k]) for k in sa)


def test_round_trip_model_optimizer_data_meta(tmp_path):
    model = GPT(CFG, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    grads = jax.tree.map(lambda x: x * 0 + 1.0, nnx.state(model, nnx.Param))
    opt.update(model, grads)
    ckpt = Checkpointer(str(tmp_path / "run"))
    ckpt.save(7, model, opt, data_state={"pos": 42}, meta={"note": "hello"})
    ckpt.wait()
    m2 = nnx.eval_shape(lambda: GPT(CFG, rngs=nnx.Rngs(1)))  # abstract: nothing allocated before restore
    o2 = nnx.eval_shape(lambda: nnx.Optimizer(GPT(CFG, rngs=nnx.Rngs(1)), optax.adam(1e-2), wrt=nnx.Param))
    info = ckpt.restore(m2, o2)
    ckpt.close()
    assert info["step"] == 7 and info["data_states"] == [{"pos": 42}]
    assert info["meta"]["note"] == "hello" and info["meta"]["model_config"] == CFG.to_dict()
    assert same_params(model, m2)
    for a, b in zip(jax.tree.leaves(nnx.state(opt)), jax.tree.leaves(nnx.state(o2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.eight_devices
def test_restore_onto_a_different_mesh(tmp_path):
    saved = sharding.create_sharded(lambda: GPT(CFG, rngs=nnx.Rngs(3)), sharding.make_mesh(data=8))
    ckpt = Checkpointer(str(tmp_path / "run"), async_save=False)
    ckpt.save(1, saved)
    target_mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
    restored = nnx.eval_shape(lambda: GPT(CFG, rngs=nnx.Rngs(0)))
    ckpt.restore(restored, mesh=target_mesh)
    ckpt.close()
    w = restored.transformer.h[0].mlp.c_fc.weight[...]
    assert w.sharding.mesh.shape == target_mesh.shape
    assert w.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    assert same_params(saved, restored)


def test_keeps_last_n_and_best(tmp_path):
    model = GPT(CFG, rngs=nnx.Rngs(0))
    ckpt = Checkpointer(str(tmp_path / "run"), keep=2, keep_best=1, async_save=False)
    for step, bpb in [(1, 2.0), (2, 1.0), (3, 1.5), (4, 1.6), (5, 1.7)]:
        ckpt.save(step, model, metrics={"val_bpb": bpb})
    assert sorted(ckpt.all_steps()) == [2, 4, 5]
    with pytest.raises(FileNotFoundError, match="step 3"):
        ckpt.read_meta(3)
    ckpt.close()


KILLER = textwrap.dedent("""
    import os, signal, sys, time
    import jax.numpy as jnp
    from flax import nnx
    from flaxchat.train.checkpoint import Checkpointer
    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT
    cfg = GPTConfig(sequence_len=32, vocab_size=32768, n_layer=2, n_head=2, n_kv_head=2, n_embd=256)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    ckpt = Checkpointer(sys.argv[1], keep=5)
    ckpt.save(1, model, meta={"ok": 1})
    ckpt.wait()
    model.lm_head.weight[...] = model.lm_head.weight[...] + 1.0
    ckpt.save(2, model, meta={"ok": 2})   # async: returns while the write is in flight
    time.sleep(float(sys.argv[2]))
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3])
def test_a_save_killed_at_any_moment_never_loads_half_written(tmp_path, delay, xla_flags):
    """SIGKILL while step 2 is being written: whatever is on disk is either absent or complete."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": xla_flags(1)}
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, str(run), str(delay)], env=env, cwd=ROOT, capture_output=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    ckpt = Checkpointer(str(run))
    steps = ckpt.all_steps()
    assert 1 in steps
    cfg = GPTConfig(sequence_len=32, vocab_size=32768, n_layer=2, n_head=2, n_kv_head=2, n_embd=256)
    for step in steps:  # every checkpoint that is listed restores completely, with its own values
        model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(5)))
        info = ckpt.restore(model, step=step)
        assert info["meta"]["ok"] == step
        fresh = GPT(cfg, rngs=nnx.Rngs(0))
        expected = np.asarray(fresh.lm_head.weight[...]) + (1.0 if step == 2 else 0.0)
        np.testing.assert_array_equal(np.asarray(model.lm_head.weight[...]), expected)
    ckpt.close()


def test_load_model_and_errors(tmp_path, tiny_base_dir):
    with pytest.raises(FileNotFoundError, match="scripts.pretrain"):
        find_model_tag("base")
    with pytest.raises(ValueError, match="phase"):
        checkpoint_dir("nope", "d2")
    from flaxchat.data.tokenizer import get_tokenizer

    cfg = GPTConfig(
        sequence_len=32, vocab_size=get_tokenizer().get_vocab_size(), n_layer=2, n_head=2, n_kv_head=2, n_embd=64
    )
    for tag, seed in [("d2", 0), ("d10", 1)]:
        ckpt = Checkpointer(checkpoint_dir("base", tag), async_save=False)
        ckpt.save(3, GPT(cfg, rngs=nnx.Rngs(seed)))
        ckpt.close()
    assert find_model_tag("base") == "d10"  # numeric depth order, not string order
    model, tok, meta = load_model("base")
    assert same_params(model, GPT(cfg, rngs=nnx.Rngs(1))) and meta["step"] == 3
    with pytest.raises(FileNotFoundError, match="step 9"):
        load_model("base", "d2", step=9)
