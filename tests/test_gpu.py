"""GPU checks (marked `gpu`, skipped off a GPU) and the CPU smoke run of runs/gpu_check.sh (runs everywhere).

On a GPU: `JAX_PLATFORMS=cuda python -m pytest -m gpu` (tests/conftest.py pins JAX to the CPU unless
JAX_PLATFORMS is set; runs/gpu_check.sh sets it). Each GPU check compares the bf16 path the GPU runs (cuDNN's fused
attention, bf16 activations) with a float32 XLA reference and asks its error to be of the same order as the error
bf16 arithmetic alone makes, so the tolerances hold for any seed rather than for one lucky draw.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat.model.attention import attention
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

on_gpu = pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason=f"needs a GPU: JAX runs on {jax.default_backend()} here "
    "(on a CUDA machine: JAX_PLATFORMS=cuda python -m pytest -m gpu, or bash runs/gpu_check.sh)",
)


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# -----------------------------------------------------------------------------
# The checks, written over the implementation they test so they can be exercised with "xla" anywhere.


def check_attention(fused, window, B=2, T=512, H=8, Hkv=2, D=128, seed=0):
    """`fused` attention in bf16 vs XLA attention in bf16, both measured against XLA in float32: outputs and
    the gradients of q, k and v (GQA: 4 query heads per kv head; a window shorter than T unless window >= T)."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, h, D)), jnp.float32) for h in (H, Hkv, Hkv))
    cotangent = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)  # a fixed random direction for the VJP

    def run(impl, dtype):
        def f(q, k, v):
            out = attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), window, impl)  # (B, T, H, D)
            return jnp.sum(out.astype(jnp.float32) * cotangent), out

        (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return (out, *grads)

    with jax.default_matmul_precision("highest"):  # a true fp32 reference (GPUs default to TF32 for fp32 matmuls)
        reference = run("xla", jnp.float32)
    plain = run("xla", jnp.bfloat16)
    tested = run(fused, jnp.bfloat16)
    for name, t, p, r in zip(("out", "dq", "dk", "dv"), tested, plain, reference):
        assert t.shape == r.shape and (name != "out" or t.dtype == jnp.bfloat16), name
        err, bf16_err = rel_err(t, r), rel_err(p, r)
        assert np.isfinite(err) and err <= max(2.0 * bf16_err, 1e-2), (
            f"{name}: {fused} bf16 rel. error {err:.2e} vs XLA bf16 {bf16_err:.2e} (window {window})"
        )
    return tested


def small_config(n_layer=4, T=256):
    """head_dim 128 (cuDNN's sweet spot), GQA (2 query heads per kv head), windows 128 | 256 (S, L)."""
    return GPTConfig(
        sequence_len=T, vocab_size=1024, n_layer=n_layer, n_head=2, n_kv_head=1, n_embd=256, window_pattern="SL"
    )


def random_weights(model, seed=0, scale=0.3):
    """Every parameter N(0, scale), cast to the model's storage dtypes: no path left at its zero init, logits far
    from uniform (tests/test_engine.py does the same)."""
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.Param)
    fill = lambda x: jnp.asarray(rng.normal(0.0, scale, x.shape), x.dtype)
    nnx.update(model, jax.tree.map(fill, state))
    return model


def same_weights(model, reference):
    """Copy reference's parameters into model, each cast to model's storage dtype (bf16 embeddings)."""
    cast = jax.tree.map(
        lambda mine, ref: ref.astype(mine.dtype), nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param)
    )
    nnx.update(model, cast)
    return model


def check_train_steps(fused, steps=8, B=8, seed=0):
    """Losses of `steps` optimizer steps: bf16 with `fused` attention vs float32 with XLA attention, same init."""
    from flaxchat.train.optim import build_optimizer
    from flaxchat.train.step import train_step

    # Two layers: at four, bf16 and fp32 part after the first step on any backend (the bf16 rounding noise in
    # x0_lambdas' gradient, exactly zero in exact arithmetic at init, becomes a full Adam step): a known issue of
    # the bf16 residual stream, not of the GPU path this test is about.
    config = small_config(n_layer=2)
    T, V = config.sequence_len, config.vocab_size
    rng = np.random.default_rng(seed)
    seqs = (rng.integers(0, V, (B, 1)) + np.arange(T + 1)[None]) % V  # learnable: +1 each position
    x, y = jnp.asarray(seqs[:, :-1], jnp.int32), jnp.asarray(seqs[:, 1:], jnp.int32)
    losses = {}
    for name, dtype, impl in (("bf16", jnp.bfloat16, fused), ("fp32", jnp.float32, "xla")):
        model = GPT(config, rngs=nnx.Rngs(seed), dtype=dtype, attention=impl)
        assert model.attention == impl
        optimizer = build_optimizer(model, polar_dtype=dtype, verbose=False)
        losses[name] = [float(train_step(model, optimizer, (x,), (y,))) for _ in range(steps)]
    bf16, fp32 = np.array(losses["bf16"]), np.array(losses["fp32"])
    assert np.all(np.isfinite(bf16)), bf16
    assert bf16[0] == pytest.approx(np.log(V), rel=0.02)  # nanochat's init: uniform predictions
    assert bf16[-1] < bf16[0] - 0.5, f"bf16 loss did not fall: {bf16}"
    np.testing.assert_allclose(bf16, fp32, rtol=0.03)
    return bf16, fp32


