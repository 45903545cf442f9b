"""Export to LiteRT (TFLite): prefill and one-token decode with the KV cache as explicit inputs and outputs.

Google's documented path from JAX to LiteRT: jax2tf wraps each step function (its StableHLO) in a TensorFlow
function, the parameters travel as tf.Variables (as orbax-export's JaxModule does, so large models stay under
protobuf's 2 GB limit), both functions are saved as one SavedModel with two signatures, and the TFLite converter
turns that into one `model.tflite` (optionally with fp16 or int8 weights through the converter's own
quantization). TensorFlow is imported only here, and only inside the functions that need it.

Signatures (batch 1, S = the cache capacity, L layers, Hkv kv heads, D head_dim, P = prefill chunk length):
    prefill(tokens (1, P), prev_token (1,), pos (1,), length (1,), k_cache, v_cache) -> logits (1, V), k_cache, v_cache
    decode(tokens (1, 1), prev_token (1,), pos (1,), k_cache, v_cache)               -> logits (1, V), k_cache, v_cache
k_cache/v_cache are (L, Hkv, S, D) float32. `pos` is where the tokens go (tokens already in the cache);
`prev_token` is the token at pos-1 (the smear reads its embedding; ignored at pos 0); prefill returns the logits
after its `length`-th token (a chunk is padded to P with anything). An app loops: zeros -> prefill the prompt
in P-sized chunks -> decode one token at a time, feeding each step's caches into the next.

Quantization is the converter's: fp16 stores every weight in float16; int8 is its dynamic-range mode (int8
matmul weights, blocks and lm_head, with float activations). That mode skips the embedding tables (the lookup
becomes GATHER_ND, which it does not quantize), so they stay float32 and at a small vocabulary with value
embeddings an int8 file can be larger than the fp16 one.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat.model.gpt import KVCache, rms_norm

MODEL_FILE = "model.tflite"
CONFIG_FILE = "litert_config.json"
FORMAT_NAME = "flaxchat-litert"
QUANTIZE = ("none", "fp16", "int8")


class LiteRTExportError(RuntimeError):
    """The converter refused the model; the message is one line naming the op it could not take."""


def _step(graphdef, params, tokens, prev_token, pos, logits_at, k_cache, v_cache):
    """forward_cached on a batch-1 cache held as stacked (L, Hkv, S, D) arrays (V too: the model keeps V as
    (Hkv, D, S) per layer, the exported format keeps one layout for both); the smear state is recomputed from
    prev_token as flaxchat.generate.programs.rewind does (so an app carries token ids, not embeddings)."""
    model = nnx.merge(graphdef, params)
    L = k_cache.shape[0]
    prev = rms_norm(model.transformer.wte(prev_token, model.dtype))  # (1, C)
    cache = KVCache(
        k=tuple(k_cache[i][None] for i in range(L)),
        v=tuple(v_cache[i][None].swapaxes(2, 3) for i in range(L)),
        pos=pos,
        prev_embedding=prev,
    )
    logits, cache = model.forward_cached(tokens, cache, logits_at=logits_at)
    return logits, jnp.stack([k[0] for k in cache.k]), jnp.stack([v[0].swapaxes(1, 2) for v in cache.v])


def litert_config(model, tokenizer, capacity: int, prefill_len: int, quantize: str, extra: dict | None = None) -> dict:
    """The JSON written beside model.tflite: signature shapes, cache layout, special-token ids."""
    c = model.config
    cache = [c.n_layer, c.n_kv_head, capacity, c.head_dim]
    io = lambda shape, dtype: {"shape": shape, "dtype": dtype}
    outputs = {
        "logits": io([1, c.vocab_size], "float32"),
        "k_cache": io(cache, "float32"),
        "v_cache": io(cache, "float32"),
    }
    step_inputs = lambda T: {"tokens": io([1, T], "int32"), "prev_token": io([1], "int32"), "pos": io([1], "int32")}
    specials = {name: tokenizer.encode_special(name) for name in sorted(tokenizer.get_special_tokens())}
    stops = [specials[s] for s in ("<|assistant_end|>", tokenizer.bos_token) if s in specials]
    return {
        "format": FORMAT_NAME,
        "version": 1,
        "model_file": MODEL_FILE,
        "quantize": quantize,
        "capacity": capacity,
        "prefill_len": prefill_len,
        "vocab_size": c.vocab_size,
        "cache_shape": cache,
        "cache_dtype": "float32",
        "signatures": {
            "prefill": {
                "inputs": {
                    **step_inputs(prefill_len),
                    "length": io([1], "int32"),
                    "k_cache": io(cache, "float32"),
                    "v_cache": io(cache, "float32"),
                },
                "outputs": outputs,
            },
            "decode": {
                "inputs": {**step_inputs(1), "k_cache": io(cache, "float32"), "v_cache": io(cache, "float32")},
                "outputs": outputs,
            },
        },
        "bos_token_id": tokenizer.get_bos_token_id(),
        "stop_token_ids": stops,
        "special_tokens": specials,
        "tokenizer_dir": "tokenizer",
        "model_config": c.to_dict(),
        **(extra or {}),
    }


def save_saved_model(model, path: str, capacity: int, prefill_len: int) -> None:
    """Write the prefill and decode signatures as a TensorFlow SavedModel (jax2tf, parameters as tf.Variables)."""
    import tensorflow as tf
    from jax.experimental import jax2tf

    if jnp.dtype(model.dtype) != jnp.float32:
        raise ValueError(
            f"LiteRT export wants a float32 model (load it with dtype=float32), got {jnp.dtype(model.dtype).name}; "
            "use --litert-quantize for smaller weights"
        )
    c = model.config
    graphdef, params = nnx.split(model)
    leaves, treedef = jax.tree.flatten(params)
    module = tf.Module()
    module.params = [tf.Variable(np.asarray(x), trainable=False, name=f"p{i}") for i, x in enumerate(leaves)]

    def run(leaves, tokens, prev_token, pos, logits_at, k_cache, v_cache):
        return _step(
            graphdef, jax.tree.unflatten(treedef, leaves), tokens, prev_token, pos, logits_at, k_cache, v_cache
        )

    step = jax2tf.convert(run, with_gradient=False)
    cache = tf.TensorSpec([c.n_layer, c.n_kv_head, capacity, c.head_dim], tf.float32)
    i32 = lambda *shape: tf.TensorSpec(shape, tf.int32)

    def named(out):
        return {"logits": out[0], "k_cache": out[1], "v_cache": out[2]}

    @tf.function(autograph=False, input_signature=[i32(1, prefill_len), i32(1), i32(1), i32(1), cache, cache])
    def prefill(tokens, prev_token, pos, length, k_cache, v_cache):
        return named(step(module.params, tokens, prev_token, pos, length - 1, k_cache, v_cache))

    @tf.function(autograph=False, input_signature=[i32(1, 1), i32(1), i32(1), cache, cache])
    def decode(tokens, prev_token, pos, k_cache, v_cache):
        return named(step(module.params, tokens, prev_token, pos, tf.zeros([1], tf.int32), k_cache, v_cache))

    module.prefill, module.decode = prefill, decode
    tf.saved_model.save(
        module, path, signatures={"prefill": prefill.get_concrete_function(), "decode": decode.get_concrete_function()}
    )


def converter_error_line(error) -> str:
    """One line from a ConverterError: the first op the converter named and what it said about it."""
    text = str(error)
    found = re.search(r"error: '([\w.]+)' op ([^\n]*)", text)
    if found:
        op, why = found.groups()
        hint = " (a StableHLO op inside the jax2tf module has no LiteRT kernel)" if op == "tf.XlaCallModule" else ""
        return f"the LiteRT converter cannot take this model: op {op} {why.strip()}{hint}"
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(error).__name__)
    return f"the LiteRT converter cannot take this model: {first[:300]}"


def convert_saved_model(path: str, quantize: str = "none") -> bytes:
    """SavedModel -> .tflite bytes with both signatures; fp16 / int8 (dynamic range) weights via the converter."""
    import tensorflow as tf
    from tensorflow.lite.python.convert_phase import ConverterError

    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
    converter = tf.lite.TFLiteConverter.from_saved_model(path, signature_keys=["prefill", "decode"])
    if quantize != "none":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]  # alone: int8 weights, float activations
        if quantize == "fp16":
            converter.target_spec.supported_types = [tf.float16]
    try:
        return converter.convert()
    except ConverterError as e:
        raise LiteRTExportError(converter_error_line(e)) from None


@contextlib.contextmanager
def _stderr_into(path: str):
    """Send file descriptor 2 to `path`: TensorFlow and the converter's MLIR diagnostics write there from C++
    (pages of locations and bytecode), which would bury the one line a failed export prints."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "w") as f:
            os.dup2(f.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def export_litert(
    model,
    tokenizer,
    out_dir: str,
    quantize: str = "none",
    capacity: int | None = None,
    prefill_len: int = 64,
    extra: dict | None = None,
) -> str:
    """Write model.tflite, tokenizer/ and litert_config.json into out_dir; returns the .tflite path."""
    capacity = capacity or model.config.sequence_len
    prefill_len = max(1, min(prefill_len, capacity))
    if tokenizer.get_vocab_size() != model.config.vocab_size:
        raise ValueError(f"tokenizer vocab {tokenizer.get_vocab_size()} != model vocab {model.config.vocab_size}")
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "converter.log")
        try:
            with _stderr_into(log):
                save_saved_model(model, os.path.join(tmp, "saved_model"), capacity, prefill_len)
                flatbuffer = convert_saved_model(os.path.join(tmp, "saved_model"), quantize)
        except LiteRTExportError as e:  # keep TensorFlow's full output for whoever wants the details
            kept = tempfile.NamedTemporaryFile(prefix="flaxchat-litert-", suffix=".log", delete=False).name
            os.replace(log, kept)
            raise LiteRTExportError(f"{e} (converter log: {kept})") from None
        finally:
            gc.collect()  # TensorFlow's traced graphs are reference cycles: free them now, not at interpreter exit
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, MODEL_FILE)
    with open(path + ".tmp", "wb") as f:
        f.write(flatbuffer)
    os.replace(path + ".tmp", path)
    tokenizer.save(os.path.join(out_dir, "tokenizer"))
    config = litert_config(model, tokenizer, capacity, prefill_len, quantize, extra)
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=1)
    return path
