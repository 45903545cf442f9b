"""Tokenizer: round trips, specials, chat rendering masks, file formats, training determinism, scripts."""

import base64
import hashlib
import json
import os
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken
import tiktoken.load
import tiktoken.registry

from flaxchat.data.tokenizer import SPECIAL_TOKENS, Tokenizer, get_token_bytes, get_tokenizer

VOCAB = 512


def _corpus() -> list[str]:
    """Real text present wherever Python is: a few stdlib modules, plus non-ASCII lines."""
    stdlib = os.path.dirname(os.__file__)
    docs = []
    for name in ["argparse.py", "difflib.py", "textwrap.py", "string.py", "fractions.py"]:
        with open(os.path.join(stdlib, name), encoding="utf-8") as f:
            docs.extend(block + "\n\n" for block in f.read().split("\n\n"))
    docs += ["Привет, как дела? Всё хорошо.\n", "你好世界，今天天气很好。\n", "naïve café résumé 🌍🚀\n"] * 20
    return docs


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train_from_iterator(iter(_corpus()), VOCAB)


CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 6 times 7?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me compute it."},
                {"type": "python", "text": "6 * 7"},
                {"type": "python_output", "text": "42"},
                {"type": "text", "text": "It is 42."},
            ],
        },
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."},
    ]
}


# ----------------------------------------------------------------------------- encode / decode


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello world",
        "naïve café, Grüße, Привет",
        "你好世界，日本語のテキスト，한국어 문장",
        "emoji 🌍🚀👩‍👩‍👧 and flags 🇫🇷",
        "   leading spaces\n\n\n\t\ttabs   \r\n trailing   ",
        "31415926535897932384626433832795028841971",
        "<|bos|> looks special but is plain text <|assistant_end|>",
        "def f(x):\n    return x ** 2  # comment\n",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(ids, dtype=np.int32)) == text
    assert all(0 <= i < tok.get_vocab_size() for i in ids)


def test_plain_text_never_yields_special_ids(tok):
    specials = {tok.encode_special(s) for s in SPECIAL_TOKENS}
    text = "".join(SPECIAL_TOKENS) * 3
    assert not specials & set(tok.encode(text))
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_layout(tok):
    assert tok.get_vocab_size() == VOCAB
    assert tok.get_special_tokens() == set(SPECIAL_TOKENS)
    # nanochat's layout: specials take the last ids, in SPECIAL_TOKENS order, BOS first.
    assert [tok.encode_special(s) for s in SPECIAL_TOKENS] == list(range(VOCAB - 9, VOCAB))
    assert tok.get_bos_token_id() == VOCAB - 9
    assert tok.id_to_token(tok.get_bos_token_id()) == "<|bos|>"
    with pytest.raises(ValueError, match="not a special token"):
        tok.encode_special("<|nope|>")


def test_prepend_append_and_batch(tok):
    bos, end = tok.get_bos_token_id(), tok.encode_special("<|assistant_end|>")
    texts = ["one document", "another, longer document 123", ""]
    plain = [tok.encode(t) for t in texts]
    assert tok.encode(texts, num_threads=2) == plain
    assert tok.encode(texts, prepend=bos, num_threads=4) == [[bos] + p for p in plain]
    assert tok.encode(texts[0], prepend="<|bos|>", append="<|assistant_end|>") == [bos] + plain[0] + [end]
    assert tok(texts[1], append=end) == plain[1] + [end]
    with pytest.raises(TypeError):
        tok.encode(("a", "tuple"))


def test_token_bytes_count_utf8_bytes(tok):
    tb = tok.token_bytes()
    assert tb.dtype == np.int32 and tb.shape == (VOCAB,)
    assert (tb[VOCAB - 9 :] == 0).all() and (tb[: VOCAB - 9] >= 1).all()
    text = "Some text with ünïcödé and 🌍 in it."
    assert tb[tok.encode(text, prepend=tok.get_bos_token_id())].sum() == len(text.encode("utf-8"))