def check_cached_decode(fused, prefill=64, total=224, B=2, seed=0):
    """bf16 logits from the KV cache (a prefill, then one token per call, past the 128-token window) vs a bf16
    full forward with `fused` attention, both measured against a float32 XLA full forward of the same weights."""
    config = small_config()
    reference = random_weights(GPT(config, rngs=nnx.Rngs(0), dtype=jnp.float32, attention="xla"), seed)
    full_model = same_weights(GPT(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, attention=fused), reference)
    idx = jnp.asarray(np.random.default_rng(seed).integers(0, config.vocab_size, (B, total)), jnp.int32)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(jax.jit(lambda i: reference(i))(idx))  # (B, total, V) float32, XLA, no TF32
    full = np.asarray(nnx.jit(lambda m, i: m(i))(full_model, idx))  # bf16 compute, fused attention
    cache = full_model.init_cache(B, config.sequence_len)
    step = nnx.jit(lambda m, tok, c: m.forward_cached(tok, c))
    logits, cache = step(full_model, idx[:, :prefill], cache)
    cached = [np.asarray(logits)]
    for t in range(prefill, total):
        logits, cache = step(full_model, idx[:, t : t + 1], cache)
        cached.append(np.asarray(logits))
    cached = np.concatenate(cached, axis=1)  # (B, total, V)
    assert np.asarray(cache.pos).tolist() == [total] * B and cache.k[0].dtype == jnp.bfloat16
    err, full_err = rel_err(cached, want), rel_err(full, want)
    assert err <= max(2.0 * full_err, 1e-2), f"cached bf16 rel. error {err:.2e} vs full bf16 forward {full_err:.2e}"
    # the cached forward's top token is a top token of the full forward: bf16 logits (as nanochat's) tie often, and
    # argmax takes the first of tied tokens, which summation-order noise before the rounding may reorder
    picked = np.take_along_axis(full, cached.argmax(-1)[..., None], axis=-1)[..., 0]
    agree = float(np.mean(picked == full.max(-1)))
    assert agree >= 0.95, f"cached and full bf16 forwards pick the same top token at only {agree:.1%} of positions"
    return err, full_err, agree


# -----------------------------------------------------------------------------
# On a GPU


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("window", [128, 512], ids=["sliding", "full"])
def test_cudnn_attention_equals_xla_bf16(window):
    check_attention("cudnn", window)


@pytest.mark.gpu
@on_gpu
def test_bf16_cudnn_train_steps_track_fp32():
    check_train_steps("cudnn")


@pytest.mark.gpu
@on_gpu
def test_cached_decode_equals_full_forward_bf16():
    check_cached_decode("cudnn")


