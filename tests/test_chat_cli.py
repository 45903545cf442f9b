"""chat_cli: flags, streamed printing (tool parts, split characters), multi-turn prompts, /clear and /quit,
one-shot -p mode with a tool call, context overflow, and loading a saved checkpoint end to end."""

import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat.data.tokenizer import Tokenizer
from flaxchat.generate.engine import Engine
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT, KVCache
from scripts import chat_cli

TEXT = ["Hello there! The cat sat on the mat. 2+2 is 4. Café, naïve.\n" * 20]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train_from_iterator(iter(TEXT), 300)


def make_model(config, seed=0, scale=0.3):
    """A GPT with every parameter N(0, scale), built abstractly and filled from numpy (fast, no init compile)."""
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    fill = lambda x: jnp.asarray(rng.normal(0.0, scale, x.shape).astype(np.float32))
    nnx.update(model, jax.tree.map(fill, nnx.state(model)))
    return model


@pytest.fixture(scope="module")
def model(tok):
    config = GPTConfig(sequence_len=128, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    return make_model(config)


class ScriptedModel(nnx.Module):
    """Mock model: after absolute position p it puts all mass on script[p + 1], whatever the tokens are."""

    def __init__(self, script, vocab_size, sequence_len=64):
        self.config = GPTConfig(
            sequence_len=sequence_len, vocab_size=vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=2
        )
        self.script = nnx.Variable(jnp.asarray(script + [script[-1]] * (sequence_len + 1 - len(script)), jnp.int32))
        self.dtype = jnp.float32  # the compute dtype the engine casts parameters to

    def init_cache(self, batch_size, max_len):
        k, v = (jnp.zeros((batch_size, 1, max_len, 1)),), (jnp.zeros((batch_size, 1, 1, max_len)),)  # one layer
        return KVCache(k=k, v=v, pos=jnp.zeros((batch_size,), jnp.int32), prev_embedding=jnp.zeros((batch_size, 2)))

    def forward_cached(self, idx, cache, logits_at=None, fresh=False):
        positions = cache.pos[:, None] + jnp.arange(idx.shape[1])[None, :]
        if logits_at is not None:
            positions = jnp.take_along_axis(positions, logits_at[:, None], axis=1)[:, 0]
        logits = 100.0 * jax.nn.one_hot(self.script[...][positions + 1], self.config.vocab_size)
        return logits, dataclasses.replace(cache, pos=cache.pos + idx.shape[1])


class SpyEngine:
    """Wraps an Engine and records every prompt it is asked to continue."""

    def __init__(self, engine):
        self.engine, self.capacity, self.prompts = engine, engine.capacity, []

    def generate(self, tokens, **kwargs):
        self.prompts.append(list(tokens))
        return self.engine.generate(tokens, **kwargs)


def replies(lines):
    it = iter(lines)
    return lambda prompt: next(it)


def test_flags_are_checked(capsys):
    args = chat_cli.get_args(["-i", "rl", "-g", "d4", "-s", "7", "-t", "0", "-k", "0", "--top-p", "0.9"])
    got = (args.source, args.model_tag, args.step, args.temperature, args.top_k, args.top_p)
    assert got == ("rl", "d4", 7, 0.0, 0, 0.9)
    assert not args.sandbox and chat_cli.get_args(["--sandbox"]).sandbox  # the calculator only, unless asked
    for bad, message in [
        (["-t", "-1"], "--temperature"),
        (["-k", "-2"], "--top-k"),
        (["--top-p", "1.5"], "--top-p"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["-i", "dpo"], "invalid choice"),
    ]:
        with pytest.raises(SystemExit):
            chat_cli.get_args(bad)
        assert message in capsys.readouterr().err


def test_reply_printer_shows_tool_parts_and_whole_characters(tok):
    sp = tok.encode_special
    reply = [
        *tok.encode("Café"),
        sp("<|python_start|>"),
        *tok.encode("2+2"),
        sp("<|python_end|>"),
        sp("<|output_start|>"),
        *tok.encode("4"),
        sp("<|output_end|>"),
        *tok.encode(" naïve €5"),
    ]
    assert len(tok.encode("€")) == 3  # one character, three byte tokens: it must not print in pieces
    out = io.StringIO()
    printer = chat_cli.ReplyPrinter(tok, out, color=False)
    writes = []
    out.write = lambda s: writes.append(s)
    assert all(printer.add(t) for t in reply) and not printer.add(sp("<|assistant_end|>"))
    parts = printer.finish()
    assert "".join(writes) == "Café[python: 2+2][output: 4] naïve €5"
    assert not any("\ufffd" in w for w in writes)
    assert parts == [
        {"type": "text", "text": "Café"},
        {"type": "python", "text": "2+2"},
        {"type": "python_output", "text": "4"},
        {"type": "text", "text": " naïve €5"},
    ]
    colored = io.StringIO()
    printer = chat_cli.ReplyPrinter(tok, colored, color=True)
    for t in [sp("<|python_start|>"), *tok.encode("1"), sp("<|python_end|>")]:
        printer.add(t)
    assert chat_cli.DIM in colored.getvalue() and chat_cli.RESET in colored.getvalue()


def test_multi_turn_clear_and_quit(tok, model):
    engine = SpyEngine(Engine(model, tok))
    args = chat_cli.get_args(["-t", "0", "--max-tokens", "6"])
    out = io.StringIO()
    messages = chat_cli.run_chat(engine, tok, args, replies(["Hello", "", "The cat", "/clear", "2+2", "/quit"]), out)
    first, second, third = engine.prompts
    assert first == tok.render_for_completion(
        {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": ""}]}
    )
    assert second[: len(first)] == first and len(second) > len(first) + 6  # the first exchange is in the prompt
    assert third == tok.render_for_completion(
        {"messages": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": ""}]}
    )
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == "2+2"
    text = out.getvalue()
    assert text.count("Assistant: ") == 3 and "(new conversation)" in text

    # Ctrl-C during a reply stops it and keeps what was said; Ctrl-D ends the chat
    class Interrupting(SpyEngine):
        def generate(self, tokens, **kwargs):
            for i, item in enumerate(self.engine.generate(tokens, **kwargs)):
                if i == 2:
                    raise KeyboardInterrupt
                yield item

    out = io.StringIO()
    messages = chat_cli.run_chat(Interrupting(engine.engine), tok, args, replies(["Hello", "/quit"]), out)
    assert "[stopped]" in out.getvalue() and messages[1]["role"] == "assistant"
    assert chat_cli.run_chat(engine, tok, args, lambda prompt: (_ for _ in ()).throw(EOFError), io.StringIO()) == []


def test_prompt_mode_streams_a_tool_call(tok):
    sp = tok.encode_special
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}
    prompt = tok.render_for_completion(chat)
    reply = [
        sp("<|python_start|>"),
        *tok.encode("2+2"),
        sp("<|python_end|>"),
        *tok.encode("ZZZ"),
        *tok.encode(" The cat"),
        sp("<|assistant_end|>"),
    ]
    engine = Engine(ScriptedModel(prompt + reply, tok.get_vocab_size()), tok)
    out = io.StringIO()
    args = chat_cli.get_args(["-p", "hi"])
    messages = chat_cli.run_chat(engine, tok, args, read_line=None, out=out)
    assert out.getvalue() == "[python: 2+2][output: 4] The cat\n"  # the Zs were overwritten by the forced output
    assert messages[1]["content"] == [
        {"type": "python", "text": "2+2"},
        {"type": "python_output", "text": "4"},
        {"type": "text", "text": " The cat"},
    ]


def test_long_conversations_drop_the_oldest_turns(tok):
    messages = [
        {"role": "user", "content": "Hello there! " * 8},
        {"role": "assistant", "content": "The cat sat."},
        {"role": "user", "content": "2+2"},
    ]
    ids, dropped = chat_cli.render_prompt(tok, messages, capacity=40, reserve=16)
    assert dropped == 2 and len(ids) + 16 <= 40
    with pytest.raises(ValueError, match="context holds 40"):
        chat_cli.render_prompt(tok, [{"role": "user", "content": "Hello there! " * 30}], capacity=40, reserve=16)


@pytest.fixture
def compile_cache_restored():
    """chat_cli.main turns on JAX's persistent compile cache, which is process-wide: start without one (as a
    user's process does; the test run shares one, see conftest.py) and put it back afterwards."""
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_main_loads_a_checkpoint(tok, capsys, monkeypatch, compile_cache_restored):
    from flaxchat.common import get_base_dir
    from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir

    engines = []

    class Recorded(Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(chat_cli, "Engine", Recorded)
    assert chat_cli.main(["-i", "sft", "-p", "hi"]) == 1
    assert "no sft checkpoints" in capsys.readouterr().err  # one clear line, no traceback
    config = GPTConfig(sequence_len=64, vocab_size=tok.get_vocab_size(), n_layer=1, n_head=1, n_kv_head=1, n_embd=32)
    tok.save(f"{get_base_dir()}/tokenizer")
    ckpt = Checkpointer(checkpoint_dir("sft", "d1"), async_save=False)
    ckpt.save(3, make_model(config, seed=1))
    ckpt.close()
    flags = ["-i", "sft", "-g", "d1", "-s", "3", "-p", "hi", "-t", "0", "--max-tokens", "5"]
    assert chat_cli.main(flags) == 0 and chat_cli.main([*flags, "--sandbox"]) == 0
    assert [e.use_sandbox for e in engines] == [False, True]  # calculator only unless --sandbox
    assert jax.config.jax_compilation_cache_dir == f"{get_base_dir()}/jax_cache"  # a second session starts at once
    printed = capsys.readouterr().out
    assert printed.endswith("\n") and len(printed) > 1
    assert chat_cli.main(["-i", "sft", "-g", "d1", "-s", "9", "-p", "hi"]) == 1
    assert "no checkpoint for step 9" in capsys.readouterr().err
    # speculative sampling with a draft checkpoint: the same greedy reply
    assert chat_cli.main(flags) == 0
    plain = capsys.readouterr().out
    assert chat_cli.main([*flags, "--draft-model", "sft:d1", "--draft-steps", "2"]) == 0
    assert capsys.readouterr().out == plain and engines[-1].draft_model is not None
    for bad, message in (("dpo:d1", "SOURCE base, sft or rl"), ("d9", "d9")):
        assert chat_cli.main([*flags, "--draft-model", bad]) == 1
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_after_the_demo_the_chat_command_finds_its_model_and_says_so(tok, capsys, compile_cache_restored):
    """The laptop demo keeps its tokenizer and checkpoints in <base dir>/tinystories; `chat_cli -i sft`, as the
    README prints it, loads the newest sft model of the base dir and that folder, and names where it came from."""
    import os
    import time

    from flaxchat.common import get_base_dir
    from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir

    def save(base_dir, tag, step, n_embd):
        tok.save(f"{base_dir}/tokenizer")
        config = GPTConfig(
            sequence_len=64, vocab_size=tok.get_vocab_size(), n_layer=1, n_head=1, n_kv_head=1, n_embd=n_embd
        )
        ckpt = Checkpointer(checkpoint_dir("sft", tag, base_dir), async_save=False)
        ckpt.save(step, make_model(config, seed=step))
        ckpt.close()

    base, demo = get_base_dir(), os.path.join(get_base_dir(), "tinystories")
    save(demo, "demo-d4", 400, 32)
    flags = ["-i", "sft", "-p", "hi", "-t", "0", "--max-tokens", "3"]
    assert chat_cli.main(flags) == 0
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [f"chat_cli: none in {base}; the laptop demo's model: sft demo-d4 step 400 in {demo}"]
    time.sleep(0.05)  # a later save: the base dir's own model is the newer one
    save(base, "d1", 7, 64)
    assert chat_cli.main(flags) == 0
    said = capsys.readouterr().err.strip()
    assert said == f"chat_cli: sft d1 step 7 in {base}, the newer of {base} and {demo} (FLAXCHAT_BASE_DIR picks one)"
    assert chat_cli.main([*flags, "-g", "demo-d4"]) == 0  # a tag only one of them has
    assert f"sft demo-d4 step 400 in {demo}" in capsys.readouterr().err


def test_the_sandbox_flag_refuses_at_once_where_no_sandbox_can_run(monkeypatch, capsys):
    from flaxchat.generate import sandbox

    monkeypatch.setattr(sandbox, "find_bubblewrap", lambda: (None, "no bwrap here (test)"))
    monkeypatch.setattr(sandbox, "warn_fallback", lambda why: None)
    monkeypatch.delenv("FLAXCHAT_SANDBOX", raising=False)
    assert chat_cli.main(["--sandbox", "-p", "hi"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("chat_cli: flaxchat sandbox: refusing") and "--allow-python-guard" in err
    assert len(err.splitlines()) == 1
    monkeypatch.setenv("FLAXCHAT_SANDBOX", "")  # restored afterwards: main sets it to allow-guard
    assert chat_cli.main(["--sandbox", "--allow-python-guard", "-p", "hi"]) == 1  # trusted code: on to the model
    assert "no sft checkpoints" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the opt-in belongs to --sandbox
        chat_cli.get_args(["--allow-python-guard"])
    assert "goes with --sandbox" in capsys.readouterr().err