def test_training_is_deterministic(tok):
    again = Tokenizer.train_from_iterator(iter(_corpus()), VOCAB)
    assert again.enc._mergeable_ranks == tok.enc._mergeable_ranks
    assert again.content_hash == tok.content_hash
    other = Tokenizer.train_from_iterator(iter(_corpus()), VOCAB + 64)
    assert other.content_hash != tok.content_hash


def test_tokenizer_pickles_for_worker_processes(tok):
    # Data pipelines may ship the tokenizer to worker processes.
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode("workers too 你好") == tok.encode("workers too 你好")
    assert clone.content_hash == tok.content_hash


def test_vocab_too_small():
    with pytest.raises(ValueError, match="at least 265"):
        Tokenizer.train_from_iterator(iter(["abc"]), 264)


# ----------------------------------------------------------------------------- conversations


def test_render_conversation_masks_exactly_the_assistant(tok):
    ids, mask = tok.render_conversation(CONVERSATION)
    assert len(ids) == len(mask)
    sp = {s: tok.encode_special(s) for s in SPECIAL_TOKENS}
    supervised = [i for i, m in zip(ids, mask) if m == 1]
    expected = (
        tok.encode("Let me compute it.")
        + [sp["<|python_start|>"], *tok.encode("6 * 7"), sp["<|python_end|>"]]
        + tok.encode("It is 42.")
        + [sp["<|assistant_end|>"]]
        + tok.encode("You're welcome.")
        + [sp["<|assistant_end|>"]]
    )
    assert supervised == expected
    # The tool's output is given, not learned: its delimiters and content are all mask 0.
    start = ids.index(sp["<|output_start|>"])
    end = ids.index(sp["<|output_end|>"])
    assert ids[start + 1 : end] == tok.encode("42") and not any(mask[start : end + 1])
    # The system message is folded into the first user turn.
    u0, u1 = ids.index(sp["<|user_start|>"]), ids.index(sp["<|user_end|>"])
    assert tok.decode(ids[u0 + 1 : u1]) == "You are terse.\n\nWhat is 6 times 7?"
    assert ids[0] == tok.get_bos_token_id() and mask[0] == 0
    assert ids.count(sp["<|assistant_start|>"]) == 2 and ids.count(sp["<|user_start|>"]) == 2


def test_render_truncates(tok):
    ids, mask = tok.render_conversation(CONVERSATION)
    short_ids, short_mask = tok.render_conversation(CONVERSATION, max_tokens=10)
    assert (short_ids, short_mask) == (ids[:10], mask[:10])