@pytest.mark.gpu
@on_gpu
def test_a_scatter_add_with_repeated_indices_compiles_to_native_fp32_atomics(tmp_path):
    """An embedding's gradient (a fp32 scatter-add whose indices repeat) as the training scripts compile it, with
    sharding.native_gpu_atomics: the kernel's PTX adds with the atomic instruction, no compare-and-swap loop."""
    code = (
        "from flaxchat.sharding import native_gpu_atomics; native_gpu_atomics(); import jax, jax.numpy as jnp; "
        "f = jax.jit(lambda t, i, u: t.at[i].add(u)); "
        "f(jnp.zeros((399, 128)), jnp.zeros(40960, jnp.int32), jnp.ones((40960, 128))).block_until_ready()"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cuda", "XLA_FLAGS": f"--xla_dump_to={tmp_path}"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ptx = "\n".join(p.read_text() for p in tmp_path.rglob("*.ptx") if "lambda" in p.name)
    if not ptx:  # jaxlib 0.11.2 on an H200 wrote the HLO but no PTX (nor LLVM IR with --xla_gpu_dump_llvmir)
        pytest.skip(f"this XLA wrote no PTX under --xla_dump_to (jax {jax.__version__}): nothing to read")
    native = r"\b(atom|red)\.[a-z0-9.]*(add\.f32|f32\.add)"  # scalar, or Hopper's vector form (v4.f32.add)
    assert re.search(native, ptx) and not re.search(r"\batom\.[a-z.]*cas\.b32", ptx)


# -----------------------------------------------------------------------------
# Everywhere: the CUDA compiler option, on a stand-in plugin


def stand_in_plugin(root, knows_the_option=True):
    """A folder laid out as JAX's CUDA plugin (jax_plugins/xla_cuda12/*.so) whose library names an LLVM option."""
    library = root / "jax_plugins" / "xla_cuda12" / "xla_cuda_plugin.so"
    library.parent.mkdir(parents=True)
    (library.parent / "__init__.py").write_text("")
    option = b"nvptx-allow-ftz-atomics" if knows_the_option else b"nvptx-short-ptr"
    library.write_bytes(b"\x7fELF" + b"\0" * 64 + option + b"\0" + b"\0" * 64)
    return library


def test_native_gpu_atomics_adds_the_llvm_option_where_the_cuda_compiler_knows_it(tmp_path, monkeypatch):
    from flaxchat import sharding

    library = stand_in_plugin(tmp_path / "knows")
    monkeypatch.setattr(sharding, "cuda_plugin_library", lambda: str(library))
    env = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}
    assert sharding.native_gpu_atomics(env)
    assert env["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer= --xla_backend_extra_options=-nvptx-allow-ftz-atomics"
    assert not sharding.native_gpu_atomics(env)  # named once
    env = {"XLA_FLAGS": "--xla_backend_extra_options=xla_gpu_a=1", "JAX_PLATFORMS": "cuda,cpu"}
    assert sharding.native_gpu_atomics(env)
    assert env["XLA_FLAGS"] == "--xla_backend_extra_options=xla_gpu_a=1,-nvptx-allow-ftz-atomics"
    # not on a CPU or TPU run, not where the user opted out or chose the denormal mode themselves
    for env in (
        {"JAX_PLATFORMS": "cpu"},
        {"JAX_PLATFORMS": "tpu"},
        {"FLAXCHAT_NATIVE_GPU_ATOMICS": "0"},
        {"XLA_FLAGS": "--xla_gpu_ftz=false"},
    ):
        before = dict(env)
        assert not sharding.native_gpu_atomics(env) and env == before
    # a compiler without the option would stop the process on it; no CUDA plugin, nothing to do
    unknown = stand_in_plugin(tmp_path / "unknown", knows_the_option=False)
    monkeypatch.setattr(sharding, "cuda_plugin_library", lambda: str(unknown))
    env = {}
    assert not sharding.native_gpu_atomics(env) and env == {}
    monkeypatch.setattr(sharding, "cuda_plugin_library", lambda: None)
    assert not sharding.native_gpu_atomics(env) and env == {}


def test_a_cpu_run_compiles_with_the_option_too():
    """With a CUDA plugin installed and no GPU, JAX falls back to the CPU, whose compiler then reads the same
    XLA_FLAGS: its LLVM knows the option (an unknown one stops the process), and programs compile as before."""
    from flaxchat import sharding

    code = (
        "import jax, jax.numpy as jnp; "
        "print(jax.jit(lambda t, i, u: t.at[i].add(u))(jnp.zeros(3), jnp.zeros(5, jnp.int32), jnp.ones(5))[0])"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_backend_extra_options={sharding.FTZ_ATOMICS}"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["5.0"], r.stderr[-2000:]


def test_the_cuda_plugin_library_is_found_where_jax_loads_plugins_from(tmp_path, monkeypatch):
    from flaxchat import sharding

    library = stand_in_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert sharding.cuda_plugin_library() == str(library)
    assert sharding.knows_option(str(library), sharding.FTZ_ATOMICS)


# -----------------------------------------------------------------------------
# Everywhere: runs/gpu_check.sh


def run_check(*args, env=None, timeout=300):
    return subprocess.run(
        ["bash", os.path.join(ROOT, "runs", "gpu_check.sh"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_gpu_check_help():
    r = run_check("--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--cpu", "--out", "--wheels", "--fetch-wheels", "--nanochat", "--no-install", "--only", "--profile"):
        assert flag in r.stdout


def test_gpu_check_stops_when_jax_is_not_on_a_gpu(tmp_path):
    """GPU mode on a CPU-only JAX: one clear sentence, a non-zero exit, and no benchmark started."""
    r = run_check("--out", str(tmp_path / "out"), env={"JAX_PLATFORMS": ""})
    assert r.returncode != 0
    assert "not on a GPU" in r.stderr, r.stderr[-2000:]
    assert not list((tmp_path / "out").glob("train_*"))


@pytest.mark.slow
def test_gpu_check_cpu_smoke(tmp_path, request):
    """The whole GPU check with tiny models on the CPU: every section present, with sane numbers, the training
    steps profiled (--profile); where PyTorch is installed, with --nanochat (a stand-in checkout) timing and
    profiling nanochat's step on each training shape too."""
    out = tmp_path / "out"
    nanochat = importlib.util.find_spec("torch") is not None
    extra = ["--profile"] + (["--nanochat", str(request.getfixturevalue("nanochat_checkout"))] if nanochat else [])
    t0 = time.perf_counter()
    r = run_check("--cpu", "--out", str(out), *extra)
    seconds = time.perf_counter() - t0
    assert r.returncode == 0, (
        f"gpu_check.sh --cpu failed after {seconds:.0f} s:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    )
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "cpu" and report["ok"] is True
    assert report["env"]["backend"] == "cpu" and report["env"]["device_count"] >= 1
    tests = report["tests"]
    assert tests["ok"] and tests["failed"] == 0 and tests["errors"] == 0
    assert tests["skipped"] >= 4 and tests["passed"] == 0  # the GPU tests above, each skipped with its reason
    assert [t["name"] for t in report["train"]] == [
        "train_d2",
        "train_d2_random_data",
        "train_d2_random_fresh_data",
        "train_d2_real_cycled_data",
        "train_d2_real_data",
        "train_d2_real_llvm_atomics_data",
        "train_d2_real_waited_data",
    ]
    assert [p["name"] for p in report["prepared"]] == ["real_data", "real_tokenizer"]
    assert all(p["ok"] for p in report["prepared"])
    for t in report["train"]:
        res = t["result"]
        assert t["ok"] and res["what"] == "train" and res["backend"] == "cpu"
        assert res["tok_per_s"] > 0 and 0 < res["mfu"] < 100 and res["compile_s"] >= 0 and res["peak_mem_gb"] > 0
        assert t["command"].startswith("python -m scripts.bench --what train")
        assert res["profile"]["steps"] == 2 and res["profile"]["by_kind"]["matmul"]["ms"] > 0
        assert isinstance(res["profile"]["scatters"], list)  # their combiners (test_gpt reads them in users' codegen)
        assert "--profile-steps 2:4" in t["command"]
    first, random_data, fresh, cycled, real_data, real_llvm_atomics, waited = (t["result"] for t in report["train"])
    assert "--window-pattern SSSL" in report["train"][0]["command"]
    if nanochat:
        assert first["nanochat"]["tok_per_s"] > 0 and first["vs_nanochat"] > 0
        assert first["nanochat"]["profile"]["steps"] == 2
    # the real pipeline's pair: the same model and accumulation, the loader's batches against random tokens
    assert random_data["data"] == "random tokens" and real_data["data"] == "grain loader"
    assert fresh["data"] == "random tokens, new arrays every step"
    assert cycled["data"] == "grain loader's first 2 steps, cycled"
    assert real_llvm_atomics["data"] == "grain loader"  # on a CPU the same run (no CUDA compiler to ask)
    assert waited["data"] == "grain loader" and waited["in_flight"] is False
    assert "--in-flight off" in report["train"][-1]["command"]
    for r in (fresh, cycled, real_data, real_llvm_atomics, waited):
        assert r["grad_accum"] == 2 and r["config"] == random_data["config"] and "nanochat" not in r
    if nanochat:  # a pair of real runs: nanochat's base_train (the stand-in), then scripts.pretrain
        (run,) = report["runs"]
        assert (
            run["ok"]
            and run["name"] == "run_d2_real"
            and run["command"].startswith("python -m scripts.bench --what run")
        )
        res = run["result"]
        assert res["timed_from_step"] == 3 and res["timed_steps"] == 2 and res["nanochat"]["timed_steps"] == 2
        assert res["step_s"] > 0 and res["vs_nanochat"] == pytest.approx(res["nanochat"]["step_s"] / res["step_s"])
        assert "## Real runs" in (out / "summary.md").read_text()
    else:
        assert report["runs"] == []
    assert [g["result"]["batch_size"] for g in report["generate"]] == [1, 4]
    for g in report["generate"]:
        assert g["ok"] and g["result"]["tok_per_s"] > 0 and g["result"]["ttft_s"] > 0
    serve = report["serve"]
    assert serve["ok"] and set(serve["result"]["median_tok_per_s"]) == {"1", "4"}
    assert all(v > 0 for v in serve["result"]["median_tok_per_s"].values())
    summary = (out / "summary.md").read_text()
    for heading in (
        "## Environment",
        "## Tests",
        "## Training",
        "## Where the time goes",
        "### train_d2: ",
        "### train_d2_real_data: ",
        "## Generation",
        "## Serving",
    ):
        assert heading in summary
    assert "2 accumulation steps, grain loader)" in summary and "2 accumulation steps)" in summary
    assert "2 accumulation steps, random tokens, new arrays every step)" in summary
    assert "| matmul | " in summary and "flaxchat's slowest ops" in summary
    assert "flaxchat's scatters (element type, combiner): " in summary
    assert (
        "flaxchat's lines of the program by the time of their ops" in summary and "`flaxchat/model/gpt.py:" in summary
    )
    assert ("nanochat's slowest ops" in summary) == nanochat
    assert f"{report['train'][0]['result']['tok_per_s']:,.0f}" in summary
    if nanochat:
        assert "| vs nanochat |" in summary and f"| {report['train'][0]['result']['vs_nanochat']:.2f}x |" in summary
    print(f"gpu_check.sh --cpu: {seconds:.1f} s")


@pytest.mark.slow
def test_gpu_check_only_runs_the_sections_asked_for(tmp_path):
    out = tmp_path / "out"
    r = run_check("--cpu", "--out", str(out), "--only", "real")
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] is True and report["sections"] == ["real"]
    assert [t["name"] for t in report["train"]] == [
        "train_d2_random_data",
        "train_d2_random_fresh_data",
        "train_d2_real_cycled_data",
        "train_d2_real_data",
        "train_d2_real_llvm_atomics_data",
        "train_d2_real_waited_data",
    ]
    assert report["tests"]["not_run"] and report["serve"]["not_run"] and report["generate"] == []
    summary = (out / "summary.md").read_text()
    assert summary.count("not run (`--only`)") == 3  # tests, generation, serving
    assert not (out / "tests.xml").exists() and not list(out.glob("generate_*"))


def test_gpu_check_only_names_its_sections():
    r = run_check("--cpu", "--only", "real,speed")
    assert r.returncode == 2 and "unknown section speed" in r.stderr


def test_summary_shows_whether_a_rows_steps_slow_down():
    from flaxchat.perf.gpu_report import drift_lines

    slowing = {"name": "train_d12_real_data", "ok": True, "result": {"times_s": [0.35] * 5 + [0.5] * 10 + [0.69] * 5}}
    short = {"name": "train_d2", "ok": True, "result": {"times_s": [0.1, 0.1]}}  # too few steps to say
    failed = {"name": "train_d20", "ok": False, "result": None}
    lines = drift_lines([slowing, short, failed])
    assert lines[-1] == "- train_d12_real_data: 350.0 -> 690.0" and len([x for x in lines if x.startswith("- ")]) == 1
    assert drift_lines([short, failed]) == []


def test_a_gpu_row_without_native_atomics_says_so():
    """The real_llvm_atomics row: a GPU run whose XLA_FLAGS lack the LLVM option is labelled; CPU rows and rows
    with it are not."""
    from flaxchat.perf.gpu_report import train_row

    record = {
        "config": {"n_layer": 12, "window_pattern": "L", "sequence_len": 2048},
        "num_params": 2.9e8,
        "dtype": "bfloat16",
        "grad_accum": 2,
        "data": "grain loader",
        "tokens_per_step": 131072,
        "tok_per_s": 2e5,
        "mfu": 20.0,
        "compile_s": 15.0,
        "peak_mem_gb": 60.0,
        "attention": "cudnn",
        "remat": "none",
        "peak_flops": 9.89e14,
        "peak_flops_source": "datasheet",
        "backend": "gpu",
    }
    label = lambda **kw: train_row({**record, **kw})[0]
    assert label(xla_flags="--xla_backend_extra_options=-nvptx-allow-ftz-atomics").endswith("grain loader)")
    assert label(xla_flags="").endswith("grain loader, fp32 atomic adds as LLVM compiles them)")
    assert label(xla_flags="", backend="cpu").endswith("grain loader)")
    native = "--xla_backend_extra_options=-nvptx-allow-ftz-atomics"
    # the real_waited row: each step waited for where the default keeps one in flight (a GPU); on a CPU both wait
    assert label(xla_flags=native, in_flight=False).endswith("grain loader, each step waited for)")
    assert label(xla_flags=native, in_flight=True).endswith("grain loader)")
    assert label(xla_flags="", backend="cpu", in_flight=False).endswith("grain loader)")
