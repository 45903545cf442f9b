"""Benchmarks: print one JSON object (tokens/s, MFU against a measured peak, compile time, memory).

Training step (random tokens, the real optimizer, median of --steps timed steps after warm-up), on the mesh
the --data/--fsdp/--tensor flags build (as scripts.pretrain does; default: data parallel over every device):
    python -m scripts.bench --what train --depth 4 --max-seq-len 512 --device-batch-size 8 \
        --window-pattern SSSL --vocab-size 32768
Communication of the compiled train step (nothing runs; works for any model size on any machine, e.g. d20 on
8 fake CPU devices): collectives per step, bytes each device sends, FLOPs per device:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m scripts.bench --what comms --depth 20 \
        --max-seq-len 2048 --device-batch-size 32 --vocab-size 65536 --dtype bfloat16 --fsdp 8
Generation (KV-cache engine; batch 1 and 32 are the usual points):
    python -m scripts.bench --what generate --depth 4 --max-seq-len 512 --window-pattern SSSL \
        --vocab-size 32768 --prompt-len 16 --max-new-tokens 256 --batch-size 1
    (add --quantize bf16|int8 to decode from weight-only quantized matmul weights, as chat_cli/eval can)
Speculative sampling, a trained model and a trained draft (plain vs speculative, acceptance rate):
    python -m scripts.bench --what generate --checkpoint sft:d12 --draft-model d4 --max-new-tokens 128 -t 0
Data loader (needs a tokenizer and parquet shards in $FLAXCHAT_BASE_DIR):
    python -m scripts.bench --what data --device-batch-size 8 --max-seq-len 512
How much of a step its matrix products are (each of the step's products timed alone, one device; the JSON adds
"products", stderr the slowest with their source lines and every line's products summed, with their rate):
    python -m scripts.bench --what train --depth 4 --head-dim 64 --window-pattern SL --max-seq-len 256 \
        --device-batch-size 16 --vocab-size 4096 --products
The CPU suite (the shapes compared with nanochat; one JSON line per shape; the "real" row needs a tokenizer and
shards in $FLAXCHAT_BASE_DIR):
    python -m scripts.bench --what train --suite cpu
Side by side with nanochat (a checkout of github.com/karpathy/nanochat and PyTorch installed): each row first
times nanochat's own step (its GPT, MuonAdamW and torch.compile, in a process of its own; scripts.nanochat_bench),
then flaxchat's, and adds "nanochat" and "vs_nanochat" (flaxchat tok/s over nanochat's) to the JSON:
    python -m scripts.bench --what train --suite cpu --nanochat ~/src/nanochat
    nanochat's record gives the rate of its PyTorch's own matmul (matmul_peak_flops); on an AMD CPU, where the stock
    wheel's MKL runs its AVX2 kernels, add --nanochat-mkl avx512 for the AVX-512 ones an Intel Xeon gets.
    On one CUDA GPU (PyTorch with CUDA; --rounds 1; JAX then grows its memory as it needs it instead of taking
    most of it at the start, so that nanochat's process, which runs first, has room):
    python -m scripts.bench --what train --depth 12 --max-seq-len 2048 --device-batch-size 32 \
        --vocab-size 32768 --dtype bfloat16 --nanochat ~/src/nanochat --expect-backend gpu
A real pretraining run (`scripts.pretrain`: the Grain loader over $FLAXCHAT_BASE_DIR's tokenizer and shards,
accumulation, the optimizer's schedules) and, with --nanochat, nanochat's own `scripts/base_train.py` first with
the same flags on the same tokenizer and shards; the median step of steps 11-150 of each (stdout: JSON; both runs'
progress on stderr and in $FLAXCHAT_BASE_DIR/bench_run/, where each trainer has a base dir of its own: your runs'
checkpoints and report are left alone). One device, as base_train runs in one process (on a machine with several
GPUs: CUDA_VISIBLE_DEVICES=0):
    python -m scripts.bench --what run --depth 4 --head-dim 64 --window-pattern SL --max-seq-len 256 \
        --device-batch-size 16 --grad-accum 2 --steps 150 --warmup 9 --nanochat ~/src/nanochat
The chat server as a new user meets it (scripts.chat_web started with an empty compilation cache; a streamed reply
asked for as soon as /health answers, one as soon as the background compiles are done, then steady ones: each
reply's pace, seconds to its first token, tokens per SSE chunk and the largest gap between chunks), then a growing
conversation's time to first token turn by turn against its last message alone, and 16 clients chatting at once
(prefix reuse's hits and tokens saved):
    python -m scripts.bench --what serve --depth 12 --max-seq-len 2048 --max-new-tokens 96
    python -m scripts.bench --what serve --checkpoint sft:d4 --max-new-tokens 96
Everything:
    python -m scripts.bench --what all --depth 4 --max-seq-len 512
On a GPU or TPU add --expect-backend gpu|tpu so a silent fall-back to the CPU stops the run at once.
"""

