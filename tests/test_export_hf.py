"""Hugging Face export: the exported directory, loaded by transformers, computes what flaxchat computes.

Same weights -> same logits (full forward and KV-cached) for configs that exercise windows, GQA and value embeddings;
the HF tokenizer gives tiktoken's ids, the chat template render_conversation's; greedy generate() gives flaxchat's
greedy tokens; and an export reads back into flaxchat bit for bit.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason='the Hugging Face export is loaded with torch: pip install -e ".[hf]"')
transformers = pytest.importorskip("transformers", reason='needs transformers: pip install -e ".[hf]"')

from flaxchat.data.tokenizer import Tokenizer  # noqa: E402
from flaxchat.export.hf import export_hf, load_hf  # noqa: E402
from flaxchat.export.nanochat import to_nanochat_state_dict  # noqa: E402
from flaxchat.generate.engine import generate  # noqa: E402
from flaxchat.model.config import GPTConfig  # noqa: E402
from flaxchat.model.gpt import GPT  # noqa: E402

# sequence_len 256: the short window is 128 tokens, so a 160-token input crosses it
CONFIGS = {
    "gqa-windows": dict(n_layer=3, n_head=4, n_kv_head=2, n_embd=64, window_pattern="SL"),  # ve on layers 0, 2
    "mha-sssl": dict(n_layer=4, n_head=2, n_kv_head=2, n_embd=64, window_pattern="SSSL"),  # ve on layers 1, 3
    "mqa-one-layer": dict(n_layer=1, n_head=4, n_kv_head=1, n_embd=32, window_pattern="L"),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_corpus):
    return Tokenizer.load(str(tiny_corpus / "tokenizer"))


def random_model(tokenizer, seed=0, **shape):
    """A GPT with every parameter random, the zero-initialised ones and the scalars too, so no path is a no-op."""
    cfg = GPTConfig(sequence_len=256, vocab_size=tokenizer.get_vocab_size(), **shape)
    model = GPT(cfg, rngs=nnx.Rngs(seed), dtype=jnp.float32)
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    noise = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(treedef, noise))
    return model


@pytest.fixture(scope="module")
def exports(tokenizer, tmp_path_factory):
    """name -> (flaxchat model, exported dir, transformers model); each config exported and loaded once."""
    out = {}
    for i, (name, shape) in enumerate(CONFIGS.items()):
        model = random_model(tokenizer, seed=i, **shape)
        path = export_hf(model, tokenizer, str(tmp_path_factory.mktemp(name)), extra={"phase": "sft"})
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
        out[name] = (model, path, hf.eval())
    return out


def ids(tokenizer, n, seed=0):
    return np.random.RandomState(seed).randint(0, tokenizer.get_vocab_size(), (2, n))


@pytest.mark.parametrize("name", CONFIGS)
def test_same_weights_same_logits(exports, tokenizer, name):
    model, _, hf = exports[name]
    idx = ids(tokenizer, 160)
    want = np.asarray(model(jnp.asarray(idx)))
    with torch.no_grad():
        got = hf(torch.tensor(idx), use_cache=False).logits.numpy()
    assert got.shape == want.shape == (2, 160, tokenizer.get_vocab_size())
    assert np.abs(got - want).max() <= 1e-4


@pytest.mark.parametrize("name", CONFIGS)
def test_cached_logits_match_the_full_forward(exports, tokenizer, name):
    """A prefill then decode steps over transformers' cache (smear state and windows across the cut)."""
    model, _, hf = exports[name]
    idx = ids(tokenizer, 150, seed=1)
    want = np.asarray(model(jnp.asarray(idx)))
    with torch.no_grad():
        out = hf(torch.tensor(idx[:, :140]), use_cache=True)
        cache, steps = out.logits, []
        cache = out["cache"] if "cache" in out else out[1]
        for t in range(140, 150):
            out = hf(torch.tensor(idx[:, t : t + 1]), **{"past_key_values": cache}, use_cache=True)
            cache = out["cache"] if "cache" in out else out[1]
            steps.append(out.logits.numpy())
    assert np.abs(np.concatenate(steps, axis=1) - want[:, 140:]).max() <= 1e-4


