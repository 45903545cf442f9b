import os
import re
import tempfile

import numpy as np
import pytest
from flax import nnx

from flaxchat.data.tokenizer import get_tokenizer
from flaxchat.export.nanochat import load_nanochat_checkpoint, load_safetensors, to_nanochat_state_dict
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT
from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir
from scripts.export import main


@pytest.fixture
def sft_model(tiny_base_dir):
    cfg = GPTConfig(
        sequence_len=32, vocab_size=get_tokenizer().get_vocab_size(), n_layer=2, n_head=2, n_kv_head=2, n_embd=64
    )
    model = GPT(cfg, rngs=nnx.Rngs(4))
    ckpt = Checkpointer(checkpoint_dir("sft", "d2"), async_save=False)
    ckpt.save(12, model, meta={"val_bpb": 1.5})
    ckpt.close()
    return model


def test_safetensors_export_round_trip(sft_model, tmp_path):
    main(["-i", "sft", "--format", "safetensors", "--out", str(tmp_path / "st"), "--with-tokenizer"])
    loaded, cfg = load_safetensors(str(tmp_path / "st"))
    a, b = to_nanochat_state_dict(sft_model), to_nanochat_state_dict(loaded)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert cfg["step"] == 12 and cfg["phase"] == "sft" and cfg["tokenizer_hash"] == get_tokenizer().content_hash
    assert os.path.exists(tmp_path / "st" / "tokenizer" / "tokenizer.json")


def test_bf16_safetensors_are_close(sft_model, tmp_path):
    main(["-i", "sft", "--format", "safetensors", "--dtype", "bfloat16", "--out", str(tmp_path / "bf")])
    loaded, _ = load_safetensors(str(tmp_path / "bf"))
    a, b = to_nanochat_state_dict(sft_model), to_nanochat_state_dict(loaded)
    assert all(np.allclose(a[k], b[k], rtol=1e-2, atol=1e-3) for k in a)


def test_nanochat_format_export(sft_model, tmp_path):
    pytest.importorskip("torch")
    import pickle

    main(["-i", "sft", "--format", "nanochat", "--out", str(tmp_path / "nc"), "--with-tokenizer"])
    assert os.path.exists(tmp_path / "nc" / "model_000012.pt") and os.path.exists(tmp_path / "nc" / "meta_000012.json")
    loaded, meta = load_nanochat_checkpoint(str(tmp_path / "nc"))
    assert meta["exported_from"] == "flaxchat"
    a, b = to_nanochat_state_dict(sft_model), to_nanochat_state_dict(loaded)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    with open(tmp_path / "nc" / "tokenizer.pkl", "rb") as f:
        enc = pickle.load(f)  # nanochat unpickles a tiktoken Encoding
    text = "Once upon a time, a cat named Tom found a red ball."
    assert enc.encode_ordinary(text) == get_tokenizer().encode(text)


def test_missing_checkpoint_is_one_line(tiny_base_dir, tmp_path):
    with pytest.raises(SystemExit, match="no sft checkpoints"):
        main(["-i", "sft", "--out", str(tmp_path / "x")])


# -----------------------------------------------------------------------------
# LiteRT (TFLite): needs the export extra (pip install -e ".[export]"), which CI installs

LITERT_PROMPT = "Once upon a time, a cat named Tom found a red ball."


def _needs_litert():
    pytest.importorskip("tensorflow", reason='LiteRT export needs the export extra: pip install -e ".[export]"')
    pytest.importorskip("ai_edge_litert", reason='the LiteRT runner needs the export extra: pip install -e ".[export]"')


