"""LoRA (flaxchat.model.lora through qwix) and your own chat JSONL (tasks.customjson) in scripts.sft.

Invariants: a fresh adapter (B = 0) is the base model; merged weights are the adapted model; only adapters
train; a resumed LoRA run is the uninterrupted run; the adapter checkpoint is small and loads as the merged
model; a bad JSONL line is one sentence naming file and line, before any training.
"""

import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:qwix")  # qwix 0.1.8 reads Variable.value

LORA_TINY = [
    "--mixture",
    "offline",
    "--mc-epochs",
    "0",
    "--identity-size",
    "100",
    "--arithmetic-size",
    "60",
    "--story-size",
    "0",
    "--spelling-size",
    "0",
    "--val-size",
    "8",
    "--device-batch-size",
    "2",
    "--total-batch-size",
    "2048",
    "--eval-tokens",
    "1024",
    "--eval-every",
    "-1",
    "--chatcore-every",
    "-1",
    "--reply-check",
    "0",
    "--lora-rank",
    "4",
    "--lora-full",
    "none",
]  # adapters alone


VOCAB = 512  # the tiny tokenizer's (tests/conftest.py): every model here has the same shapes, compiled once


def tiny_model(seed=0):
    return GPT(GPTConfig.from_depth(2, 32, 32, 64, "L", VOCAB), rngs=nnx.Rngs(seed))


def tokens(seed=0, shape=(2, 64)):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, shape), jnp.int32)


@nnx.jit
def forward(model, x):
    return model(x)


def write_chats(path, n=30, bad_line=None):
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "Answer with a number."},
                    {"role": "user", "content": f"What is {i} plus one?"},
                    {"role": "assistant", "content": f"{i + 1}."},
                ]
            }
        )
        for i in range(n)
    ]
    if bad_line is not None:
        lines[bad_line - 1] = '{"messages": [{"role": "user", "content": "hi"}'  # cut short
    path.write_text("\n".join(lines) + "\n")
    return path


# -----------------------------------------------------------------------------
# The adapters themselves


def test_fresh_adapters_are_the_base_and_merging_is_exact():
    from flaxchat.model.lora import LoraConfig, adapter_modules, apply_lora, count_params, merge_lora, target_paths

    model, x = tiny_model(), tokens()
    config = LoraConfig(rank=4, alpha=8.0)
    lora = apply_lora(model, config)
    assert len(adapter_modules(lora)) == 2 * 6  # c_q, c_k, c_v, attn c_proj, c_fc, mlp c_proj per layer
    base_logits = forward(model, x)
    # B = 0: the same logits (up to float rounding: XLA fuses the two programs differently)
    np.testing.assert_allclose(forward(lora, x), base_logits, atol=1e-6, rtol=0)
    assert count_params(lora, nnx.LoRAParam) == 2 * 4 * (4 * (64 + 64) + 2 * (64 + 256))  # layers x r x (in + out)

    for i, (_, m) in enumerate(adapter_modules(lora)):
        m.weight_lora_b.set_value(0.3 * jax.random.normal(jax.random.key(i), m.weight_lora_b.shape))
    adapted = forward(lora, x)
    assert float(jnp.max(jnp.abs(adapted - base_logits))) > 1e-3
    merged = merge_lora(lora, config)
    assert type(merged) is GPT and count_params(merged) == count_params(model)
    np.testing.assert_allclose(forward(merged, x), adapted, atol=2e-5)

    assert len(target_paths(model, "c_q,c_v")) == 4
    assert target_paths(model, r"transformer/h/1/mlp/.*") == ["transformer/h/1/mlp/c_fc", "transformer/h/1/mlp/c_proj"]
    with pytest.raises(ValueError, match="matches no block matrix"):
        target_paths(model, "lm_head")


def test_only_the_adapters_and_the_full_parameters_train():
    from flaxchat.model.lora import LoraConfig, apply_lora
    from flaxchat.train.optim import build_lora_optimizer
    from flaxchat.train.step import train_step

    config = LoraConfig(rank=4, alpha=8.0, full=("lm_head",))  # sft's default: the lm_head trains in full too
    lora = apply_lora(tiny_model(), config)
    optimizer = build_lora_optimizer(lora, 1e-2, config)
    frozen = nnx.All(nnx.Param, nnx.Not(config.trainable()))
    snapshot = lambda what: jax.tree.leaves(jax.tree.map(np.array, nnx.state(lora, what)))
    base, trained = snapshot(frozen), snapshot(config.trainable())
    assert len(trained) == 2 * 6 * 2 + 1  # A and B of 12 matrices, the lm_head
    x = tokens(1)
    losses = [float(train_step(lora, optimizer, (x,), (x,))) for _ in range(3)]
    assert losses[-1] < losses[0]
    assert all(np.array_equal(a, b) for a, b in zip(base, snapshot(frozen)))  # the base is frozen, bit for bit
    assert not any(np.array_equal(a, b) for a, b in zip(trained, snapshot(config.trainable())))  # all else moved
    # AdamW keeps two moments per trained weight and nothing for the frozen ones
    moments = sum(x.size for x in jax.tree.leaves(nnx.state(optimizer, nnx.OptState)) if x.ndim == 2)
    assert moments == 2 * sum(a.size for a in trained)


