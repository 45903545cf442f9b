"""scripts.bench: JSON out, the training benchmark on the flags' mesh, the comms reader, backend checks."""

import ctypes
import json
import os
import subprocess
import sys

import pytest

from flaxchat.perf.machine import MALLOC_LIBRARIES
from scripts.bench import main

TINY = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64", "--vocab-size", "512"]


def run(capsys, argv):
    main(argv)
    return json.loads(capsys.readouterr().out)  # stdout holds the JSON and nothing else


@pytest.mark.eight_devices
@pytest.mark.slow
def test_train_runs_on_the_mesh_the_flags_build(capsys):
    out = run(
        capsys, TINY + ["--what", "train", "--device-batch-size", "1", "--fsdp", "2", "--steps", "2", "--warmup", "0"]
    )
    assert out["mesh"] == {"data": 4, "fsdp": 2, "tensor": 1}
    assert out["tokens_per_step"] == 8 * 64  # one row per device
    assert out["tok_per_s"] > 0 and 0 < out["mfu"] < 100 and out["compile_s"] >= 0
    assert out["attention"] == "chunked" and out["remat"] == "none" and out["in_flight"] is False
    assert out["allocator"] in ("system", *MALLOC_LIBRARIES) and isinstance(out["huge_pages"], bool)
    assert out["xla_flags"] == os.environ.get("XLA_FLAGS", "")  # no CUDA plugin here: left as they were


@pytest.mark.eight_devices
def test_comms_reads_the_compiled_step(capsys):
    out = run(capsys, TINY + ["--what", "comms", "--device-batch-size", "2", "--grad-accum", "2", "--show-ops"])
    assert out["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
    assert out["collectives_per_step"] == sum(v["count"] for v in out["by_kind"].values())
    assert out["by_kind"]["all-reduce"]["count"] == 2  # the gradients (once per step) and the token counts
    assert out["matmul_flops_per_device"] > 0 and out["unknown_trip_counts"] == 0
    assert all(op["times"] == 1 for op in out["ops"])  # nothing inside the micro-step loop


def test_expect_backend_stops_a_run_on_the_wrong_backend(capsys):
    with pytest.raises(SystemExit):
        main(TINY + ["--what", "comms", "--expect-backend", "gpu"])
    assert "--expect-backend gpu: JAX is running on cpu" in capsys.readouterr().err


@pytest.mark.slow
def test_suite_prints_one_line_per_shape_and_reads_real_batches(capsys, monkeypatch, tiny_base_dir):
    import scripts.bench as bench

    tiny = dict(depth=2, head_dim=32, aspect_ratio=32, max_seq_len=64, device_batch_size=1)
    monkeypatch.setattr(
        bench,
        "CPU_SUITE",
        {"random": {**tiny, "vocab_size": 512}, "real": {**tiny, "grad_accum": 2, "real_data": True}},
    )
    main(["--what", "train", "--suite", "cpu", "--steps", "2", "--warmup", "0"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["shape"] for r in rows] == ["random", "real"]
    assert rows[0]["data"] == "random tokens" and rows[0]["grad_accum"] == 1
    assert rows[1]["data"] == "grain loader" and rows[1]["grad_accum"] == 2
    assert rows[1]["config"]["vocab_size"] == 512  # the tiny corpus's tokenizer
    assert all(r["tok_per_s"] > 0 for r in rows)


@pytest.mark.slow
def test_batches_placed_afresh_or_cycled_from_the_loader(capsys, tiny_base_dir):
    tiny = TINY[:-2] + [
        "--what",
        "train",
        "--device-batch-size",
        "1",
        "--grad-accum",
        "2",
        "--steps",
        "3",
        "--warmup",
        "0",
    ]
    fresh = run(capsys, tiny + ["--fresh-batches"])
    cycled = run(capsys, tiny + ["--real-data", "--cycle-batches", "2"])
    assert fresh["data"] == "random tokens, new arrays every step" and fresh["config"]["vocab_size"] == 32768
    assert cycled["data"] == "grain loader's first 2 steps, cycled" and cycled["config"]["vocab_size"] == 512
    assert all(r["tok_per_s"] > 0 and len(r["times_s"]) == 3 for r in (fresh, cycled))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cycle-batches", "2"], "use it with --real-data"),
        (["--real-data", "--cycle-batches", "-1"], "use it with --real-data"),
        (["--real-data", "--fresh-batches"], "--fresh-batches draws random tokens"),
    ],
)
def test_batch_flags_that_do_not_go_together_are_one_line(capsys, flags, message):
    with pytest.raises(SystemExit):
        main(TINY + ["--what", "train"] + flags)
    assert message in capsys.readouterr().err