import argparse
import json
import os
import re
import shlex
import sys

import jax

from flaxchat import sharding
from flaxchat.common import parse_args, quiet_library_logs
from flaxchat.export.nanochat import save_nanochat_tokenizer
from flaxchat.generate.speculative import add_draft_flags
from flaxchat.model.config import GPTConfig, add_model_flags, config_from_flags
from flaxchat.model.gpt import add_kernel_flags
from flaxchat.model.quantize import add_quantize_flag
from flaxchat.perf.machine import environment
from flaxchat.perf.measure import bench_data, bench_generate
from flaxchat.perf.processes import NANOCHAT_MKL, ProcessError, bench_run
from flaxchat.perf.profiler import StepProfiler
from flaxchat.perf.serving import measure as measure_serving
from flaxchat.perf.training import bench_comms, bench_train
from flaxchat.train.flags import add_batch_flags, add_dtype_flag
from flaxchat.train.step import IN_FLIGHT_CHOICES

# -----------------------------------------------------------------------------
# CLI


def build_parser():
    p = argparse.ArgumentParser(description="Benchmark training, generation or data loading; prints JSON.")
    p.add_argument(
        "--what",
        choices=["train", "comms", "generate", "data", "run", "serve", "all"],
        default="train",
        help="what to measure (all = train, generate, data; run = a real scripts.pretrain run of --steps "
        "steps on one device, beside nanochat's base_train with --nanochat; serve = scripts.chat_web "
        "started cold, a streamed reply at once, after its background compiles and steady)",
    )
    add_model_flags(p, depth=4, max_seq_len=512)
    p.add_argument("--vocab-size", type=int, default=32768, help="vocabulary size (random tokens)")
    add_batch_flags(p, device_batch_size=8)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per training step")
    p.add_argument(
        "--steps",
        type=int,
        default=10,
        help="timed training steps (median reported), run as pretrain runs them; a step's time runs from "
        "reading its batches to its loss being ready",
    )
    p.add_argument(
        "--in-flight",
        nargs="?",
        const="on",
        choices=IN_FLIGHT_CHOICES,
        default="auto",
        help="train: keep one step in flight, as pretrain does (auto: on GPUs and TPUs, off on a CPU; "
        "a bare --in-flight is on): the next is dispatched before this one's loss is read, and a "
        "step's time is then the time between the ends of two steps",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps after compilation (run: the first step and this many after it are left out of the median)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="train: time --steps steps this many times (with --nanochat: nanochat, then flaxchat, each "
        "round); the JSON adds every round and the median round's ratio. A round during which the "
        "VM's host gave over 5%% of the CPU time to other guests (steal) is left out of the results "
        "(noisy_rounds) unless every round was",
    )
    p.add_argument("--batch-size", type=int, default=1, help="generation rows")
    p.add_argument("--prompt-len", type=int, default=16, help="generation prompt tokens")
    p.add_argument("--max-new-tokens", type=int, default=256, help="generated tokens per row")
    add_dtype_flag(p)
    add_quantize_flag(p)
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="[SOURCE:]TAG",
        help="generate: time a trained checkpoint (e.g. sft:d4) instead of a random model of the flags' shape",
    )
    add_draft_flags(p)
    p.add_argument(
        "--serve-flags",
        default="",
        metavar="FLAGS",
        help='serve: more scripts.chat_web flags, in one string (e.g. "--slots 32 --chunk 8")',
    )
    p.add_argument("-t", "--temperature", type=float, default=1.0, help="generate: sampling temperature (0 = greedy)")
    p.add_argument(
        "--show-ops", action="store_true", help="comms: list every collective (kind, shape, times, source op)"
    )
    p.add_argument(
        "--suite",
        choices=["cpu"],
        default=None,
        help="train: run every shape of a suite (CPU_SUITE), one JSON line each; other flags still apply",
    )
    p.add_argument(
        "--real-data",
        action="store_true",
        help="train: batches from the Grain loader over $FLAXCHAT_BASE_DIR's tokenizer and shards",
    )
    p.add_argument(
        "--cycle-batches",
        type=int,
        default=0,
        metavar="N",
        help="train, with --real-data: read N steps' batches from the loader once, then cycle through "
        "them (the loader's text without the loader in the step; 0 = a new batch from the loader "
        "every step)",
    )
    p.add_argument(
        "--fresh-batches",
        action="store_true",
        help="train, random tokens: new host arrays placed on the devices every step, as the loader's "
        "batches arrive (by default two batches stay on the devices and alternate)",
    )
    p.add_argument(
        "--nanochat",
        metavar="DIR",
        default=None,
        help="train: also time nanochat's step (the checkout at DIR, with PyTorch) on the same shape, "
        "first; run: run nanochat's scripts/base_train.py first, with the same flags and data",
    )
    p.add_argument(
        "--nanochat-mkl",
        choices=NANOCHAT_MKL,
        default="as-installed",
        help="with --nanochat on a CPU: the BLAS kernels nanochat's PyTorch runs. as-installed: what its "
        "wheel picks (the stock wheel's MKL takes its slower AVX2 path on AMD CPUs); "
        "avx512: MKL's AVX-512 path, as on an Intel Xeon, through a one-line C library preloaded "
        "into nanochat's processes only (built with the system's C compiler). nanochat's JSON gives "
        "the fp32 matmul rate its PyTorch reached either way",
    )
    StepProfiler.add_flag(
        p,
        "--profile-dir (train; the JSON adds where their time went: ms by kind of op and the "
        "slowest ops, and nanochat's beside them with --nanochat)",
    )
    p.add_argument(
        "--profile-dir", type=str, default=None, help="where the trace goes (default $FLAXCHAT_BASE_DIR/profile/bench)"
    )
    p.add_argument(
        "--products",
        action="store_true",
        help="train, one device: also time every matrix product of the step alone, one after another "
        '(the JSON adds "products": their time beside the step\'s, the slowest, and their time and '
        "rate by line of the program)",
    )
    add_kernel_flags(p)
    sharding.add_mesh_flags(p)
    return p