# -----------------------------------------------------------------------------
# Your own chats


def test_chat_jsonl_is_read_validated_and_split(tmp_path):
    from tasks.customjson import ChatFileError, CustomJSON, parse_conversation, weighted

    folder = tmp_path / "chats"
    folder.mkdir()
    write_chats(folder / "a.jsonl", n=30)
    (folder / "b.jsonl").write_text(
        '\n{"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},'
        ' {"role": "assistant", "content": "Hello."}], "id": 7}\n'
    )
    train, val, both = (CustomJSON(str(folder), split) for split in ("train", "val", "all"))
    assert len(both) == 31 and (len(train), len(val)) == (29, 2)  # round(5% of 31) = 2, never 0
    assert sorted(map(json.dumps, [*train, *val])) == sorted(map(json.dumps, both))
    assert both[30] == {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    assert [len(t) for t in weighted(train, 2.5)] == [29, 29, 14]

    where = "f.jsonl line 3"
    for line, message in [
        ('{"messages": [', "not valid JSON"),
        ("[1, 2]", 'non-empty "messages" list'),
        ('{"messages": [{"role": "tool", "content": "x"}]}', "role 'tool'"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}',
            "message 2 is from 'user'",
        ),
        (
            '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]}',
            "end with an assistant",
        ),
        ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "b"}]}', "content must be"),
    ]:
        with pytest.raises(ChatFileError, match=message) as e:
            parse_conversation(line, where)
        assert str(e.value).startswith(where + ": ") and "\n" not in str(e.value)


def test_a_malformed_line_stops_sft_before_training(tmp_path, tiny_base_dir, capsys):
    from scripts.sft import main

    bad = write_chats(tmp_path / "mine.jsonl", bad_line=4)
    with pytest.raises(SystemExit) as e:  # no base checkpoint exists: the data is checked before the model loads
        main(LORA_TINY + ["--chats", f"{bad}:2"])
    assert str(e.value) == f"error: {bad} line 4: not valid JSON (Expecting ',' delimiter at column 48)"
    assert not (tiny_base_dir / "chatsft_checkpoints").exists()
    with pytest.raises(SystemExit):
        main(LORA_TINY + ["--chats", str(tmp_path / "missing.jsonl")])
    with pytest.raises(SystemExit):
        main(LORA_TINY + ["--mixture", "none"])
    assert "--mixture none trains on --chats only" in capsys.readouterr().err


# -----------------------------------------------------------------------------
# scripts.sft --lora-rank end to end: one run, shared by the tests below


@pytest.fixture(scope="module")
def lora_run(tiny_corpus, tmp_path_factory):
    """A d2 base checkpoint and a 4-step LoRA SFT run on the offline mixture + a chat JSONL (weight 2) with
    checkpoints at steps 2 and 4, in a base dir of its own. Tests copy what they change."""
    from flaxchat.data.tokenizer import Tokenizer
    from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir
    from scripts.sft import main

    root = tmp_path_factory.mktemp("lora_run")
    for name in ("tokenizer", "base_data"):
        (root / name).symlink_to(tiny_corpus / name, target_is_directory=True)
    vocab = Tokenizer.load(str(tiny_corpus / "tokenizer")).get_vocab_size()
    ckpt = Checkpointer(checkpoint_dir("base", "d2", str(root)), async_save=False)
    ckpt.save(
        1,
        GPT(GPTConfig.from_depth(2, 32, 32, 64, "L", vocab), rngs=nnx.Rngs(0)),
        meta={"user_config": {}, "max_seq_len": 64, "device_batch_size": 2, "total_batch_size": 2048},
    )
    ckpt.close()
    chats = write_chats(root / "mine.jsonl", n=40)
    argv = LORA_TINY + ["--chats", f"{chats}:2", "--num-iterations", "4", "--save-every", "2", "--keep", "2"]
    mp = pytest.MonkeyPatch()
    mp.setenv("FLAXCHAT_BASE_DIR", str(root))
    mp.setattr("scripts.sft.peak_flops_per_device", lambda dtype=None: (1e11, "a guess"))  # measuring it takes seconds
    try:
        result = main(argv + ["--output-tag", "straight"])
    finally:
        mp.undo()
    return root, argv, result