def test_in_flight_times_every_step_with_the_next_dispatched_first(capsys):
    out = run(
        capsys, TINY + ["--what", "train", "--device-batch-size", "1", "--steps", "3", "--warmup", "0", "--in-flight"]
    )
    assert out["in_flight"] is True and out["tok_per_s"] > 0 and out["step_s_min"] <= out["step_s"]
    assert len(out["times_s"]) == 3 and min(out["times_s"]) == out["step_s_min"]  # every timed step, in order


def test_generate_times_speculative_sampling_between_checkpoints(capsys, tiny_base_dir):
    from flax import nnx

    from flaxchat.data.tokenizer import get_tokenizer
    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT
    from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir

    vocab = get_tokenizer().get_vocab_size()
    for tag, layers in (("d2", 2), ("d1", 1)):
        config = GPTConfig(sequence_len=64, vocab_size=vocab, n_layer=layers, n_head=2, n_kv_head=2, n_embd=64)
        ckpt = Checkpointer(checkpoint_dir("sft", tag), async_save=False)
        ckpt.save(1, GPT(config, rngs=nnx.Rngs(layers)))
        ckpt.close()
    out = run(
        capsys,
        [
            "--what",
            "generate",
            "--checkpoint",
            "sft:d2",
            "--draft-model",
            "d1",
            "--draft-steps",
            "2",
            "--max-new-tokens",
            "8",
            "-t",
            "0",
        ],
    )
    assert out["speculative"] and out["checkpoint"] == "sft:d2" and out["draft_model"] == "d1"
    assert out["tok_per_s"] > 0 and out["plain_tok_per_s"] > 0 and 0 <= out["acceptance_rate"] <= 1
    with pytest.raises(SystemExit):
        main(["--what", "generate", "--draft-model", "d1"])
    assert "--draft-model needs --checkpoint" in capsys.readouterr().err


