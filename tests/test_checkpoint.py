import json
import os
import signal
import socket
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


def test_the_demos_models_are_found_and_named(tmp_path, tiny_base_dir):
    """The laptop demo keeps its checkpoints in <base dir>/tinystories: find_model (the chat scripts') picks the
    newer of the base dir's and the demo's; find_model_tag (everyone's) reads the base dir only and, finding
    nothing there, says where the demo's are."""
    import os

    from flaxchat.common import get_base_dir
    from flaxchat.train.checkpoint import find_model

    base = get_base_dir()
    demo = os.path.join(base, "tinystories")
    cfg = GPTConfig(sequence_len=32, vocab_size=300, n_layer=1, n_head=1, n_kv_head=1, n_embd=16)
    with pytest.raises(FileNotFoundError, match="no sft checkpoints") as nothing:
        find_model("sft")
    assert "laptop demo" not in str(nothing.value)  # no demo either: nothing to point to
    ckpt = Checkpointer(checkpoint_dir("sft", "demo-d4", demo), async_save=False)
    ckpt.save(400, GPT(cfg, rngs=nnx.Rngs(0)))
    ckpt.close()
    assert find_model("sft") == (demo, "demo-d4", [demo])
    with pytest.raises(FileNotFoundError, match=f"the laptop demo's are in {demo}: run with FLAXCHAT_BASE_DIR={demo}"):
        find_model_tag("sft")
    os.utime(os.path.join(checkpoint_dir("sft", "demo-d4", demo), "400"), (1, 1))  # saved long ago
    ckpt = Checkpointer(checkpoint_dir("sft", "d2"), async_save=False)
    ckpt.save(7, GPT(cfg, rngs=nnx.Rngs(1)))
    ckpt.close()
    assert find_model("sft") == (base, "d2", [base, demo])  # the newer
    assert find_model("sft", "demo-d4") == (demo, "demo-d4", [demo])  # a tag only the demo has
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        find_model("sft", "d9")


REPLACER = textwrap.dedent("""
    import os, signal, sys, time
    from flax import nnx
    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT
    from flaxchat.train.checkpoint import Checkpointer
    cfg = GPTConfig(sequence_len=32, vocab_size=32768, n_layer=2, n_head=2, n_kv_head=2, n_embd=256)
    ckpt = Checkpointer(sys.argv[1], keep_best=0)
    ckpt.replace_earlier_run()            # a fresh run under a tag that holds an earlier run's checkpoints
    ckpt.save(1, GPT(cfg, rngs=nnx.Rngs(7)), meta={"run": "new"})  # async: killed while it is written
    time.sleep(float(sys.argv[2]))
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_a_rerun_killed_during_its_first_save_leaves_the_earlier_checkpoints(tmp_path, delay, xla_flags):
    """The earlier run's checkpoints move aside before the new run's first save and come back if that save never
    completes; once it has completed, the earlier ones are gone and the new one is what loads."""
    run = str(tmp_path / "base_checkpoints" / "d2")
    cfg = GPTConfig(sequence_len=32, vocab_size=32768, n_layer=2, n_head=2, n_kv_head=2, n_embd=256)
    earlier = Checkpointer(run, keep=3, keep_best=0, async_save=False)
    for step in (5, 9):
        earlier.save(step, GPT(cfg, rngs=nnx.Rngs(step)), meta={"run": "old"})
    earlier.close()
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": xla_flags(1)}
    proc = subprocess.run(
        [sys.executable, "-c", REPLACER, run, str(delay)], env=env, cwd=ROOT, capture_output=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    ckpt = Checkpointer(run, async_save=False)  # the next writer (or reader) of the tag settles what was left
    steps = ckpt.all_steps()
    assert not os.path.exists(ckpt.aside)
    if steps == [5, 9]:  # killed before the first save completed: the earlier run is back, whole
        model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
        assert ckpt.restore(model)["meta"]["run"] == "old"
        assert same_params(model, GPT(cfg, rngs=nnx.Rngs(9)))
    else:  # the first save completed before the kill: it replaces the earlier run
        assert steps == [1]
        assert ckpt.read_meta()["run"] == "new"
    ckpt.close()


def test_replacing_an_earlier_run_deletes_it_only_after_the_first_save(tmp_path):
    run = str(tmp_path / "run")
    model = GPT(CFG, rngs=nnx.Rngs(0))
    ckpt = Checkpointer(run, keep=3, keep_best=0, async_save=False)
    ckpt.save(5, model)
    ckpt.replace_earlier_run()
    assert ckpt.all_steps() == [] and "5" in os.listdir(ckpt.aside)
    # a reader while this (live) run has not saved yet leaves the earlier checkpoints where they are
    assert Checkpointer(run, async_save=False).all_steps() == [] and os.path.isdir(ckpt.aside)
    ckpt.save(2, model)
    ckpt.wait()
    assert ckpt.all_steps() == [2] and not os.path.exists(ckpt.aside)
    ckpt.close()


def test_a_reader_leaves_a_running_replacement_alone(tmp_path):
    """The set-aside checkpoints belong to the run that moved them while that process lives (its first save may be
    under way); a reader in another process puts them back only once it is gone."""
    run = str(tmp_path / "run")
    ckpt = Checkpointer(run, keep=3, keep_best=0, async_save=False)
    ckpt.save(5, GPT(CFG, rngs=nnx.Rngs(0)))
    ckpt.replace_earlier_run()
    owner = os.path.join(ckpt.aside, "owner.json")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open(owner, "w", encoding="utf-8") as f:
            json.dump({"host": socket.gethostname(), "pid": sleeper.pid}, f)
        assert Checkpointer(run, async_save=False).all_steps() == []  # still the live run's
    finally:
        sleeper.kill()
        sleeper.wait()
    assert Checkpointer(run, async_save=False).all_steps() == [5]  # its owner died before saving: put back
    assert not os.path.exists(ckpt.aside)


@pytest.mark.parametrize("tag", ["../other", "/abs/path", "a/b", ".hidden", "", "x" * 101, "d4/../../x"])
def test_tags_are_plain_names(tmp_path, tag):
    with pytest.raises(ValueError, match="plain name"):
        checkpoint_dir("base", tag, base_dir=str(tmp_path))
    assert not os.listdir(tmp_path)


def test_a_bad_tag_on_the_command_line_is_one_usage_line(tmp_path):
    env = {**os.environ, "FLAXCHAT_BASE_DIR": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "scripts.sft", "--model-tag", "../../etc"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "--model-tag" in r.stderr and "plain name" in r.stderr
    assert "Traceback" not in r.stderr and not os.listdir(tmp_path)


def test_loading_a_tag_that_does_not_exist_creates_nothing(tmp_path, tiny_base_dir):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_model("base", "nosuch")
    assert not os.path.exists(checkpoint_dir("base", "nosuch"))