def make_config(args) -> GPTConfig:
    return config_from_flags(args, args.vocab_size)


# The CPU suite (`--suite cpu`): the shapes the project compares with nanochat on a CPU. The last is nanochat's
# runs/runcpu.sh model; "real" rows read batches from the Grain loader (tokenizer and shards in the base dir)
# with gradient accumulation, as scripts.pretrain does.
CPU_SUITE = {
    "d4-hd128-SSSL-T512-B8-V32768": dict(
        depth=4, head_dim=128, window_pattern="SSSL", max_seq_len=512, device_batch_size=8, vocab_size=32768
    ),
    "d4-hd64-SL-T256-B16-V4096": dict(
        depth=4, head_dim=64, window_pattern="SL", max_seq_len=256, device_batch_size=16, vocab_size=4096
    ),
    "d4-hd64-SL-T256-B16-real-accum2": dict(
        depth=4, head_dim=64, window_pattern="SL", max_seq_len=256, device_batch_size=16, grad_accum=2, real_data=True
    ),
    "d6-hd64-L-T512-B32-V32768": dict(
        depth=6, head_dim=64, window_pattern="L", max_seq_len=512, device_batch_size=32, vocab_size=32768
    ),
}


# -----------------------------------------------------------------------------
# Main


def run_suite(args, mesh) -> None:
    """Every shape of the suite through bench_train, one JSON line each (a missing tokenizer/data skips a row)."""
    for name, shape in CPU_SUITE.items():
        row = argparse.Namespace(**{**vars(args), "grad_accum": 1, "real_data": False, **shape})
        try:
            result = bench_train(row, mesh)
        except ProcessError as e:
            sys.exit(f"error: {e}")
        except FileNotFoundError as e:
            result = {"what": "train", "skipped": str(e)}
        print(
            json.dumps(
                {"shape": name, **environment(args.dtype, mesh), "config": make_config(row).to_dict(), **result}
            ),
            flush=True,
        )


def run_main(parser, args) -> None:
    """--what run: checked, then run without starting JAX's backend here (on a GPU it would hold the memory the
    two trainers' processes need)."""
    if args.suite or args.products or args.profile_steps or args.rounds != 1 or args.real_data:
        parser.error(
            "--what run runs scripts.pretrain as it is (its own loader, one run): not with --suite, "
            "--products, --profile-steps, --rounds or --real-data"
        )
    if args.warmup < 0 or args.warmup + 2 > args.steps:
        parser.error(
            f"--what run times the steps after the first and --warmup more: --steps ({args.steps}) must be "
            f"at least --warmup + 2 ({args.warmup + 2})"
        )
    base_train = os.path.join(os.path.expanduser(args.nanochat or ""), "scripts", "base_train.py")
    if args.nanochat and not os.path.isfile(base_train):
        parser.error(f"--nanochat {args.nanochat}: not a nanochat checkout (no scripts/base_train.py in it)")
    try:
        record = bench_run(args, save_nanochat_tokenizer)
    except (FileNotFoundError, ValueError, ProcessError) as e:  # ProcessError: a trainer failed (its line)
        sys.exit(f"error: {e}")
    print(json.dumps(record, indent=2))