def test_nanochat_is_timed_before_us_each_round_on_the_same_shape(capsys, monkeypatch, tmp_path, nanochat_checkout):
    """Each round times nanochat first; --profile-steps adds where both steps' time goes (flaxchat's profiled steps
    summed by op and kind, kinds read off the compiled step; nanochat's under torch.profiler, summed the same way)."""
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1")
    monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"])  # --profile-steps adds a GPU flag (restored after)
    from flaxchat.perf.machine import MachineLoad

    stops, stop = [], MachineLoad.stop  # the third round's nanochat ran while the VM's host was busy (steal)

    def stop_with_steal(self, end=None):  # the others on a quiet host, whatever this one's host is doing now
        stops.append(stop(self, end))
        return {**stops[-1], "steal_pct": 30.0 if len(stops) == 5 else 0.0}

    monkeypatch.setattr(MachineLoad, "stop", stop_with_steal)
    main(
        TINY
        + [
            "--what",
            "train",
            "--device-batch-size",
            "2",
            "--grad-accum",
            "2",
            "--steps",
            "2",
            "--warmup",
            "0",
            "--rounds",
            "3",
            "--nanochat",
            str(nanochat_checkout),
            "--profile-steps",
            "2:4",
            "--profile-dir",
            str(tmp_path / "prof"),
            "--nanochat-mkl",
            "avx512",
        ]
    )
    printed = capsys.readouterr()
    out = json.loads(printed.out)
    assert (
        "warning: round 3: other guests of this VM's host took over 5% of the CPU time while nanochat ran"
        in printed.err
    )
    assert out["noisy_rounds"] == [3] and [r.get("noisy", False) for r in out["rounds"]] == [False, False, True]
    ours, theirs = out["profile"], out["nanochat"]["profile"]
    assert ours["steps"] == 2 and ours["device"] == "cpu" and ours["trace"].startswith(str(tmp_path / "prof"))
    assert ours["by_kind"]["matmul"]["ms"] > 0 and ours["op_ms_per_step"] > 0
    assert "other" not in {t["kind"] for t in ours["top"]}  # every op of the step has its kind from the program
    modules = (
        "flaxchat/model/gpt.py:",
        "flaxchat/model/loss.py:",
        "flaxchat/model/attention.py:",
        "flaxchat/train/optim.py:",
        "flaxchat/train/muon.py:",
    )
    assert any(t.get("source", "").startswith(modules) for t in ours["top"])  # and its source line
    assert theirs["steps"] == 2 and theirs["by_kind"]["matmul"]["ms"] > 0  # the stand-in's lm_head
    assert any(t["op"].startswith("aten::") for t in theirs["top"])
    assert len(out["rounds"]) == 3
    for r in out["rounds"]:
        assert r["nanochat"]["tok_per_s"] > 0 and r["nanochat"]["threads"] >= 1 and r["nanochat"]["dtype"] == "float32"
        assert r["nanochat"]["mkl"] == "avx512" and r["nanochat"]["matmul_peak_flops"] > 0  # its torch's fp32 rate
        assert r["vs_nanochat"] == pytest.approx(r["tok_per_s"] / r["nanochat"]["tok_per_s"])
        for machine in (r["machine"], r["nanochat"]["machine"]):
            assert set(machine) == {"load_avg_1m", "steal_pct", "busy_pct"}
    quiet = out["rounds"][:2]  # the results: the medians of the quiet rounds
    assert out["vs_nanochat"] == pytest.approx(sum(r["vs_nanochat"] for r in quiet) / 2)
    assert out["nanochat"]["tok_per_s"] == pytest.approx(sum(r["nanochat"]["tok_per_s"] for r in quiet) / 2)
    seen = json.loads((nanochat_checkout / "nanochat" / "seen.json").read_text())
    assert seen["config"] == {"sequence_len": 64, "vocab_size": 512, "n_embd": 64}  # our config, its fields only
    # nanochat runs as it would on its own: the compute dtype said, flaxchat's huge-pages tunable taken out
    assert seen["tunables"] == "glibc.malloc.arena_max=4" and seen["dtype"] == "float32"
    # --nanochat-mkl avx512: nanochat's process, and only it, starts with the library that answers MKL's CPU check
    library = tmp_path / "base" / "bench_run" / "mkl_avx512" / "mkl_avx512.so"
    assert seen["preload"] == str(library) and "LD_PRELOAD" not in os.environ
    assert ctypes.CDLL(str(library)).mkl_serv_intel_cpu_true() == 1


def test_nanochat_errors_are_one_line(capsys, monkeypatch, tmp_path, nanochat_checkout):
    argv = TINY + ["--what", "train", "--device-batch-size", "1", "--steps", "1", "--warmup", "0"]
    with pytest.raises(SystemExit):
        main(argv + ["--nanochat", str(tmp_path / "missing")])
    assert "not a nanochat checkout (no nanochat/gpt.py in it)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(TINY + ["--what", "comms", "--nanochat", str(nanochat_checkout)])
    assert "use it with --what train" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(argv + ["--rounds", "0"])
    assert "--rounds and --steps must be at least 1" in capsys.readouterr().err
    monkeypatch.setenv("STAND_IN_FAILS", "1")
    with pytest.raises(SystemExit) as e:
        main(argv + ["--nanochat", str(nanochat_checkout)])
    assert str(e.value) == "error: timing nanochat failed: ValueError: the stand-in was told to fail"


