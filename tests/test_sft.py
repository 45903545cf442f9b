"""SFT: masked targets, the padded best-fit loader, nanochat's schedules, warm start, and a tiny end-to-end run."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat.data.chat_data import SFTLoader, conversation_targets
from flaxchat.train.sft import lr_multiplier, muon_momentum

SFT_TINY = [
    "--mixture",
    "offline",
    "--mc-epochs",
    "0",
    "--identity-size",
    "150",
    "--arithmetic-size",
    "250",
    "--story-size",
    "0",
    "--spelling-size",
    "50",
    "--val-size",
    "16",
    "--device-batch-size",
    "2",
    "--total-batch-size",
    "2048",
    "--eval-tokens",
    "2048",
    "--chatcore-every",
    "-1",
]


@pytest.fixture(scope="module")
def tiny_base_ckpt(tiny_corpus, tmp_path_factory):
    """A depth-2, width-64 base checkpoint (model + optimizer + pretraining's meta) after one training step, so
    the optimizer moments are non-zero. Built once; tests copy it in with `install_base`."""
    from flaxchat.data.tokenizer import Tokenizer
    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT
    from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir
    from flaxchat.train.optim import Schedule, build_optimizer
    from flaxchat.train.step import train_step

    root = tmp_path_factory.mktemp("sft_base")
    vocab = Tokenizer.load(str(tiny_corpus / "tokenizer")).get_vocab_size()
    model = GPT(GPTConfig.from_depth(2, 32, 32, 64, "L", vocab), rngs=nnx.Rngs(0))
    optimizer = build_optimizer(model, schedule=Schedule(10, warmup_steps=0))
    x = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (2, 64)), jnp.int32)
    train_step(model, optimizer, (x,), (x,))
    ckpt = Checkpointer(checkpoint_dir("base", "d2", str(root)), async_save=False)
    meta = {
        "user_config": {"embedding_lr": 0.3, "unembedding_lr": 0.008, "matrix_lr": 0.02},
        "max_seq_len": 64,
        "device_batch_size": 2,
        "total_batch_size": 2048,
        "val_bpb": None,
    }
    ckpt.save(1, model, optimizer, meta=meta)
    ckpt.close()
    return root, jax.tree.map(np.asarray, nnx.state(optimizer)["opt_state"]["inner_state"])


def install_base(tiny_base_ckpt, base_dir):
    shutil.copytree(tiny_base_ckpt[0] / "base_checkpoints", base_dir / "base_checkpoints")


def write_words(base_dir):
    """A tiny word list where SpellingBee looks for the offline pack."""
    os.makedirs(base_dir / "eval_data", exist_ok=True)
    (base_dir / "eval_data" / "words.txt").write_text(
        "\n".join(["apple", "banana", "cherry", "strawberry", "river", "garden", "window", "letter"])
    )


# -----------------------------------------------------------------------------
# Masks and batches


def test_targets_count_only_assistant_tokens(tiny_base_dir):
    from flaxchat.data.tokenizer import get_tokenizer
    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT
    from tasks.synthetic_chat import arithmetic_problem

    tok = get_tokenizer()
    conversation = arithmetic_problem(0).conversation()
    conversation["messages"] += [{"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "Any time!"}]
    ids, mask = tok.render_conversation(conversation)
    inputs, targets = conversation_targets(ids, mask)
    assert np.array_equal(targets >= 0, np.asarray(mask[1:]) == 1)
    supervised = tok.decode([t for t in targets if t >= 0])
    assert "Thanks!" not in supervised and "#### " in supervised and "Any time!" in supervised
    out_start, bos = tok.encode_special("<|output_start|>"), tok.get_bos_token_id()
    assert out_start not in targets and bos not in targets  # tool output and BOS are never targets
    assert np.sum(targets == tok.encode_special("<|assistant_end|>")) == 2

    # the model's mean loss equals the mean NLL over exactly the assistant positions
    model = GPT(GPTConfig.from_depth(2, 32, 32, 64, "L", tok.get_vocab_size()), rngs=nnx.Rngs(1))
    x, y = jnp.asarray(inputs[None, -64:]), jnp.asarray(targets[None, -64:])  # ends on the assistant replies
    logp = jax.nn.log_softmax(model(x), axis=-1)[0]
    keep = np.asarray(y[0]) >= 0
    manual = -np.mean(np.asarray(logp)[np.arange(64)[keep], np.asarray(y[0])[keep]])
    assert float(model(x, y)) == pytest.approx(manual, rel=1e-5)


def split_row(row, mask, bos):
    """A packed row -> (conversations, padding length): conversations start at a BOS; trailing BOSes are padding."""
    pad = 0
    while pad < len(row) and row[len(row) - 1 - pad] == bos:
        pad += 1
    assert all(m == 0 for m in mask[len(row) - pad :])  # padding is never supervised
    content = row[: len(row) - pad]
    starts = [i for i, t in enumerate(content) if t == bos] + [len(content)]
    assert not content or starts[0] == 0  # every row begins with a conversation's BOS
    return [tuple(content[a:b]) for a, b in zip(starts, starts[1:])], pad


def test_rows_hold_whole_conversations_padded_not_cropped(tiny_base_dir):
    from flaxchat.data.tokenizer import get_tokenizer

    tok = get_tokenizer()
    data = [
        {
            "messages": [
                {"role": "user", "content": f"Say {i}" + " please" * (i % 7)},
                {"role": "assistant", "content": "ok " * (1 + i % 11)},
            ]
        }
        for i in range(60)
    ]
    # a conversation longer than a row (T + 1 = 49 tokens) is cut to fit an empty row; all others stay whole
    originals = {tuple(tok.render_conversation(c, max_tokens=49)[0]) for c in data}
    assert max(len(tok.render_conversation(c)[0]) for c in data) > 49
    loader = SFTLoader(data, tok, batch_size=3, seq_len=48, buffer_size=8)
    seen, pads = [], 0
    while loader.consumed < len(data):  # one epoch (the buffer holds 8 conversations of the next one)
        row, mask = loader._row()
        assert len(row) == len(mask) == 49
        conversations, pad = split_row(row, mask, tok.get_bos_token_id())
        seen += conversations
        pads += pad
    buffered = {tuple(ids) for ids, _ in loader.buffer}  # best-fit leaves some behind while the next epoch flows in
    assert set(seen) <= originals and set(seen) | buffered == originals and pads > 0


def test_batches_are_static_and_one_epoch_long(tiny_base_dir):
    from flaxchat.data.tokenizer import get_tokenizer

    tok = get_tokenizer()
    data = [
        {"messages": [{"role": "user", "content": f"Hello {i}"}, {"role": "assistant", "content": "Hi " * (i % 9 + 1)}]}
        for i in range(50)
    ]
    loader = SFTLoader(data, tok, batch_size=3, seq_len=48, buffer_size=8)
    progress = []
    while not loader.last_step:
        x, y = next(loader)
        assert x.shape == y.shape == (3, 48) and x.dtype == y.dtype == np.int32
        assert np.all(x[:, 0] == tok.get_bos_token_id()) and np.all(y[:, 0] == -1)  # rows start a conversation
        progress.append(loader.progress)
    assert progress == sorted(progress) and progress[-1] >= 1.0 > progress[-2] and loader.consumed >= 50


def test_loader_stops_at_num_iterations(tiny_base_dir):
    from flaxchat.data.tokenizer import get_tokenizer
    from tasks.synthetic_chat import IdentityChat

    loader = SFTLoader(IdentityChat(500), get_tokenizer(), batch_size=2, seq_len=64, num_batches=3)
    flags = []
    for _ in range(3):
        next(loader)
        flags.append(loader.last_step)
    assert flags == [False, False, True] and loader.progress == 1.0


def test_schedules_follow_chat_sft():
    assert lr_multiplier(0.0, 0.0, 0.5, 0.0) == 1.0
    assert lr_multiplier(0.5, 0.0, 0.5, 0.0) == 1.0
    assert lr_multiplier(0.75, 0.0, 0.5, 0.0) == pytest.approx(0.5)
    assert lr_multiplier(1.0, 0.0, 0.5, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(0.05, 0.1, 0.5, 0.0) == pytest.approx(0.5, abs=1e-6)
    assert muon_momentum(0) == 0.85 and muon_momentum(150) == pytest.approx(0.90) and muon_momentum(1000) == 0.95


# -----------------------------------------------------------------------------
# Warm start and an end-to-end run


def test_optimizer_state_warm_start(tiny_base_dir, tiny_base_ckpt):
    from flaxchat.sharding import make_mesh
    from flaxchat.train.sft import restore_base

    install_base(tiny_base_ckpt, tiny_base_dir)
    saved = tiny_base_ckpt[1]
    restored_model, inner, meta, step = restore_base("d2", None, make_mesh(), jnp.float32, with_optimizer=True)
    assert step == 1 and meta["max_seq_len"] == 64
    leaves_a, leaves_b = jax.tree.leaves(saved), jax.tree.leaves(inner)
    assert len(leaves_a) == len(leaves_b) and any(float(jnp.abs(a).sum()) > 0 for a in leaves_a)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(leaves_a, leaves_b))
    _, none, _, _ = restore_base("d2", None, make_mesh(), jnp.float32, with_optimizer=False)
    assert none is None


def test_tiny_sft_run_lowers_val_loss(tiny_base_dir, tiny_base_ckpt):
    from flaxchat.train.checkpoint import load_model
    from scripts.sft import main

    install_base(tiny_base_ckpt, tiny_base_dir)
    write_words(tiny_base_dir)
    # one step in flight (the GPU/TPU default): the evaluations and the save wait for it
    result = main(
        SFT_TINY
        + [
            "--num-iterations",
            "8",
            "--eval-every",
            "4",
            "--reply-check",
            "2",
            "--embedding-lr",
            "0.1",
            "--in-flight",
            "on",
        ]
    )
    out = tiny_base_dir / "chatsft_checkpoints" / "d2"
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    bpbs = [r["val_bpb"] for r in rows if "val_bpb" in r]
    assert len(bpbs) == 3 and bpbs[-1] < bpbs[0] - 0.2, bpbs
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))
    # steps run one ahead of their logging; each evaluation still comes after the steps before it
    assert [(r["step"], "val_bpb" in r) for r in rows if "loss" in r or "val_bpb" in r] == (
        [(0, True)] + [(i, False) for i in range(1, 5)] + [(4, True)] + [(i, False) for i in range(5, 9)] + [(8, True)]
    )
    assert 0.0 <= result["reply_end_rate"] <= 1.0 and (out / "8").is_dir() and (out / "training.png").exists()
    model, _, meta = load_model("sft", "d2")
    assert (
        meta["step"] == 8
        and meta["mixture"] == "offline"
        and {k: v for k, v in meta["base"].items() if k != "saved_at"}
        == {"phase": "base", "model_tag": "d2", "step": 1}
    )
    assert meta["user_config"]["embedding_lr"] == 0.1 and meta["max_seq_len"] == 64  # flag wins, rest inherited


def test_bad_input_is_a_one_line_error(tiny_base_dir, tiny_base_ckpt, capsys):
    from scripts.sft import main

    with pytest.raises(SystemExit, match="no base checkpoints"):
        main(SFT_TINY)
    install_base(tiny_base_ckpt, tiny_base_dir)
    for argv, message in [
        (["--warmup-ratio", "0.6", "--warmdown-ratio", "0.6"], "at most 1"),
        (["--total-batch-size", "1000"], "not a multiple"),
        (["--max-seq-len", "128"], "exceeds the model's context"),
    ]:
        with pytest.raises(SystemExit):
            main(SFT_TINY + argv)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit, match="offline pack|--mc-epochs 0"):  # asked for by name: an error
        main(SFT_TINY[:2] + ["--mc-epochs", "2"] + SFT_TINY[4:])


def test_the_default_offline_mixture_leaves_out_what_this_machine_lacks(tmp_path, monkeypatch, capsys):
    """A laptop without the offline packs or a word list still fine-tunes: the default parts it lacks are left out
    with a note; a part asked for by name is an error."""
    import tasks.spellingbee
    from scripts.sft import build_parser
    from tasks.mixtures import offline_mixture

    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(tmp_path))  # no eval_data/ packs here
    monkeypatch.setattr(tasks.spellingbee.offline, "SYSTEM_DICT", str(tmp_path / "no-dict"))
    tasks.spellingbee.load_words.cache_clear()
    try:
        sizes = ["--identity-size", "5", "--arithmetic-size", "5", "--story-size", "5", "--multi-turn-size", "5"]
        train, val = offline_mixture(build_parser().parse_args(sizes))
        assert len(train) == 20
        out = capsys.readouterr().out
        assert "leaving out --spelling-size" in out and "leaving out --mc-epochs" in out
        with pytest.raises(FileNotFoundError, match="word list"):
            offline_mixture(build_parser().parse_args(["--spelling-size", "7"]))
    finally:
        tasks.spellingbee.load_words.cache_clear()


def test_a_new_run_replaces_an_earlier_runs_checkpoints(tmp_path):
    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT
    from flaxchat.train.checkpoint import Checkpointer

    model = GPT(GPTConfig.from_depth(2, 32, 32, 64, "L", 64), rngs=nnx.Rngs(0))
    ckpt = Checkpointer(str(tmp_path / "run"), keep=3, keep_best=0, async_save=False)
    for step in (5, 9):  # an earlier, longer run
        ckpt.save(step, model)
    ckpt.replace_earlier_run()
    ckpt.save(4, model)  # this run's only checkpoint must be the one load_model picks
    assert ckpt.all_steps() == [4] and ckpt.latest_step() == 4
    ckpt.close()


def test_evaluation_sizes_follow_the_device_unless_set():
    from flaxchat.eval.chat import CPU_CHATCORE_CAT, CPU_EVAL_BATCHES, sized_evaluation
    from scripts.sft import build_parser

    args = build_parser().parse_args(["--max-seq-len", "256"])
    line = sized_evaluation(args, 4, on_cpu=True)
    assert args.eval_tokens == CPU_EVAL_BATCHES * 4 * 256 and args.chatcore_max_cat == CPU_CHATCORE_CAT
    assert f"{args.eval_tokens:,} val tokens" in line and "CPU defaults" in line
    args = build_parser().parse_args(["--max-seq-len", "256"])
    sized_evaluation(args, 4, on_cpu=False)
    assert args.eval_tokens == 40 * 524288 and args.chatcore_max_cat == -1  # nanochat's, on GPUs and TPUs
    args = build_parser().parse_args(["--eval-tokens", "999", "--chatcore-max-cat", "5"])
    assert "999 val tokens a pass, 5 categorical" in sized_evaluation(args, 4, on_cpu=True)  # flags win


def test_the_default_chatcore_leaves_out_tasks_without_data(monkeypatch, capsys):
    import flaxchat.eval.chat as chat_eval
    from flaxchat.generate.sandbox import SandboxUnavailable
    from scripts.sft import build_parser

    def run_chat_eval(name, *args, **kwargs):
        if name == "HumanEval":
            raise SandboxUnavailable("no operating-system sandbox can run here (test)")
        if name != "MMLU":
            raise FileNotFoundError(f"{name} is not available")
        return {"accuracy": 0.5}

    monkeypatch.setattr(chat_eval, "Engine", lambda model, tokenizer: None)
    monkeypatch.setattr(chat_eval, "run_chat_eval", run_chat_eval)

    def chatcore(tasks=build_parser().get_default("chatcore_tasks")):  # scripts.sft's default: the five tasks
        return chat_eval.run_chatcore(None, None, tasks, 10, 10, 8, "offline")

    result = chatcore()
    assert result["chatcore_tasks"] == 1 and result["chatcore/MMLU"] == 0.5
    out = capsys.readouterr().out
    assert "leaving out GSM8K" in out and "leaving out HumanEval: no operating-system sandbox" in out
    with pytest.raises(FileNotFoundError, match="GSM8K is not available"):  # named: its data must be there
        chatcore("GSM8K,MMLU")
    with pytest.raises(SandboxUnavailable):  # named: it must run, in a real sandbox
        chatcore("HumanEval,MMLU")