def serve_main(args) -> None:
    """--what serve: scripts.chat_web in a process of its own (this one starts no JAX backend), --checkpoint's model
    or a random one of --depth and --max-seq-len, replies of --max-new-tokens tokens (flaxchat.perf.serving)."""
    if args.checkpoint:
        source, _, tag = args.checkpoint.rpartition(":")
        flags = ["-i", source or "sft", "-g", tag]
    else:
        flags = ["--random-init", "--depth", str(args.depth), "--seq-len", str(args.max_seq_len)]
    flags += shlex.split(args.serve_flags)
    try:
        record = measure_serving(flags, "Tell me a story about a cat and a dog.", args.max_new_tokens)
    except RuntimeError as e:
        sys.exit(f"error: {e}")
    print(json.dumps({"what": "serve", "chat_web_flags": flags, **record}, indent=2))


def check_args(parser, args) -> None:
    """Flags that do not go together, or that name what is not there: one line each, before anything runs."""
    try:
        make_config(args)
    except ValueError as e:
        parser.error(str(e))
    if args.draft_model and not args.checkpoint:
        parser.error("--draft-model needs --checkpoint: a draft proposes tokens for a trained model")
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    if args.nanochat_mkl != "as-installed" and not args.nanochat:
        parser.error(f"--nanochat-mkl {args.nanochat_mkl} chooses nanochat's BLAS kernels: use it with --nanochat DIR")
    if args.cycle_batches < 0 or (args.cycle_batches and not args.real_data):
        parser.error("--cycle-batches N (N >= 1) cycles the loader's batches: use it with --real-data")
    if args.fresh_batches and args.real_data:
        parser.error("--fresh-batches draws random tokens; --real-data's batches are new every step already")


def check_nanochat(parser, args) -> None:
    """--nanochat with --what train: a nanochat checkout, and a backend both can share (this starts JAX's)."""
    if args.what not in ("train", "all"):
        parser.error("--nanochat times nanochat's training step: use it with --what train")
    # On a GPU the two take turns on its memory: JAX must not take most of it before nanochat runs (set before
    # the first call that starts JAX's backend; a value you exported is kept).
    if not re.fullmatch(r"(cpu|tpu)(,(cpu|tpu))*", os.environ.get("JAX_PLATFORMS", "")):  # a GPU may be used
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    backend = jax.default_backend()
    if backend not in ("cpu", "gpu"):
        parser.error(f"--nanochat compares the two on a CPU or a CUDA GPU; JAX is running on {backend}")
    if backend == "gpu" and (jax.device_count() > 1 or args.rounds > 1):
        parser.error(
            "--nanochat on a GPU: one GPU (CUDA_VISIBLE_DEVICES=0) and --rounds 1 (JAX keeps the "
            "memory it has grown to, so nanochat cannot run again after flaxchat's first round)"
        )
    if not os.path.isfile(os.path.join(os.path.expanduser(args.nanochat), "nanochat", "gpt.py")):
        parser.error(f"--nanochat {args.nanochat}: not a nanochat checkout (no nanochat/gpt.py in it)")


def main(argv=None):
    quiet_library_logs()
    parser = build_parser()
    args = parse_args(parser, argv)
    StepProfiler.prepare(args.profile_steps)  # before JAX starts its backend
    sharding.native_gpu_atomics()  # likewise (mesh_from_args would, but --nanochat starts the backend before it)
    check_args(parser, args)
    if args.what == "run":
        return run_main(parser, args)
    if args.what == "serve":
        return serve_main(args)
    if args.nanochat:
        check_nanochat(parser, args)
    mesh = sharding.mesh_from_args(parser, args)
    if args.products and (args.what not in ("train", "all") or mesh.size > 1):
        parser.error(
            "--products times one device's products of the training step: --what train on one device "
            "(on a mesh, XLA's partitioner and Muon's shared-out stacks decide what each device multiplies)"
        )
    if args.suite:
        return run_suite(args, mesh)
    runs = {
        "train": bench_train,
        "comms": bench_comms,
        "generate": lambda args, mesh: bench_generate(args),
        "data": lambda args, mesh: bench_data(args),
    }
    chosen = ["train", "generate", "data"] if args.what == "all" else [args.what]
    env = environment(args.dtype, mesh)
    results = {}
    for name in chosen:
        try:
            results[name] = runs[name](args, mesh)
        except ProcessError as e:  # nanochat's step or its set-up failed
            sys.exit(f"error: {e}")
        except (FileNotFoundError, ValueError) as e:  # e.g. no tokenizer/data for --what data, a bad --checkpoint
            if args.what != "all":
                sys.exit(f"error: {e}")
            results[name] = {"what": name, "skipped": str(e)}
    env["config"] = make_config(args).to_dict()  # after the runs: --real-data takes the tokenizer's vocabulary
    out = results[chosen[0]] if len(chosen) == 1 else results
    print(json.dumps({**env, **out} if len(chosen) == 1 else {**env, "results": out}, indent=2))


if __name__ == "__main__":
    main()