def test_nanochat_mkl_errors_are_one_line(capsys, monkeypatch, tmp_path, nanochat_checkout):
    """--nanochat-mkl avx512 without --nanochat, with no C compiler, and with one that fails: one line each, before
    nanochat or flaxchat runs."""
    import shutil

    argv = TINY + ["--what", "train", "--steps", "1", "--warmup", "0", "--nanochat-mkl", "avx512"]
    with pytest.raises(SystemExit):
        main(argv)
    assert (
        "--nanochat-mkl avx512 chooses nanochat's BLAS kernels: use it with --nanochat DIR" in capsys.readouterr().err
    )
    monkeypatch.setenv("STAND_IN_FAILS", "1")  # nanochat is never reached
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as e:
        main(argv + ["--nanochat", str(nanochat_checkout)])
    assert (
        str(e.value) == "error: --nanochat-mkl avx512 builds a one-line C library: no C compiler found ($CC, cc or gcc)"
    )
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(SystemExit) as e:
        main(argv + ["--nanochat", str(nanochat_checkout)])
    assert str(e.value).startswith(
        f"error: --nanochat-mkl avx512: the C compiler {tmp_path / 'no-such-cc'} did not start"
    )
    failing = tmp_path / "failing-cc"
    failing.write_text("#!/bin/sh\necho 'mkl_avx512.c:1: error: this compiler refuses' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    with pytest.raises(SystemExit) as e:
        main(argv + ["--nanochat", str(nanochat_checkout)])
    assert (
        str(e.value) == f"error: --nanochat-mkl avx512: {failing} failed: mkl_avx512.c:1: error: this compiler refuses"
    )
    assert not (tmp_path / "base" / "bench_run" / "mkl_avx512" / "mkl_avx512.so").exists()


def test_nanochat_on_a_gpu_needs_one(nanochat_checkout):
    """nanochat_bench --device cuda where PyTorch sees no GPU: one line, before anything is built."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this PyTorch sees a CUDA GPU")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.nanochat_bench",
            "--dir",
            str(nanochat_checkout),
            "--config",
            json.dumps({"sequence_len": 8, "vocab_size": 16}),
            "--batch-size",
            "1",
            "--device",
            "cuda",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1].startswith("error: --device cuda, but this PyTorch (")


RUN = [
    "--what",
    "run",
    "--depth",
    "2",
    "--aspect-ratio",
    "32",
    "--head-dim",
    "32",
    "--max-seq-len",
    "64",
    "--window-pattern",
    "SL",
    "--device-batch-size",
    "2",
    "--grad-accum",
    "2",
    "--steps",
    "4",
    "--warmup",
    "1",
]


@pytest.mark.slow
def test_run_times_a_real_pretrain_run_beside_nanochats_base_train(
    capsys, monkeypatch, tiny_base_dir, nanochat_checkout, xla_flags
):
    """--what run: nanochat's base_train (the stand-in) first, on our tokenizer and shards in its own base dir, with
    the same flags; then scripts.pretrain for real; each run's median step after the first and --warmup more."""
    from flaxchat.data.tokenizer import get_tokenizer

    monkeypatch.setenv("XLA_FLAGS", xla_flags(1))  # one device, as nanochat's base_train runs in one process
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    # a path entry holding flaxchat's scripts package must not shadow nanochat's (a namespace package, as here)
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(RUN + ["--nanochat", str(nanochat_checkout), "--dtype", "float32", "--expect-backend", "cpu"])
    printed = capsys.readouterr()
    out = json.loads(printed.out)
    assert "step 00003/00004" in printed.err and "pretrain" in printed.err  # both runs' output, streamed as it came
    flags = [
        "--depth",
        "2",
        "--aspect-ratio",
        "32",
        "--head-dim",
        "32",
        "--max-seq-len",
        "64",
        "--window-pattern",
        "SL",
        "--device-batch-size",
        "2",
        "--total-batch-size",
        "256",
        "--num-iterations",
        "4",
        "--eval-every",
        "-1",
        "--core-metric-every",
        "-1",
        "--sample-every",
        "-1",
    ]
    assert out["what"] == "run" and out["flags"] == flags and out["tokens_per_step"] == 256
    assert out["timed_from_step"] == 3 and out["dtype"] == "float32"
    theirs = out["nanochat"]
    # the stand-in's steps 3 and 4 (its 0-based 2 and 3) took 30 and 40 ms
    assert theirs["step_s"] == pytest.approx(0.035) and theirs["timed_steps"] == 2
    assert theirs["tok_per_s"] == pytest.approx(256 / 0.035) and theirs["timed_min"] == pytest.approx(0.07 / 60)
    assert out["timed_steps"] == 2 and 0 < out["step_s_min"] <= out["step_s"] <= out["step_s_max"]
    assert out["tok_per_s"] == pytest.approx(256 / out["step_s"])
    assert out["vs_nanochat"] == pytest.approx(0.035 / out["step_s"])
    for record in (out, theirs):
        assert record["process_s"] > 0 and set(record["machine"]) == {"load_avg_1m", "steal_pct", "busy_pct"}
        assert os.path.isfile(record["log"])
    seen = json.loads((nanochat_checkout / "scripts" / "seen.json").read_text())
    assert seen["argv"] == flags + ["--device-type", "cpu"]  # --expect-backend's backend (else base_train detects it)
    assert seen["tunables"] is None and seen["dtype"] == "float32"  # nanochat runs as it would on its own
    assert seen["preload"] is None and theirs["mkl"] == "as-installed"  # its PyTorch's BLAS kernels as installed
    assert seen["tokens"] == get_tokenizer().encode(seen["text"])  # our tokenizer, in nanochat's format
    assert seen["files"] == sorted(os.listdir(tiny_base_dir / "base_data"))
    # flaxchat's run in a base dir of its own: the user's checkpoints and report are left alone
    run_base = tiny_base_dir / "bench_run" / "flaxchat_base"
    metrics = [json.loads(line) for line in (run_base / "base_checkpoints" / "d2" / "metrics.jsonl").open()]
    assert [r["step"] for r in metrics if "dt" in r] == [1, 2, 3, 4]
    assert (run_base / "report").is_dir() and (run_base / "tokenizer").resolve() == (
        tiny_base_dir / "tokenizer"
    ).resolve()
    assert sorted(os.listdir(tiny_base_dir)) == ["base_data", "bench_run", "tokenizer"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rounds", "2"], "--what run runs scripts.pretrain as it is (its own loader, one run): not with --suite"),
        (
            ["--warmup", "3"],
            "--what run times the steps after the first and --warmup more: --steps (4) must be at least "
            "--warmup + 2 (5)",
        ),
    ],
)
def test_run_flag_errors_are_one_line(capsys, extra, message):
    with pytest.raises(SystemExit):
        main(RUN + extra)
    assert message in capsys.readouterr().err