def test_render_for_completion(tok):
    before = json.dumps(CONVERSATION)
    prompt = tok.render_for_completion(CONVERSATION)
    assert json.dumps(CONVERSATION) == before  # the caller's conversation is untouched
    head, _ = tok.render_conversation({"messages": CONVERSATION["messages"][:-1]})
    assert prompt == head + [tok.encode_special("<|assistant_start|>")]
    with pytest.raises(ValueError, match="ends with an assistant"):
        tok.render_for_completion({"messages": CONVERSATION["messages"][:2]})


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "assistant", "content": "hi"}], "should be from 'user'"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "should be from 'assistant'"),
        ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "b"}], "followed by a user"),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "img", "text": ""}]}],
            "unknown assistant part",
        ),
        ([{"role": "user", "content": ["a"]}], "must be a string"),
        ([], "at least one message"),
    ],
)
def test_render_rejects_bad_conversations(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.render_conversation({"messages": messages})


def test_visualize_tokenization(tok):
    ids, mask = tok.render_conversation(CONVERSATION)
    shown = tok.visualize_tokenization(ids, mask, with_token_id=True)
    assert shown.count("|") >= len(ids) - 1 and f"({ids[0]})" in shown
    assert "\033[92m" in shown and "\033[91m" in shown


# ----------------------------------------------------------------------------- files


def test_save_load_round_trip(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(tmp_path))
    tok.save(str(tmp_path / "tokenizer"))
    loaded = get_tokenizer()
    text = "Save, load, and encode the same: 你好 🌍 12345"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.content_hash == tok.content_hash
    assert loaded.enc._mergeable_ranks == tok.enc._mergeable_ranks
    assert loaded.enc._special_tokens == tok.enc._special_tokens
    assert np.array_equal(get_token_bytes(), tok.token_bytes())
    data = json.loads((tmp_path / "tokenizer" / "tokenizer.json").read_text())
    assert data["content_hash"] == tok.content_hash and data["vocab_size"] == VOCAB


def test_load_detects_tampering(tok, tmp_path):
    path = tok.save(str(tmp_path))
    data = json.loads(open(path).read())
    first = next(iter(data["mergeable_ranks"]))
    data["mergeable_ranks"][first] = 1  # swap a rank
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.raises(ValueError, match="content hash"):
        Tokenizer.load(str(tmp_path))


def test_missing_tokenizer_names_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m scripts.tok_train"):
        get_tokenizer(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="python -m scripts.tok_train"):
        get_token_bytes(str(tmp_path))


def test_from_nanochat_pickle(tok, tmp_path):
    # nanochat saves `pickle.dump(tiktoken.Encoding)`; build one the same way.
    enc = tiktoken.Encoding(
        name="rustbpe",
        pat_str=tok.enc._pat_str,
        mergeable_ranks=dict(tok.enc._mergeable_ranks),
        special_tokens={name: VOCAB - 9 + i for i, name in enumerate(SPECIAL_TOKENS)},
    )
    with open(tmp_path / "tokenizer.pkl", "wb") as f:
        pickle.dump(enc, f)
    imported = Tokenizer.from_nanochat(str(tmp_path))
    text = "Bring your own tokenizer: naïve 你好 2024"
    assert imported.encode(text) == tok.encode(text) == enc.encode_ordinary(text)
    assert imported.content_hash == tok.content_hash
    assert imported.get_bos_token_id() == enc.encode_single_token("<|bos|>")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_from_nanochat_refuses_code(tmp_path):
    with open(tmp_path / "tokenizer.pkl", "wb") as f:
        pickle.dump(_Evil(), f)
    with pytest.raises(pickle.UnpicklingError, match="only tiktoken Encodings"):
        Tokenizer.from_nanochat(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_nanochat(str(tmp_path / "nowhere"))


# ----------------------------------------------------------------------------- scripts


def _write_texts(folder, n_files=3):
    folder.mkdir()
    corpus = _corpus()
    for k in range(n_files):
        (folder / f"part{k}.txt").write_text("".join(corpus[k::n_files]), encoding="utf-8")
    return folder


def test_tok_train_and_eval_scripts(tmp_path, monkeypatch, capsys):
    from scripts import tok_eval, tok_train

    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_cache"))
    texts = _write_texts(tmp_path / "texts")
    trained = tok_train.main(["--vocab-size", "400", "--source", str(texts), "--doc-cap", "5000"])
    out = capsys.readouterr().out
    assert "Training time" in out and "MB/s" in out
    loaded = get_tokenizer()
    assert loaded.content_hash == trained.content_hash and loaded.get_vocab_size() == 400
    assert get_token_bytes().shape == (400,) and "asked" not in out
    # more than the text has to merge: the vocab it did learn, and why it is smaller than asked
    few = tmp_path / "few"
    few.mkdir()
    for k in range(4):
        (few / f"part{k}.txt").write_text("the cat sat on the mat. " * 50, encoding="utf-8")
    small = tok_train.main(["--vocab-size", "1000", "--source", str(few)]).get_vocab_size()
    assert small < 1000 and f"vocab {small:,} of the 1,000 asked: every chunk" in capsys.readouterr().out

    table = tok_eval.main(["--source", str(texts), "--compare", "gpt2"])
    out = capsys.readouterr().out
    assert "gpt2: not in tiktoken's local cache" in out
    for domain in ["prose", "code", "math", "multilingual", "source-val"]:
        assert domain in table


def test_tok_train_max_chars_and_doc_cap():
    from scripts.tok_train import capped_documents

    stats = {}
    docs = list(capped_documents(iter(["a" * 50, "b" * 50, "c" * 50, "d" * 50]), max_chars=70, doc_cap=40, stats=stats))
    assert docs == ["a" * 40, "b" * 40]  # stops once past 70 chars, each cropped to 40
    assert stats == {"chars": 80, "bytes": 80, "docs": 2}


def test_tok_train_needs_data(tmp_path, monkeypatch, capsys):
    from scripts import tok_train

    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(tmp_path))
    for argv, message in [
        ([], "no parquet shards"),
        (["--source", str(tmp_path / "missing")], "does not exist"),
        (["--source", "no-such-source"], "unknown source"),
        (["--vocab-size", "100"], "at least 265"),
    ]:
        with pytest.raises(SystemExit):
            tok_train.main(argv)
        assert message in capsys.readouterr().err


def test_source_resolution(tmp_path, monkeypatch):
    from flaxchat.data.dataset import iter_source_documents, resolve_source

    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(tmp_path))
    data = tmp_path / "base_data"
    data.mkdir()
    for k in range(3):
        pq.write_table(
            pa.table({"text": [f"shard {k} doc {j}" for j in range(4)]}),
            data / f"shard_{k:05d}.parquet",
            row_group_size=2,
        )
    # Default and shard folders: the last shard is val, as in nanochat.
    assert resolve_source(None) == ("parquet", {})
    assert resolve_source(str(data)) == ("parquet", {"data_dir": str(data)})
    assert list(iter_source_documents(None, "train")) == [f"shard {k} doc {j}" for k in range(2) for j in range(4)]
    assert list(iter_source_documents(str(data), "val")) == [f"shard 2 doc {j}" for j in range(4)]
    # Any other file or folder is flaxchat.data.dataset's "text" source; names pass through.
    single = tmp_path / "one.md"
    single.write_text("First paragraph.\n\nSecond paragraph.\n", encoding="utf-8")
    assert resolve_source(str(single)) == ("text", {"path": str(single)})
    assert resolve_source("synthetic-stories") == ("synthetic-stories", {})
    with pytest.raises(ValueError, match="pass the path"):
        resolve_source("text")