def test_greedy_generate_matches_flaxchat(exports, tokenizer):
    model, _, hf = exports["gqa-windows"]
    prompt = tokenizer.encode("Once upon a time, a cat", prepend="<|bos|>")
    want = generate(model, [prompt], 64, temperature=0.0)[0]
    # no stop tokens, so all 64 come; an explicit mask, or generate reads the leading <|bos|> (the pad id) as padding
    x = torch.tensor([prompt])
    out = hf.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=64, min_new_tokens=64, do_sample=False, eos_token_id=None
    )
    got = out[0, len(prompt) :].tolist()
    assert got == want and len(got) == 64


def test_tokenizer_gives_tiktoken_ids(exports, tokenizer):
    _, path, _ = exports["gqa-windows"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    texts = [
        "Once upon a time, a cat named Tom found a red ball.",
        "<|bos|>Hello<|user_start|> what's 12345 + 678?<|user_end|><|assistant_start|>",
        "  spaces\n\n\ttabs\r\nand don't  STOP!!! ...   ",
        "ünïcödé 你好 🙂 naïve café — “quotes”<|python_start|>1+1<|python_end|>",
        "",
    ]
    for text in texts:
        want = tokenizer.enc.encode(text, allowed_special="all")
        assert hf_tok.encode(text, add_special_tokens=False) == want, text
        assert hf_tok.decode(want) == text
    assert hf_tok.convert_tokens_to_ids("<|assistant_end|>") == tokenizer.encode_special("<|assistant_end|>")
    # by default text begins with <|bos|>, as every pretraining document did (and the model was never trained without)
    text, bos = texts[0], tokenizer.get_bos_token_id()
    assert hf_tok(text)["input_ids"] == hf_tok.encode(text) == [bos] + tokenizer.encode(text)
    assert hf_tok([text, "a"])["input_ids"] == [[bos] + tokenizer.encode(text), [bos] + tokenizer.encode("a")]


CHATS = [
    {"messages": [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello, friend."}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+3?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me compute. "},
                    {"type": "python", "text": "2+3"},
                    {"type": "python_output", "text": "5"},
                    {"type": "text", "text": " It is 5."},
                ],
            },
            {"role": "user", "content": "Thanks\n  bye"},
            {"role": "assistant", "content": "Bye!"},
        ]
    },
]


def template_ids(hf_tok, messages, **kwargs):
    out = hf_tok.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("chat", CHATS, ids=["plain", "system-and-tool"])