def test_run_errors_are_one_line(capsys, monkeypatch, tmp_path, tiny_base_dir, nanochat_checkout):
    """A checkout without base_train, a base dir without a tokenizer, and a base_train that fails: one line each."""
    (tmp_path / "bare" / "nanochat").mkdir(parents=True)
    with pytest.raises(SystemExit):
        main(RUN + ["--nanochat", str(tmp_path / "bare")])
    assert "not a nanochat checkout (no scripts/base_train.py in it)" in capsys.readouterr().err
    monkeypatch.setenv("STAND_IN_FAILS", "1")
    with pytest.raises(SystemExit) as e:
        main(RUN + ["--nanochat", str(nanochat_checkout)])
    log = tiny_base_dir / "bench_run" / "nanochat.log"
    assert (
        str(e.value) == f"error: nanochat's base_train exited with 1: RuntimeError: the stand-in was told to fail "
        f"(its output: {log})"
    )
    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(tmp_path / "empty"))
    with pytest.raises(SystemExit) as e:
        main(RUN + ["--nanochat", str(nanochat_checkout)])
    assert str(e.value).startswith("error: ") and "tokenizer" in str(e.value)


def test_product_census_counts_every_product_the_compiled_step_runs():
    """--products: every dot_general of the train step, scan bodies times their trip count (the fused loss's
    chunks, two accumulation micro-steps), each timed alone. Its FLOPs are the products XLA compiles (read off the
    compiled step's HLO), and the report names the model's and optimizer's source lines."""
    import jax
    import numpy as np
    from flax import nnx

    from flaxchat import sharding
    from flaxchat.model.gpt import GPT, GPTConfig
    from flaxchat.perf.hlo import program_stats
    from flaxchat.perf.products import format_census, product_census
    from flaxchat.train.optim import build_optimizer
    from flaxchat.train.step import train_step

    mesh = sharding.make_mesh(data=1, devices=jax.devices()[:1])
    config = GPTConfig(
        sequence_len=64, vocab_size=512, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, window_pattern="SL"
    )
    with jax.set_mesh(mesh):
        model = GPT(config, rngs=nnx.Rngs(0))
        optimizer = build_optimizer(model, verbose=False)
    rows = jax.device_put(
        np.random.default_rng(0).integers(0, 512, (2, 64), dtype=np.int32), sharding.batch_sharding(mesh)
    )
    batch = ((rows, rows), (rows, rows))  # two micro-steps
    census = product_census(model, optimizer, batch, mesh, repeats=1)
    with jax.set_mesh(mesh):
        compiled = program_stats(train_step.lower(model, optimizer, *batch).compile().as_text())["matmul_flops"]
    assert census["gflop"] * 1e9 == pytest.approx(compiled, rel=0.05)
    assert census["calls"] >= census["distinct"] > 10 and census["alone_s"] > 0
    # each named by a line of the model's or the optimizer's code (a CPU's products run in model/cpu.py's forms)
    assert census["top"] and all(p["source"].startswith(("flaxchat/model/", "flaxchat/train/")) for p in census["top"])
    lines = format_census({**census, "share_of_step": 0.5}, 2 * census["alone_s"]).splitlines()
    assert lines[0].startswith(f"the step's {census['calls']} products") and "(50%)" in lines[0]
    assert len(lines) == 2 + len(census["top"]) + len(census["by_line"])
    # grouped by line: the same products and FLOPs, attention's block products among them under their own line
    by_line = census["by_line"]
    assert sum(p["calls"] for p in by_line) == census["calls"]
    assert sum(p["gflop"] for p in by_line) == pytest.approx(census["gflop"])
    assert sum(p["ms"] for p in by_line) == pytest.approx(1e3 * census["alone_s"])
    assert [p["ms"] for p in by_line] == sorted((p["ms"] for p in by_line), reverse=True)
    assert any(p["source"].startswith("flaxchat/model/cpu.py:") and "_attend_block" in p["source"] for p in by_line)
    assert all(" (" not in p["source"] for p in by_line)  # one entry per line, whatever transformation made it


def test_products_spec_and_cli_errors(capsys):
    from flaxchat.perf.products import einsum_spec

    assert einsum_spec(2, 2, (((1,), (0,)), ((), ()))) == "ab,bc->ac"
    assert einsum_spec(3, 3, (((0, 1), (0, 1)), ((), ()))) == "abc,abd->cd"  # a weight gradient: rows contracted
    assert einsum_spec(4, 4, (((3,), (3,)), ((0, 1), (0, 1)))) == "abcd,abed->abce"  # attention scores
    with pytest.raises(SystemExit):
        main(TINY + ["--what", "train", "--products", "--fsdp", "2"])
    assert "--products times one device's products" in capsys.readouterr().err
