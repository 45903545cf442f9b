"""Two processes on loopback (jax.distributed, CPU backend, 4 fake devices each) train like one process.

JAX is multi-controller: every process must run the same jitted programs on the global arrays, in the same order,
and take the same branches. These runs check that sampling, the SFT reply check and SFT's data-dependent end of
epoch keep the two processes in step (a process that skipped or added a program would hang or fail its peer).
"""

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = ["-m", "scripts.pretrain"]
ARGS = [
    "--depth",
    "2",
    "--aspect-ratio",
    "32",
    "--head-dim",
    "32",
    "--max-seq-len",
    "64",
    "--device-batch-size",
    "4",
    "--total-batch-size",
    "512",
    "--warmup-steps",
    "1",
    "--num-iterations",
    "4",
    "--eval-every",
    "2",
    "--eval-tokens",
    "512",
    "--sample-every",
    "-1",
    "--save-every",
    "2",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(base, argv, xla_flags, timeout=420):
    """`python *argv` as processes 0 and 1 of one job (4 CPU devices each); both must succeed. Their outputs,
    in order. xla_flags: the conftest fixture."""
    port = free_port()
    procs = []
    for pid in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": ROOT,
            "FLAXCHAT_BASE_DIR": str(base),
            "XLA_FLAGS": xla_flags(4),
            "JAX_PLATFORMS": "cpu",
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(pid),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:  # processes out of step hang in a collective: never leave them behind
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def rows(base, tag):
    with open(os.path.join(base, "base_checkpoints", tag, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_two_processes_match_one_process(tiny_base_dir, xla_flags):
    """Mesh tensor=8 spans both processes (every process holds every batch row), so both runs see the same
    data: losses and val bpb must match the single-process run on the same 8-device mesh. (Generation on
    parameters split over both hosts runs in the two-process SFT test's reply check.)"""
    from scripts.pretrain import main

    extra = ["--data", "1", "--tensor", "8"]
    run_two_processes(tiny_base_dir, PRETRAIN + ARGS + extra + ["--model-tag", "two"], xla_flags)
    main(ARGS + extra + ["--model-tag", "one"])
    two, one = rows(tiny_base_dir, "two"), rows(tiny_base_dir, "one")
    assert [r["step"] for r in two] == [r["step"] for r in one]
    for a, b in zip(two, one):
        for key in ("loss", "val_bpb"):
            if key in a:
                assert abs(a[key] - b[key]) < 1e-5 * max(1.0, abs(b[key])), (key, a, b)
    assert (tiny_base_dir / "base_checkpoints" / "two" / "4" / "commit_success.txt").exists()


@pytest.mark.slow
def test_two_processes_data_parallel_read_disjoint_data(tiny_base_dir, xla_flags):
    """Mesh data=8: each process reads its own half of the documents and builds only its rows; training
    runs to the end and the saved checkpoint holds both processes' loader states. Then one process resumes
    the run and carries the data position over."""
    dp = ["--data", "8", "--device-batch-size", "1", "--model-tag", "dp", "--eval-every", "-1"]  # data, not evals
    run_two_processes(tiny_base_dir, PRETRAIN + ARGS + dp, xla_flags)
    r = rows(tiny_base_dir, "dp")
    losses = [x["loss"] for x in r if "loss" in x]
    assert len(losses) == 4 and losses[-1] < losses[0]
    from flaxchat.train.checkpoint import Checkpointer

    ckpt = Checkpointer(str(tiny_base_dir / "base_checkpoints" / "dp"), async_save=False)
    states = ckpt.read_data_states(4)
    ckpt.close()
    assert len(states) == 2
    assert states[0]["shard"] == [0, 2] and states[1]["shard"] == [1, 2]
    taken = sum(s["documents"] + s["pipeline"]["next_doc"] - len(s["pipeline"]["buffer"]) for s in states)

    # one process resumes the two-process run: the documents the two readers still owed come first
    from scripts.pretrain import main

    main(ARGS + dp + ["--resume", "--num-iterations", "6"])
    ckpt = Checkpointer(str(tiny_base_dir / "base_checkpoints" / "dp"), async_save=False)
    (state,) = ckpt.read_data_states(6)
    ckpt.close()
    owed = sum(hi - lo for lo, hi, _ in state["prefix"])
    assert state["shard"] == [0, 1] and owed > 0 and state["first_epoch"] >= 2
    assert state["documents"] == taken and state["pipeline"]["next_doc"] < owed  # still in the owed documents
    assert [x["step"] for x in rows(tiny_base_dir, "dp") if "loss" in x] == list(range(1, 7))


# -----------------------------------------------------------------------------
# Agreeing across processes


def test_agree_max_and_to_host_on_one_process():
    """With one process agree_max hands the values back untouched (types and all); to_host reads any array."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from flaxchat.common import agree_max, from_main_process, to_host
    from flaxchat.sharding import make_mesh

    tool_output = {"text": "4"}
    assert from_main_process(tool_output) is tool_output
    last_step, progress, step = agree_max(False, 0.123456789, 7)
    assert (last_step, progress, step) == (False, 0.123456789, 7) and type(last_step) is bool and type(step) is int
    assert agree_max() == ()
    x = np.arange(16.0).reshape(2, 8)
    split = jax.device_put(x, NamedSharding(make_mesh(1, 1, 8), P(None, "tensor")))
    assert np.array_equal(to_host(split), x) and np.array_equal(to_host(x), x)


AGREE = """
import json
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from flaxchat import sharding
from flaxchat.common import agree_max, from_main_process, to_host

sharding.init_distributed()
me = jax.process_index()
x = np.arange(16.0).reshape(2, 8)
split_by_tensor = NamedSharding(sharding.make_mesh(1, 1, 8), P(None, "tensor"))
split = jax.make_array_from_callback(x.shape, split_by_tensor, lambda i: x[i])
shared = from_main_process({"tool": f"answer from process {me}", "n": me})  # e.g. a tool's output
print(json.dumps({"agreed": agree_max(me == 1, 0.25 * (me + 1), 3 - me), "host": to_host(split).tolist(),
                  "shared": shared}))
"""


@pytest.mark.slow
def test_agree_max_and_to_host_across_two_processes(tmp_path, xla_flags):
    """Each process brings its own values and gets every value's maximum, in its own type; an array split over
    both processes' devices reads whole on each; process 0's object reaches both."""
    outs = run_two_processes(tmp_path, ["-c", AGREE], xla_flags, timeout=120)
    for out in outs:
        result = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
        assert result["agreed"] == [True, 0.5, 3]
        assert result["host"] == [list(range(8)), list(range(8, 16))]
        assert result["shared"] == {"tool": "answer from process 0", "n": 0}


# -----------------------------------------------------------------------------
# SFT: an end of epoch each process sees at its own step, and the reply check

SFT = [
    "-m",
    "scripts.sft",
    "--mixture",
    "offline",
    "--mc-epochs",
    "0",
    "--identity-size",
    "5",
    "--arithmetic-size",
    "20",
    "--story-size",
    "0",
    "--spelling-size",
    "0",
    "--val-size",
    "4",
    "--load-optimizer",
    "0",
    "--data",
    "8",
    "--device-batch-size",
    "1",
    "--total-batch-size",
    "512",
    "--eval-every",
    "-1",
    "--eval-tokens",
    "512",
    "--chatcore-every",
    "-1",
    "--reply-check",
    "2",
]


@pytest.fixture
def sft_base_dir(tiny_base_dir):
    """A depth-2 base checkpoint (no optimizer) whose context (128) leaves the reply check room after a prompt;
    its meta says it was pretrained on 64-token rows, which SFT inherits."""
    from flax import nnx

    from flaxchat.data.tokenizer import get_tokenizer
    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT
    from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir

    model = GPT(GPTConfig.from_depth(2, 32, 32, 128, "L", get_tokenizer().get_vocab_size()), rngs=nnx.Rngs(0))
    ckpt = Checkpointer(checkpoint_dir("base", "d2"), async_save=False)
    ckpt.save(1, model, meta={"user_config": {}, "max_seq_len": 64, "device_batch_size": 1, "total_batch_size": 512})
    ckpt.close()
    return tiny_base_dir


def epoch_steps(dataset, tokenizer, reader) -> int:
    """Steps until this reader's SFT loader (4 rows of 64 tokens a step, as each process has) ends its epoch."""
    from flaxchat.data.chat_data import SFTLoader

    loader, steps = SFTLoader(dataset, tokenizer, 4, 64, reader=reader), 0
    while not loader.last_step:
        next(loader)
        steps += 1
    return steps


@pytest.mark.slow
def test_two_process_sft_agrees_on_its_last_step(sft_base_dir, xla_flags):
    """Mesh data=8: each process reads its own conversations and, on its own, would end the epoch at a different
    step. Both stop at the first process's end (MAX of last_step, as nanochat), train with one LR schedule, save
    the same checkpoint and run the reply check together; only process 0 prints and logs."""
    from flaxchat.data.tokenizer import get_tokenizer
    from scripts.sft import build_parser
    from tasks.mixtures import build_mixtures

    train, _, _ = build_mixtures(build_parser().parse_args(SFT[2:]))
    own = [epoch_steps(train, get_tokenizer(), (rank, 2)) for rank in range(2)]
    assert own[0] != own[1], own  # without agreement the processes would part ways
    steps = min(own)

    out0, out1 = run_two_processes(sft_base_dir, SFT, xla_flags, timeout=300)
    assert f"SFT done: {steps} steps" in out0 and "SFT done" not in out1
    assert "replies ending with <|assistant_end|>" in out0 and "of 2" in out0 and "replies ending" not in out1
    out = sft_base_dir / "chatsft_checkpoints" / "d2"
    with open(out / "metrics.jsonl") as f:
        logged = [json.loads(line) for line in f]
    trained = [r for r in logged if "loss" in r]
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    progress = [r["progress"] for r in trained]
    assert progress == sorted(progress) and progress[-1] >= 1.0
    assert any("reply_end_rate" in r for r in logged)
    assert sorted(p.name for p in out.iterdir() if p.name.isdigit()) == [str(steps)]
