"""Shared test setup. Every test runs on CPU; 8 fake CPU devices let sharding tests build real meshes.

Tests share their process (a pytest-xdist worker runs many) and pytest-randomly shuffles their order, so a test
must leave the process as it found it. Before each test JAX is started with the flags below (so nothing a test
does to XLA_FLAGS can change the device count afterwards); after each test, once its fixtures are torn down,
`_leaks` compares the process-wide state with what it was, and the test that changed it errors in its teardown.
Change environment variables with monkeypatch.setenv and run programs that need other JAX flags in a subprocess.
"""

import os
import re

N_DEVICES = 8
# Must happen before JAX initialises its backend. Other XLA flags of the caller are kept; the device count is not.
_xla_flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", "")).split()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# On the CPU, programs compiled for speed of compiling: the suite compiles thousands of small programs (a tiny
# model's train step, decode loops, every eager op) and compiling is most of its time. LLVM's optimisation off (30%
# less), and XLA:CPU's older fusion code generator instead of its MLIR fusion emitters, which at -O0 take a tiny
# model's train step from ~4.9 to ~2.7 s to compile (the suite: 17.4 -> 11.5 min on 2 cores). XLA's HLO passes,
# which decide what a program computes and how it is sharded, all still run. The machine code is slower and may
# round differently in the last bit, so subprocesses whose numbers a test compares with this process's get the same
# flags (the `xla_flags` fixture), and tests that read a compiled program's fusions compile it as users' programs
# are compiled (the `users_codegen` fixture); the demo test runs as users do. Not on a GPU (the GPU tests,
# `-m gpu`), whose kernels would be compiled unoptimised too.
_on_cpu = os.environ["JAX_PLATFORMS"] == "cpu"
_FAST_COMPILE = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false"}
for _flag, _value in _FAST_COMPILE.items():
    if _on_cpu and not any(f.startswith(f"--{_flag}") for f in _xla_flags):
        _xla_flags.append(f"--{_flag}={_value}")


def _flags_with(devices: int) -> str:
    """This suite's XLA_FLAGS with `devices` CPU devices."""
    return " ".join([*_xla_flags, f"--xla_force_host_platform_device_count={devices}"])


os.environ["XLA_FLAGS"] = _flags_with(N_DEVICES)
os.environ.setdefault("FLAXCHAT_DTYPE", "float32")
# The suite's own programs (HumanEval's reference answers, tool calls it scripts) are trusted: bubblewrap where it
# runs, the Python guard where it cannot. tests/test_sandbox.py sets FLAXCHAT_SANDBOX itself to test the default,
# which refuses to run anything without an operating-system sandbox.
os.environ.setdefault("FLAXCHAT_SANDBOX", "allow-guard")
# One persistent XLA compilation cache for the whole run, shared by the xdist workers (they inherit this
# environment) and by the scripts tests launch: many tests compile the same tiny programs, and compiling is most
# of what they spend. Removed when the run that made it ends.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="flaxchat-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

# The xdist workers and the scripts tests start run with glibc's huge pages, as pixi tasks and the demo's stages do
# (flaxchat.perf.machine.with_huge_pages: XLA:CPU's per-call temporaries without a page fault per 4 KB). Imported
# here, after the environment above is set, because importing flaxchat imports JAX.
from flaxchat.perf.machine import with_huge_pages  # noqa: E402

os.environ["GLIBC_TUNABLES"] = with_huge_pages(os.environ)["GLIBC_TUNABLES"]

import pytest  # noqa: E402

# Environment variables that change how JAX, flaxchat or the libraries under them behave. (Not the whole
# environment: some libraries add variables of their own the first time they are imported.)
_WATCHED_ENV = re.compile(r"(XLA_|JAX_|TPU_VISIBLE|CUDA_VISIBLE|FLAXCHAT_|HF_|TIKTOKEN_|PYTHONHASHSEED$)")
_STATE = pytest.StashKey[dict]()


def _process_state() -> dict:
    import jax

    return {
        "environment": {k: v for k, v in os.environ.items() if _WATCHED_ENV.match(k)},
        "working directory": os.getcwd(),
        "jax.config": dict(jax.config.values),
        "JAX devices": (jax.default_backend(), jax.device_count()),
        "mesh set by jax.set_mesh": str(jax.sharding.get_abstract_mesh()),
    }


def _leaks(before: dict, after: dict) -> list[str]:
    leaks = []
    for what in before:
        a, b = before[what], after[what]
        if a == b:
            continue
        if isinstance(a, dict):
            changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            leaks += [f"{what}: {k} was {a.get(k)!r}, is {b.get(k)!r}" for k in changed]
        else:
            leaks.append(f"{what}: was {a!r}, is {b!r}")
    return leaks


