import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# depth 2, width 64 (2 heads of 32), seq 64, 8 fake devices x 2 rows = 16 x 64 tokens per micro-step
TINY = [
    "--depth",
    "2",
    "--aspect-ratio",
    "32",
    "--head-dim",
    "32",
    "--max-seq-len",
    "64",
    "--device-batch-size",
    "2",
    "--total-batch-size",
    "2048",
    "--warmup-steps",
    "2",
    "--eval-tokens",
    "2048",
    "--sample-every",
    "-1",
    "--core-metric-every",
    "-1",
]


def metrics(base, tag):
    with open(os.path.join(base, "base_checkpoints", tag, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(rows):
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_pretrain_smoke_loss_goes_down(tiny_base_dir, capsys):
    from flaxchat.perf.machine import cpu_bf16_instructions
    from scripts.pretrain import main

    # one step in flight (the GPU/TPU default): evaluations and the final save wait for it
    loop = main(TINY + ["--num-iterations", "10", "--eval-every", "5", "--model-tag", "smoke", "--in-flight", "on"])
    # an fp32 run on a CPU that multiplies bf16 in hardware is told of --dtype bfloat16
    bf16_tip = "trains faster than fp32 here" in capsys.readouterr().out
    assert bf16_tip == (jax.default_backend() == "cpu" and cpu_bf16_instructions())
    rows = metrics(tiny_base_dir, "smoke")
    ls = losses(rows)
    assert sorted(ls) == list(range(1, 11))
    # steps run one ahead of their logging; an evaluation still comes after the steps before it
    order = [(r["step"], "val_bpb" in r) for r in rows if "loss" in r or "val_bpb" in r]
    assert order == (
        [(0, True)]
        + [(i, False) for i in range(1, 6)]
        + [(5, True)]
        + [(i, False) for i in range(6, 11)]
        + [(10, True)]
    ), order
    assert ls[10] < ls[1] - 0.3, ls
    bpbs = [r["val_bpb"] for r in rows if "val_bpb" in r]
    assert len(bpbs) == 3 and bpbs[-1] < bpbs[0]
    assert loop["min_val_bpb"] == min(bpbs)
    out = tiny_base_dir / "base_checkpoints" / "smoke"
    assert (out / "training.png").exists() and (out / "10").is_dir()
    # each step waited for (the CPU default) trains the same numbers
    main(TINY + ["--num-iterations", "10", "--eval-every", "-1", "--model-tag", "waited"])
    assert losses(metrics(tiny_base_dir, "waited")) == ls


@pytest.mark.slow
def test_resume_after_hard_kill_is_bit_identical(tiny_base_dir):
    """N straight steps == N/2 steps, SIGKILL, resume, N/2 steps: identical losses and parameters."""
    from flaxchat.export.nanochat import to_nanochat_state_dict
    from flaxchat.train.checkpoint import load_model
    from scripts.pretrain import main

    args = TINY + ["--num-iterations", "6", "--eval-every", "-1", "--save-every", "3"]
    main(args + ["--model-tag", "straight"])

    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(
        [sys.executable, "-m", "scripts.pretrain", *args, "--model-tag", "killed"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    committed = tiny_base_dir / "base_checkpoints" / "killed" / "3" / "commit_success.txt"
    deadline = time.time() + 240
    while not committed.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert committed.exists(), "the step-3 checkpoint never committed"

    main(args + ["--model-tag", "killed", "--resume"])
    straight, resumed = losses(metrics(tiny_base_dir, "straight")), losses(metrics(tiny_base_dir, "killed"))
    assert straight == resumed  # bit-identical, every step 1..6
    a, _, _ = load_model("base", "straight")
    b, _, _ = load_model("base", "killed")
    sa, sb = to_nanochat_state_dict(a), to_nanochat_state_dict(b)
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)


def _documents(base, tag, step):
    """Documents trained on so far, summed over the run's readers, from the checkpoint's loader states."""
    from flaxchat.train.checkpoint import Checkpointer

    ckpt = Checkpointer(str(base / "base_checkpoints" / tag), async_save=False)
    states = {tuple(s["shard"]): s for s in ckpt.read_data_states(step)}.values()
    ckpt.close()
    return sum(s["documents"] + s["pipeline"]["next_doc"] - len(s["pipeline"]["buffer"]) for s in states)


@pytest.mark.slow
def test_resume_on_other_device_counts_continues(tiny_base_dir, xla_flags):
    """8 devices to step 2, 4 devices (killed after step 4's checkpoint), 8 devices to step 6: the losses follow
    the uninterrupted 8-device run (accumulation and reduction order differ) and the same documents are seen."""
    import shutil

    from scripts.pretrain import main

    args = TINY + ["--num-iterations", "6", "--eval-every", "-1", "--save-every", "2", "--keep", "5"]
    main(args + ["--model-tag", "straight"])
    runs = tiny_base_dir / "base_checkpoints"
    shutil.copytree(runs / "straight", runs / "elastic", ignore=shutil.ignore_patterns("4", "6"))

    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": xla_flags(4)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "scripts.pretrain", *args, "--model-tag", "elastic", "--resume"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    committed = runs / "elastic" / "4" / "commit_success.txt"
    deadline = time.time() + 240
    while not committed.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    out = proc.communicate()[0]
    assert committed.exists() and not (runs / "elastic" / "6").exists(), out[-3000:]
    assert "devices: 4 x cpu" in out and "resumed from step 2" in out, out[-3000:]

    main(args + ["--model-tag", "elastic", "--resume"])
    straight, elastic = losses(metrics(tiny_base_dir, "straight")), losses(metrics(tiny_base_dir, "elastic"))
    assert sorted(elastic) == list(range(1, 7))
    for k in range(1, 7):
        assert abs(elastic[k] - straight[k]) < 1e-4 * straight[k], (k, straight, elastic)
    assert _documents(tiny_base_dir, "elastic", 6) == _documents(tiny_base_dir, "straight", 6) > 0


def test_bad_flags_are_one_line_errors(tiny_base_dir, capsys):
    from scripts.pretrain import main

    for argv, message in [
        (TINY + ["--window-pattern", "SXL"], "only contain S and L"),
        (TINY + ["--total-batch-size", "1000"], "not a multiple"),
        (TINY + ["--num-iterations", "-1", "--target-param-data-ratio", "-1"], "horizon"),
        (TINY + ["--data", "3"], "divide"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err


def test_resume_without_checkpoint_says_so(tiny_base_dir):
    from scripts.pretrain import main

    with pytest.raises(SystemExit, match="no checkpoint"):
        main(TINY + ["--num-iterations", "2", "--resume", "--model-tag", "nothing"])


def test_a_fresh_run_replaces_an_earlier_runs_checkpoints(tiny_base_dir, capsys):
    """Rerunning without --resume under the same tag (the demo's --fresh does) replaces the earlier model: the
    step both runs save does not clash and the earlier run's later step is not left to be picked as the latest."""
    from flaxchat.train.checkpoint import Checkpointer
    from scripts.pretrain import main

    args = TINY + ["--eval-every", "-1", "--model-tag", "again"]
    main(args + ["--num-iterations", "4", "--save-every", "2", "--keep", "5"])
    out = str(tiny_base_dir / "base_checkpoints" / "again")
    assert Checkpointer(out, async_save=False).all_steps() == [2, 4]
    main(args + ["--num-iterations", "2"])
    out_text = capsys.readouterr().out
    assert "replacing the checkpoints of an earlier run" in out_text
    assert "min val bpb: not evaluated" in out_text  # --eval-every -1: no val bpb, not "inf"
    assert "| min val bpb | not evaluated |" in (tiny_base_dir / "report" / "pretrain.md").read_text()
    assert Checkpointer(out, async_save=False).all_steps() == [2]
    assert sorted(losses(metrics(tiny_base_dir, "again"))) == [1, 2]


@pytest.mark.slow
def test_profile_steps_writes_a_trace_and_where_its_time_went(tiny_base_dir, capsys, monkeypatch):
    from scripts.pretrain import main

    monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"])  # --profile-steps adds a GPU flag (restored after)

    # with a step in flight (the loop then finishes it before and after each profiled step)
    main(
        TINY
        + [
            "--num-iterations",
            "4",
            "--eval-every",
            "-1",
            "--profile-steps",
            "1:3",
            "--model-tag",
            "prof",
            "--in-flight",
            "on",
        ]
    )
    profile = tiny_base_dir / "base_checkpoints" / "prof" / "profile"
    traces = list(profile.rglob("perfetto_trace.json.gz"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    import gzip

    events = json.load(gzip.open(traces[0]))["traceEvents"]
    assert {e.get("args", {}).get("step_num") for e in events if e.get("name") == "step"} >= {"1", "2"}
    # the summary beside it: two steps, kinds and source lines read off the compiled train step
    summary = json.loads((profile / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["by_kind"]["matmul"]["ms"] > 0 and 0 < summary["busy"] <= 1
    assert any(t.get("source", "").startswith("flaxchat/") for t in summary["top"])
    assert "the profiled steps: " in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["3", "5:2", "a:b"])
def test_profile_steps_rejects_bad_ranges(spec, capsys):
    from scripts.pretrain import main

    with pytest.raises(SystemExit):
        main(TINY + ["--num-iterations", "4", "--profile-steps", spec])
    assert "--profile-steps" in capsys.readouterr().err
