"""Export a checkpoint: safetensors + config JSON, nanochat's own format, a Hugging Face model directory, or LiteRT
(TFLite) for phones and edge.

    python -m scripts.export -i sft --format safetensors --out exports/d4-sft          # any framework
    python -m scripts.export -i base --model-tag d20 --format nanochat --out ~/.cache/nanochat/base_checkpoints/d20
    python -m scripts.export -i sft --format litert --litert-quantize int8 --out exports/d4-litert  # flaxchat[export]
    python -m scripts.litert_chat exports/d4-litert -p "Tell me a story"                # run it, no JAX needed
    python -m scripts.export -i sft --format hf --out exports/d4-hf                     # transformers; flaxchat[hf]

The hf format writes a directory that transformers loads offline (`AutoModelForCausalLM.from_pretrained(OUT,
trust_remote_code=True)`, `AutoTokenizer.from_pretrained(OUT)`, whose chat template renders chats as flaxchat does);
see docs/export.md. Writing it needs the `tokenizers` package; running it, torch and transformers.

The nanochat format writes `model_<step>.pt` + `meta_<step>.json` (and, with --with-tokenizer, `tokenizer.pkl` +
`token_bytes.pt` into --tokenizer-out) so nanochat's scripts can load flaxchat models; it needs `flaxchat[torch]`.

The litert format writes `model.tflite` (signatures `prefill` and `decode`, the KV cache as explicit inputs and
outputs; see flaxchat/export/litert.py), `tokenizer/` and `litert_config.json` (shapes, special-token ids). It converts
through jax2tf -> SavedModel -> the TFLite converter, so it needs `pip install -e ".[export]"` (TensorFlow).
"""

import argparse
import os
import shutil
import sys

import jax.numpy as jnp

from flaxchat.common import get_base_dir, parse_args, print0, quiet_library_logs
from flaxchat.export.hf import export_hf, push_to_hub
from flaxchat.export.litert import QUANTIZE, LiteRTExportError, export_litert
from flaxchat.export.nanochat import save_nanochat_checkpoint, save_nanochat_tokenizer, save_safetensors
from flaxchat.train.checkpoint import load_model, model_tag_arg


def build_parser():
    p = argparse.ArgumentParser(
        description="Export a flaxchat checkpoint to safetensors, nanochat format, a Hugging Face model directory "
        "or LiteRT (model.tflite with prefill + KV-cache decode signatures; run it with "
        "`python -m scripts.litert_chat OUT`)."
    )
    p.add_argument("-i", "--source", choices=["base", "sft", "rl"], default="sft", help="which training phase")
    p.add_argument(
        "--model-tag", type=model_tag_arg, default=None, help="model tag (default: the largest model of the phase)"
    )
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument(
        "--format",
        choices=["safetensors", "nanochat", "hf", "litert"],
        default="safetensors",
        help="output format (hf: a transformers model directory, needs flaxchat[hf]; litert: model.tflite + "
        "tokenizer/ + litert_config.json, needs flaxchat[export])",
    )
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="safetensors (and hf) weight dtype"
    )
    p.add_argument("--out", type=str, required=True, help="output directory")
    p.add_argument(
        "--push-to-hub",
        type=str,
        default=None,
        metavar="REPO",
        help="hf format: then upload the directory to the Hub as model repo REPO (user/name; HF_TOKEN or `hf auth "
        "login`)",
    )
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    p.add_argument("--with-tokenizer", action="store_true", help="also write the tokenizer in the target format")
    p.add_argument(
        "--tokenizer-out", type=str, default=None, help="nanochat format: where tokenizer.pkl goes (default --out)"
    )
    p.add_argument(
        "--litert-quantize",
        choices=QUANTIZE,
        default="none",
        help="litert weights: none (float32), fp16, or int8 (dynamic range: int8 weights, float activations)",
    )
    p.add_argument(
        "--litert-prefill-len",
        type=int,
        default=64,
        help="litert: tokens per prefill call (longer prompts go in chunks)",
    )
    p.add_argument(
        "--litert-cache-len",
        type=int,
        default=None,
        help="litert: KV-cache capacity in tokens (default: the model's sequence_len)",
    )
    return p


def main(argv=None):
    quiet_library_logs()
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        # LiteRT converts a float32 graph; its own quantization makes the smaller variants. hf: the embedding tables
        # are stored in the compute dtype, so a float32 load keeps them exact (--dtype narrows them on writing)
        dtype = jnp.float32 if args.format in ("litert", "hf") else None
        model, tokenizer, meta = load_model(args.source, args.model_tag, args.step, dtype=dtype)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    step = meta["step"]
    if args.push_to_hub and args.format != "hf":
        sys.exit("error: --push-to-hub uploads a Hugging Face export: add --format hf")
    out = os.path.expanduser(args.out)
    extra = {"phase": args.source, "step": step, "tokenizer_hash": tokenizer.content_hash}
    try:
        if args.format == "safetensors":
            path = save_safetensors(model, out, args.dtype, extra_config=extra)
            if args.with_tokenizer:
                shutil.copytree(
                    os.path.join(get_base_dir(), "tokenizer"), os.path.join(out, "tokenizer"), dirs_exist_ok=True
                )
        elif args.format == "hf":
            path = export_hf(model, tokenizer, out, args.dtype, extra=extra)
            if args.push_to_hub:
                message = f"flaxchat {args.source} step {step}"
                try:
                    print0(f"uploaded to {push_to_hub(out, args.push_to_hub, args.private, message)}")
                except OSError as e:  # the Hub's HTTP errors are OSErrors; the export itself is written
                    sys.exit(f"error: {path} is written, but uploading it to {args.push_to_hub} failed: {e}")
        elif args.format == "litert":
            path = export_litert(
                model,
                tokenizer,
                out,
                args.litert_quantize,
                capacity=args.litert_cache_len,
                prefill_len=args.litert_prefill_len,
                extra=extra,
            )
        else:
            nano_meta = {"step": step, "val_bpb": meta.get("val_bpb"), "exported_from": "flaxchat", **extra}
            path = save_nanochat_checkpoint(model, out, step, meta=nano_meta)
            if args.with_tokenizer:
                save_nanochat_tokenizer(tokenizer, os.path.expanduser(args.tokenizer_out or out))
    except ImportError as e:
        hints = {"litert": ' install the export extra: pip install -e ".[export]"', "hf": ' pip install -e ".[hf]"'}
        hint = ";" + hints[args.format] if args.format in hints else ""
        sys.exit(f"error: {e}{hint}")
    except LiteRTExportError as e:
        sys.exit(f"error: {e}")
    print0(f"exported {args.source} step {step} ({model.config.n_layer} layers, {model.config.n_embd} wide) -> {path}")


if __name__ == "__main__":
    main()