def _restore(before: dict, after: dict) -> None:
    import jax

    os.chdir(before["working directory"])
    for k in after["environment"].keys() - before["environment"].keys():
        del os.environ[k]
    os.environ.update(before["environment"])
    for k, v in before["jax.config"].items():
        if after["jax.config"].get(k) != v:
            try:
                jax.config.update(k, v)
            except Exception:  # a flag JAX will not take back; the failure already names it
                pass


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    import jax

    backend, n = jax.default_backend(), jax.device_count()  # starts JAX (once per process) with the flags above
    if backend == "cpu" and n != N_DEVICES:
        pytest.fail(
            f"JAX sees {n} CPU devices, not the {N_DEVICES} this file asks for: something in this process "
            "set XLA_FLAGS before JAX started, or restarted JAX's backends",
            pytrace=False,
        )
    if item.get_closest_marker("eight_devices") and n < N_DEVICES:
        pytest.skip(f"needs {N_DEVICES} devices; JAX's {backend} backend has {n}")  # only off the CPU
    item.stash[_STATE] = _process_state()
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield  # the test's fixtures (monkeypatch included) are torn down by now
    before = item.stash.get(_STATE, None)
    if before is not None:
        after = _process_state()
        leaks = _leaks(before, after)
        if leaks:
            _restore(before, after)  # so that only the test that leaked fails, not every test after it
            pytest.fail(
                "the test changed process-wide state that later tests would see (use monkeypatch, or a "
                "subprocess with its own environment):\n  " + "\n  ".join(leaks),
                pytrace=False,
            )
    return result


@pytest.fixture
def xla_flags():
    """XLA_FLAGS for a subprocess: this suite's flags (see the top of this file) with `devices` CPU devices."""
    return _flags_with


@pytest.fixture(scope="session")
def users_codegen():
    """compiler_options for `.lower(...).compile(compiler_options=...)` that compile one program's fusions as users'
    programs are compiled (XLA:CPU's fusion emitters; see the top of this file), for tests that read them."""
    return {"xla_cpu_use_fusion_emitters": True} if _on_cpu else None


@pytest.fixture(autouse=True)
def _isolated_base_dir(tmp_path, monkeypatch):
    """No test ever reads or writes ~/.cache/flaxchat."""
    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(tmp_path / "base"))


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A base dir holding a small tokenizer (vocab 512) and synthetic-story shards (3 train + 1 val).

    Built once per session; tests link to it through `tiny_base_dir` and never write into it.
    """
    from flaxchat.data.dataset import write_shards
    from flaxchat.data.stories import generate_stories
    from flaxchat.data.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("corpus")
    train = generate_stories(600, split="train", seed=0)
    val = generate_stories(100, split="val", seed=0)
    tok = Tokenizer.train_from_iterator(iter(train), vocab_size=512)
    tok.save(str(root / "tokenizer"))
    write_shards(train, str(root / "base_data"), docs_per_shard=200)
    write_shards(val, str(root / "base_data"), docs_per_shard=200, first_index=3)
    return root


@pytest.fixture
def tiny_base_dir(tiny_corpus, tmp_path, monkeypatch):
    """A fresh FLAXCHAT_BASE_DIR for this test, with the session's tokenizer and shards linked in."""
    base = tmp_path / "tiny_base"
    base.mkdir()
    for name in ("tokenizer", "base_data"):
        (base / name).symlink_to(tiny_corpus / name, target_is_directory=True)
    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(base))
    return base


@pytest.fixture(scope="module")
def tok(tiny_corpus):
    """The tiny corpus's tokenizer (vocab 512); a test module that needs another defines its own `tok`."""
    from flaxchat.data.tokenizer import Tokenizer

    return Tokenizer.load(str(tiny_corpus / "tokenizer"))