def test_cached_encoding_never_downloads(tmp_path, monkeypatch):
    from scripts.tok_eval import load_cached_encoding

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    assert load_cached_encoding("gpt2") is None or "gpt2" in tiktoken.registry.ENCODINGS
    # Stand-in for a cached encoding: a tiktoken-format file placed in the cache under its URL's key.
    url = "https://example.invalid/standin.tiktoken"
    lines = [b"%s %d" % (base64.b64encode(bytes([i])), i) for i in range(256)]
    (tmp_path / hashlib.sha1(url.encode()).hexdigest()).write_bytes(b"\n".join(lines))

    def standin():
        ranks = tiktoken.load.load_tiktoken_bpe(url)
        return {
            "name": "standin",
            "pat_str": r"\S+|\s+",
            "mergeable_ranks": ranks,
            "special_tokens": {"<|endoftext|>": 256},
        }

    tiktoken.registry.list_encoding_names()  # populate the constructor table before patching it
    monkeypatch.setitem(tiktoken.registry.ENCODING_CONSTRUCTORS, "standin", standin)
    try:
        enc = load_cached_encoding("standin")
        assert enc is not None and enc.decode(enc.encode_ordinary("hi there")) == "hi there"
        # Tokenizer.from_pretrained wraps a tiktoken encoding; its BOS is tiktoken's <|endoftext|>.
        wrapped = Tokenizer.from_pretrained("standin")
        assert wrapped.get_bos_token_id() == 256 and wrapped.encode("hi", prepend=256) == [256, 104, 105]
    finally:
        tiktoken.registry.ENCODINGS.pop("standin", None)