def test_chat_template_renders_as_flaxchat(exports, tokenizer, chat):
    _, path, _ = exports["gqa-windows"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    assert template_ids(hf_tok, chat["messages"]) == tokenizer.render_conversation(chat)[0]
    prompt = template_ids(hf_tok, chat["messages"][:-1], add_generation_prompt=True)
    assert prompt == tokenizer.render_for_completion(chat)


def test_chat_template_refuses_what_render_conversation_refuses(exports, tokenizer):
    _, path, _ = exports["gqa-windows"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    for messages in (
        [{"role": "assistant", "content": "Hi"}],
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
    ):
        with pytest.raises(ValueError):
            tokenizer.render_conversation({"messages": messages})
        with pytest.raises(Exception, match="alternate|system"):
            hf_tok.apply_chat_template(messages, tokenize=False)


def test_generation_config_stops_on_assistant_end_and_bos(exports, tokenizer):
    _, path, hf = exports["gqa-windows"]
    with open(os.path.join(path, "generation_config.json")) as f:
        stops = json.load(f)["eos_token_id"]
    assert stops == [tokenizer.encode_special("<|assistant_end|>"), tokenizer.encode_special("<|bos|>")]
    assert list(hf.generation_config.eos_token_id) == stops


@pytest.mark.parametrize("name", CONFIGS)
def test_round_trip_is_bit_identical(exports, tokenizer, name):
    model, path, _ = exports[name]
    loaded, tok, cfg = load_hf(path)
    a, b = to_nanochat_state_dict(model), to_nanochat_state_dict(loaded)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert tok.content_hash == tokenizer.content_hash and cfg["flaxchat"]["phase"] == "sft"


def test_bfloat16_export_is_close(tokenizer, tmp_path):
    model = random_model(tokenizer, **CONFIGS["gqa-windows"])
    path = export_hf(model, tokenizer, str(tmp_path / "bf16"), dtype="bfloat16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    assert hf.lm_head.weight.dtype == torch.bfloat16
    a, b = to_nanochat_state_dict(model), to_nanochat_state_dict(load_hf(path)[0])
    assert all(np.allclose(a[k], b[k], rtol=1e-2, atol=1e-2) for k in a)


def test_script_writes_a_loadable_directory(tiny_base_dir, tmp_path):
    from flaxchat.data.tokenizer import get_tokenizer
    from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir
    from scripts.export import main

    model = random_model(get_tokenizer(), n_layer=2, n_head=2, n_kv_head=2, n_embd=32)
    ckpt = Checkpointer(checkpoint_dir("base", "d2"), async_save=False)
    ckpt.save(7, model, meta={})
    ckpt.close()
    main(["-i", "base", "--format", "hf", "--out", str(tmp_path / "hf")])
    names = set(os.listdir(tmp_path / "hf"))
    assert names == {
        "config.json",
        "configuration_flaxchat.py",
        "generation_config.json",
        "model.safetensors",
        "modeling_flaxchat.py",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    loaded, _, cfg = load_hf(str(tmp_path / "hf"))
    a, b = to_nanochat_state_dict(model), to_nanochat_state_dict(loaded)
    assert all(np.array_equal(a[k], b[k]) for k in a) and cfg["flaxchat"]["step"] == 7


@pytest.fixture
def hub_stand_in(monkeypatch):
    """A loopback stand-in for the Hub's upload API: records every call, accepts every file as a regular upload."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    calls = []

    class Hub(BaseHTTPRequestHandler):
        def _reply(self, obj, code=200):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            calls.append(("GET", self.path, b""))
            self._reply({}, 404)

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            calls.append(("POST", self.path, body))
            root = f"http://{self.headers['Host']}"
            if self.path == "/api/repos/create":
                req = json.loads(body)
                return self._reply({"url": f"{root}/{req.get('organization')}/{req['name']}"})
            if "/preupload/" in self.path:
                files = json.loads(body)["files"]
                files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                return self._reply({"files": files})
            if "/commit/" in self.path:
                return self._reply({"commitUrl": f"{root}/me/d2/commit/{'a' * 40}", "commitOid": "a" * 40})
            self._reply({}, 404)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in")
    yield calls
    server.shutdown()
    server.server_close()


def test_push_to_hub_uploads_every_file(hub_stand_in, tiny_base_dir, tmp_path):
    pytest.importorskip("huggingface_hub", reason="--push-to-hub uploads through huggingface_hub")
    from flaxchat.data.tokenizer import get_tokenizer
    from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir
    from scripts.export import main

    model = random_model(get_tokenizer(), n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    ckpt = Checkpointer(checkpoint_dir("sft", "d1"), async_save=False)
    ckpt.save(3, model, meta={})
    ckpt.close()
    main(["-i", "sft", "--format", "hf", "--out", str(tmp_path / "hf"), "--push-to-hub", "me/d2"])
    posts = [(path, body) for method, path, body in hub_stand_in if method == "POST"]
    created = json.loads(posts[0][1])
    assert posts[0][0] == "/api/repos/create" and (created["organization"], created["name"]) == ("me", "d2")
    assert posts[-1][0] == "/api/models/me/d2/commit/main"
    lines = [json.loads(line) for line in posts[-1][1].splitlines()]
    assert lines[0]["value"]["summary"] == "flaxchat sft step 3"
    assert {x["value"]["path"] for x in lines[1:]} == set(os.listdir(tmp_path / "hf"))


def test_push_to_hub_needs_the_hf_format(tiny_base_dir, tmp_path):
    from flaxchat.data.tokenizer import get_tokenizer
    from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir
    from scripts.export import main

    model = random_model(get_tokenizer(), n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    ckpt = Checkpointer(checkpoint_dir("sft", "d1"), async_save=False)
    ckpt.save(3, model, meta={})
    ckpt.close()
    with pytest.raises(SystemExit, match="add --format hf"):
        main(["-i", "sft", "--format", "safetensors", "--out", str(tmp_path / "st"), "--push-to-hub", "me/d2"])