@pytest.fixture(scope="module")
def litert_checkpoint(tiny_corpus, tmp_path_factory):
    """(model, tokenizer, base dir): a tiny sft checkpoint with every weight nonzero (well-separated logits).
    Module-scoped, as is its fp32 export: conversions are most of these tests' time."""
    _needs_litert()
    import jax

    from flaxchat.data.tokenizer import Tokenizer

    base = tmp_path_factory.mktemp("litert") / "base"
    base.mkdir()
    (base / "tokenizer").symlink_to(tiny_corpus / "tokenizer", target_is_directory=True)
    tokenizer = Tokenizer.load(str(tiny_corpus / "tokenizer"))
    cfg = GPTConfig(sequence_len=64, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=1, n_embd=64)
    model = GPT(cfg, rngs=nnx.Rngs(7))
    params = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(params))))
    nnx.update(model, jax.tree.map(lambda p: p + 0.3 * jax.random.normal(next(keys), p.shape, p.dtype), params))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLAXCHAT_BASE_DIR", str(base))
        ckpt = Checkpointer(checkpoint_dir("sft", "d2"), async_save=False)
        ckpt.save(3, model, meta={"val_bpb": 2.0})
        ckpt.close()
    return model, tokenizer, base


def _litert_export(base, quantize, out):
    """scripts.export --format litert of the checkpoint under `base` (the base dir is set only meanwhile);
    prefill in chunks of 8, so the test prompt takes several."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLAXCHAT_BASE_DIR", str(base))
        main(
            [
                "-i",
                "sft",
                "--format",
                "litert",
                "--litert-quantize",
                quantize,
                "--litert-prefill-len",
                "8",
                "--out",
                str(out),
            ]
        )
    return out


@pytest.fixture(scope="module")
def litert_exports(litert_checkpoint):
    """(model, tokenizer, {"none": fp32 export dir})."""
    model, tokenizer, base = litert_checkpoint
    return model, tokenizer, {"none": _litert_export(base, "none", base.parent / "none")}


def test_litert_greedy_and_logits_match_the_model(litert_exports):
    import jax.numpy as jnp

    from flaxchat.export.litert_chat import LiteRTModel, generate
    from flaxchat.generate.engine import generate as engine_generate

    model, tokenizer, dirs = litert_exports
    prompt = tokenizer.encode(LITERT_PROMPT, prepend="<|bos|>")
    assert len(prompt) > 8 and len(prompt) % 8  # several prefill chunks, the last one padded
    lite = LiteRTModel(str(dirs["none"]))
    assert lite.config["cache_shape"] == [2, 1, 64, 32] and lite.config["quantize"] == "none"
    stops = set(lite.config["stop_token_ids"])

    # greedy tokens: the interpreter's prefill + decode loop == flaxchat's jitted generation (the Engine's core)
    (expected,) = engine_generate(model, [prompt], 40, temperature=0.0, stop_tokens=tuple(stops))
    assert list(generate(lite, prompt, 40, stop_tokens=stops)) == expected

    # logits: the prefill's, then each decode step's, against one uncached forward over the same tokens
    lite.reset()
    seq = prompt + expected[:6]
    reference = np.asarray(nnx.jit(lambda m, idx: m(idx))(model, jnp.array([seq]))[0])
    got = [lite.feed(prompt)] + [lite.step(t) for t in expected[:6]]
    diff = np.abs(np.stack(got) - reference[len(prompt) - 1 :]).max()
    assert diff < 1e-4, diff


def test_litert_quantized_exports_are_smaller_and_close(litert_checkpoint, litert_exports, tmp_path):
    from flaxchat.export.litert_chat import LiteRTModel

    _, tokenizer, base = litert_checkpoint
    dirs = {"none": litert_exports[2]["none"], **{q: _litert_export(base, q, tmp_path / q) for q in ("fp16", "int8")}}
    size = {q: os.path.getsize(d / "model.tflite") for q, d in dirs.items()}
    # int8 (dynamic range) covers the matmul weights only: the embedding tables stay float32 (flaxchat.export.litert)
    assert size["fp16"] < 0.6 * size["none"] and size["int8"] < 0.75 * size["none"], size
    prompt = tokenizer.encode(LITERT_PROMPT, prepend="<|bos|>")
    reference = LiteRTModel(str(dirs["none"])).feed(prompt)  # == the JAX model's (the test above)
    for q, tolerance in (("fp16", 0.05), ("int8", 1.0)):
        lite = LiteRTModel(str(dirs[q]))
        assert lite.config["quantize"] == q
        diff = np.abs(lite.feed(prompt) - reference).max()  # measured: fp16 ~0.007, int8 ~0.2 (logits span +-15)
        assert diff < tolerance, (q, diff)


def test_litert_runner_needs_no_jax(litert_exports):
    """The runner in a fresh interpreter where importing jax, flax or tensorflow fails: the tokenizer, the
    interpreter and the decode loop must come from numpy, tiktoken and ai_edge_litert alone."""
    import subprocess
    import sys

    from flaxchat.export.litert_chat import LiteRTModel, generate

    _, tokenizer, dirs = litert_exports
    code = (
        "import runpy, sys\n"
        "for name in ('jax', 'jaxlib', 'flax', 'tensorflow', 'orbax', 'rustbpe'): sys.modules[name] = None\n"
        f"sys.argv = ['litert_chat', {str(dirs['none'])!r}, '-p', {LITERT_PROMPT!r}, '--complete', '-m', '12']\n"
        "runpy.run_module('scripts.litert_chat', run_name='__main__')\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lite = LiteRTModel(str(dirs["none"]))
    tokens = list(
        generate(
            lite, tokenizer.encode(LITERT_PROMPT, prepend="<|bos|>"), 12, stop_tokens=set(lite.config["stop_token_ids"])
        )
    )
    expected = tokenizer.decode([t for t in tokens if t not in lite.config["stop_token_ids"]])
    assert result.stdout.rstrip("\n") == expected


def test_litert_chat_shows_tool_calls_as_chat_cli_does(tiny_base_dir):
    """A tool call and its output read as chat_cli shows them ([python: ...], [output: ...]), not as special tokens'
    names; other special tokens and text are unchanged."""
    from flaxchat.export.litert_chat import shown_bytes
    from scripts.chat_cli import PART_STYLE

    tok = get_tokenizer()
    sp = tok.encode_special
    ids = [sp("<|python_start|>"), *tok.encode("12*3"), sp("<|python_end|>"), sp("<|output_start|>"), *tok.encode("36")]
    ids += [sp("<|output_end|>"), *tok.encode(" so 36"), sp("<|assistant_end|>")]
    (call_open, call_close), (out_open, out_close) = PART_STYLE["python"], PART_STYLE["python_output"]
    expected = f"{call_open}12*3{call_close}{out_open}36{out_close} so 36<|assistant_end|>"
    assert b"".join(shown_bytes(tok.enc, t) for t in ids).decode() == expected


def test_litert_unconvertible_model_is_one_line(tiny_base_dir, tmp_path, monkeypatch):
    """A model with an op LiteRT has no kernel for (a sort of the logits, as on-device top-p sampling would
    add) fails with one line naming the op, not a TensorFlow traceback."""
    _needs_litert()
    import jax.numpy as jnp

    cfg = GPTConfig(
        sequence_len=32, vocab_size=get_tokenizer().get_vocab_size(), n_layer=1, n_head=2, n_kv_head=2, n_embd=64
    )
    ckpt = Checkpointer(checkpoint_dir("base", "d1"), async_save=False)
    ckpt.save(1, GPT(cfg, rngs=nnx.Rngs(0)), meta={})
    ckpt.close()
    forward_cached = GPT.forward_cached

    def sorted_logits(self, idx, cache, logits_at=None):
        logits, cache = forward_cached(self, idx, cache, logits_at)
        return jnp.sort(logits, axis=-1), cache

    monkeypatch.setattr(GPT, "forward_cached", sorted_logits)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["-i", "base", "--format", "litert", "--out", str(tmp_path / "lt")])
    message = str(exit_info.value)
    assert message.startswith("error: the LiteRT converter cannot take this model: op ") and "sort" in message
    assert "\n" not in message and len(message) < 400, message
    log = re.search(r"\(converter log: (\S+)\)$", message).group(1)  # TensorFlow's own output, kept aside
    assert log.startswith(str(tmp_path)) and "sort" in open(log).read()
    assert not os.path.exists(tmp_path / "lt" / "model.tflite")