def losses(base, tag):
    rows = [json.loads(line) for line in open(base / "chatsft_checkpoints" / tag / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def stored_bytes(path) -> int:
    """Bytes of the arrays an Orbax checkpoint holds (from its metadata: no file overhead, no compression)."""
    import orbax.checkpoint as ocp

    tree = ocp.StandardCheckpointer().metadata(path).item_metadata
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape"))
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)


def test_lora_resume_is_exact(lora_run, monkeypatch):
    from scripts.sft import main

    root, argv, _ = lora_run
    runs = root / "chatsft_checkpoints"
    shutil.copytree(runs / "straight", runs / "resumed", ignore=shutil.ignore_patterns("4"))  # "killed" after step 2
    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(root))
    monkeypatch.setattr("scripts.sft.peak_flops_per_device", lambda dtype=None: (1e11, "a guess"))
    try:
        main(argv + ["--output-tag", "resumed", "--resume"])
        assert losses(root, "resumed") == losses(root, "straight") and len(losses(root, "straight")) == 4
    finally:
        shutil.rmtree(runs / "resumed")


def test_adapter_checkpoint_is_small_and_loads_merged(lora_run, monkeypatch):
    import orbax.checkpoint as ocp

    from flaxchat.train.checkpoint import load_model
    from scripts.sft import main

    root, _, result = lora_run
    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(root))
    out = root / "chatsft_checkpoints" / "straight"
    assert sorted(p.name for p in out.iterdir() if p.name.isdigit()) == ["2", "4"]
    # the checkpoint holds the adapters' arrays and nothing else, 5% of the base's. (Not their files' size: at d2
    # Orbax's per-checkpoint overhead, 100-300 KB from run to run, is as large as the base model's 590 KB)
    adapter_bytes = stored_bytes(out / "4" / "model")
    assert adapter_bytes == 4 * result["trainable_params"]
    assert adapter_bytes * 20 < stored_bytes(root / "base_checkpoints" / "d2" / "1" / "model")
    assert result["trainable_params"] == 2 * 4 * (4 * (64 + 64) + 2 * (64 + 256))

    merged, _, meta = load_model("sft", "straight")
    assert type(merged) is GPT and meta["lora"] == {
        "rank": 4,
        "alpha": 8.0,
        "targets": "c_q,c_k,c_v,c_proj,c_fc",
        "full": [],
    }
    base = dict(meta["base"])
    assert isinstance(base.pop("saved_at"), float)  # which save of base d2 step 1 the adapters were trained on
    assert base == {"phase": "base", "model_tag": "d2", "step": 1} and meta["step"] == 4
    # every target weight is W + (A B)^T * alpha / r with the checkpoint's own arrays; the rest is the base's
    base, _, _ = load_model("base", "d2")
    adapters = ocp.StandardCheckpointer().restore(out / "4" / "model")
    for i in range(2):
        for part, name in [("attn", "c_q"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj")]:
            a, b = (
                np.asarray(adapters["transformer"]["h"][str(i)][part][name][k]["value"])
                for k in ("weight_lora_a", "weight_lora_b")
            )
            w0 = np.asarray(getattr(getattr(base.transformer.h[i], part), name).weight[...])
            w = np.asarray(getattr(getattr(merged.transformer.h[i], part), name).weight[...])
            np.testing.assert_allclose(w, w0 + 2.0 * (a @ b).T, atol=1e-6)  # alpha / r = 8 / 4
            assert not np.allclose(w, w0)
    assert np.array_equal(merged.lm_head.weight[...], base.lm_head.weight[...])

    # --merge writes them as an ordinary checkpoint, which loads to the same model
    main(["--merge", "--model-tag", "straight"])
    full, _, full_meta = load_model("sft", "straight-merged")
    assert "lora" not in full_meta and full_meta["merged_from"]["model_tag"] == "straight"
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(nnx.state(full)), jax.tree.leaves(nnx.state(merged)))
    )
    # a whole model's arrays, as many bytes as the base's
    merged_bytes = stored_bytes(root / "chatsft_checkpoints" / "straight-merged" / "4" / "model")
    assert merged_bytes == stored_bytes(root / "base_checkpoints" / "d2" / "1" / "model") > 20 * adapter_bytes


def test_adapters_whose_base_was_replaced_or_removed_say_so(lora_run, tmp_path, monkeypatch):
    import shutil

    from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir, load_model

    root = tmp_path / "copy"
    shutil.copytree(lora_run[0], root, symlinks=True)
    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(root))
    base = Checkpointer(checkpoint_dir("base", "d2"), async_save=False)
    model = nnx.eval_shape(lambda: GPT(GPTConfig.from_dict(base.read_meta()["model_config"]), rngs=nnx.Rngs(0)))
    base.restore(model)
    base.replace_earlier_run()  # a later run under the same tag saves its own step 1
    base.save(1, model, meta={"user_config": {}})
    base.close()
    with pytest.raises(
        ValueError, match="was trained on base d2 step 1 as saved at .*, which a later run has replaced"
    ):
        load_model("sft", "straight")
    shutil.rmtree(checkpoint_dir("base", "d2"))
    with pytest.raises(FileNotFoundError, match="was trained on base d2 step 1, which is gone"):
        load_model("sft", "straight")