@pytest.fixture(scope="module")
def scheduler(tok):
    """One Scheduler per test module around a tiny random GPT (2 layers of width 64, 128 positions) over `tok`: 4
    slots, decode chunks of 4 tokens; closed when the module's tests are done."""
    from flax import nnx

    from flaxchat.generate.scheduler import Scheduler
    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT

    config = GPTConfig(sequence_len=128, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    s = Scheduler(GPT(config, rngs=nnx.Rngs(0)), tok, slots=4, chunk=4)
    yield s
    s.close()


# A stand-in for a nanochat checkout (tests run offline): nanochat/gpt.py with the interface scripts.nanochat_bench
# uses (GPTConfig, GPT built on the meta device, init_weights, setup_optimizer, forward(idx, targets) -> loss,
# COMPUTE_DTYPE), a one-layer model, and a note of the environment it ran in.
STAND_IN = """
import dataclasses, json, os
import torch
from torch import nn
COMPUTE_DTYPE = {"bfloat16": torch.bfloat16}.get(os.environ.get("NANOCHAT_DTYPE"), torch.float32)

@dataclasses.dataclass
class GPTConfig:
    sequence_len: int = 64
    vocab_size: int = 512
    n_embd: int = 32

class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def init_weights(self):
        with open(os.path.join(os.path.dirname(__file__), "seen.json"), "w") as f:
            json.dump({"config": dataclasses.asdict(self.config), "tunables": os.environ.get("GLIBC_TUNABLES"),
                       "dtype": os.environ.get("NANOCHAT_DTYPE"), "preload": os.environ.get("LD_PRELOAD")}, f)
        print("nanochat prints what it chose")  # to stdout, as nanochat does
        nn.init.normal_(self.wte.weight); nn.init.zeros_(self.lm_head.weight)

    def setup_optimizer(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def forward(self, idx, targets):
        if os.environ.get("STAND_IN_FAILS"):
            raise ValueError("the stand-in was told to fail")
        logits = self.lm_head(self.wte(idx))
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
"""

# and a stand-in for its scripts/base_train.py (`bench --what run`): nanochat's flags, its base dir read as
# base_train reads it (tokenizer.pkl, the shards of base_data_climbmix), scripts/ a namespace package as in
# nanochat, a `scripts.base_eval` import and a `wandb` import as base_train has, and its line per step with
# dt = 10 ms x (step + 1)
STAND_IN_TRAIN = """
import argparse, json, os, pickle, sys
import pyarrow.parquet as pq
import wandb  # noqa: F401
from scripts.base_eval import evaluate_core  # noqa: F401
p = argparse.ArgumentParser()
for flag in ("--depth", "--aspect-ratio", "--head-dim", "--max-seq-len", "--device-batch-size", "--total-batch-size",
             "--num-iterations", "--eval-every", "--core-metric-every", "--sample-every"):
    p.add_argument(flag, type=int, required=True)
p.add_argument("--window-pattern", required=True)
p.add_argument("--device-type", default="")
a = p.parse_args()
base = os.environ["NANOCHAT_BASE_DIR"]
with open(os.path.join(base, "tokenizer", "tokenizer.pkl"), "rb") as f:
    enc = pickle.load(f)
shards = os.path.join(base, "base_data_climbmix")
files = sorted(os.listdir(shards))
text = pq.read_table(os.path.join(shards, files[0])).column("text")[0].as_py()
with open(os.path.join(os.path.dirname(__file__), "seen.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "text": text, "tokens": enc.encode_ordinary(text), "files": files,
               "tunables": os.environ.get("GLIBC_TUNABLES"), "dtype": os.environ.get("NANOCHAT_DTYPE"),
               "preload": os.environ.get("LD_PRELOAD")}, f)
if os.environ.get("STAND_IN_FAILS"):
    raise RuntimeError("the stand-in was told to fail")
for step in range(a.num_iterations):
    print(f"step {step:05d}/{a.num_iterations:05d} ({100 * step / a.num_iterations:.2f}%) | loss: 9.000000 | "
          f"lrm: 1.00 | dt: {10 * (step + 1):.2f}ms | tok/sec: 1,000 | bf16_mfu: 0.00 | epoch: 1 | total time: 0.00m")
"""


@pytest.fixture
def nanochat_checkout(tmp_path, monkeypatch):
    pytest.importorskip("torch", reason="timing nanochat needs PyTorch (CI installs the CPU build)")
    (tmp_path / "nanochat").mkdir()
    (tmp_path / "nanochat" / "gpt.py").write_text(STAND_IN)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "base_train.py").write_text(STAND_IN_TRAIN)
    (tmp_path / "scripts" / "base_eval.py").write_text("def evaluate_core():\n    pass\n")
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # torch.compile becomes a no-op: no C++ build in the tests
    return tmp_path


def pytest_terminal_summary(terminalreporter, config):
    """The test order's seed at the end of the run, even under -q (which hides pytest-randomly's header)."""
    if config.pluginmanager.hasplugin("randomly") and not hasattr(config, "workerinput"):
        seed = config.getoption("randomly_seed", None)
        if isinstance(seed, int):
            terminalreporter.write_line(f"test order: --randomly-seed={seed} replays it")


def pytest_collection_modifyitems(items):
    """Tests marked `slow` (a minute or more each) go first, in pytest-randomly's order among themselves, as the rest
    do after them: pytest-xdist hands out the front of the list in turn, so the two workers start on the long
    tests together and finish on short ones, instead of one worker still running a two-minute test at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the shuffle stays within groups
