"""nanochat interop: its PyTorch state dicts and checkpoints in, and out.

flaxchat stores parameters under nanochat's names and in its layout, so a state dict maps across by name
with no transposes. torch is only needed to read/write `.pt` files (`pip install "flaxchat[torch]"`).
"""

from __future__ import annotations

import glob
import json
import os
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT


def _param_paths(model: GPT) -> dict[str, nnx.Variable]:
    return {".".join(map(str, path)): var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _to_numpy(value) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor; bf16 has no numpy dtype, so go through fp32
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def _complete_state_dict(state_dict: dict, config: GPTConfig) -> dict:
    """Strip torch.compile's `_orig_mod.` prefix and fill scalars that older nanochat checkpoints lack."""
    sd = {k.removeprefix("_orig_mod."): v for k, v in state_dict.items()}
    sd.setdefault("resid_lambdas", np.ones(config.n_layer, np.float32))
    sd.setdefault("x0_lambdas", np.zeros(config.n_layer, np.float32))
    return sd


def from_nanochat_state_dict(state_dict: dict, config: GPTConfig, dtype=None) -> GPT:
    """Build a GPT whose parameters are nanochat's `model.state_dict()` (numpy arrays or torch tensors).

    Keys and shapes must match exactly; a mismatch raises ValueError naming the offending keys.
    """
    sd = _complete_state_dict(state_dict, config)
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0), dtype=dtype))
    params = _param_paths(model)
    missing = sorted(set(params) - set(sd))
    unexpected = sorted(set(sd) - set(params))
    if missing or unexpected:
        raise ValueError(f"state dict does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, var in params.items():
        value = _to_numpy(sd[name])
        if value.shape != var.shape:
            raise ValueError(f"{name}: checkpoint shape {value.shape} != model shape {var.shape}")
        var.set_value(jnp.asarray(value, dtype=jnp.float32))  # master weights are fp32
    return model


def to_nanochat_state_dict(model: GPT) -> dict[str, np.ndarray]:
    """nanochat's state-dict keys -> fp32 numpy arrays (gathered to host)."""
    return {name: np.array(var[...], dtype=np.float32) for name, var in _param_paths(model).items()}


def _require_torch():
    try:
        import torch
    except ImportError:
        raise ImportError('reading nanochat .pt checkpoints needs PyTorch: pip install "flaxchat[torch]"') from None
    return torch


def latest_step(checkpoint_dir: str) -> int:
    steps = [
        int(m.group(1))
        for f in glob.glob(os.path.join(checkpoint_dir, "model_*.pt"))
        if (m := re.search(r"model_(\d+)\.pt$", f))
    ]
    if not steps:
        raise FileNotFoundError(f"no nanochat model_<step>.pt checkpoint in {checkpoint_dir}")
    return max(steps)


def load_nanochat_checkpoint(checkpoint_dir: str, step: int | None = None, dtype=None) -> tuple[GPT, dict]:
    """Read nanochat's `model_<step>.pt` + `meta_<step>.json` (latest step by default) -> (GPT, meta)."""
    torch = _require_torch()
    step = latest_step(checkpoint_dir) if step is None else step
    model_path = os.path.join(checkpoint_dir, f"model_{step:06d}.pt")
    meta_path = os.path.join(checkpoint_dir, f"meta_{step:06d}.json")
    for path in (model_path, meta_path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"nanochat checkpoint file not found: {path}")
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    if "model_config" not in meta:
        raise ValueError(f"{meta_path} has no 'model_config'; is it a nanochat checkpoint?")
    cfg = dict(meta["model_config"])
    cfg.setdefault("window_pattern", "L")  # nanochat checkpoints from before sliding windows were full-context
    config = GPTConfig.from_dict(cfg)
    state_dict = torch.load(model_path, map_location="cpu", weights_only=True)
    return from_nanochat_state_dict(state_dict, config, dtype=dtype), meta


def save_nanochat_checkpoint(model: GPT, checkpoint_dir: str, step: int, meta: dict | None = None) -> str:
    """Write `model_<step>.pt` + `meta_<step>.json` that nanochat's checkpoint_manager can load."""
    torch = _require_torch()
    os.makedirs(checkpoint_dir, exist_ok=True)
    sd = {k: torch.from_numpy(v) for k, v in to_nanochat_state_dict(model).items()}
    model_path = os.path.join(checkpoint_dir, f"model_{step:06d}.pt")
    torch.save(sd, model_path)
    meta = dict(meta or {})
    meta["model_config"] = model.config.to_dict()
    meta.setdefault("step", step)
    with open(os.path.join(checkpoint_dir, f"meta_{step:06d}.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    return model_path


# -----------------------------------------------------------------------------
# safetensors (+ config JSON): a framework-neutral export


def save_safetensors(model: GPT, out_dir: str, dtype: str = "float32", extra_config: dict | None = None) -> str:
    """Write `model.safetensors` (nanochat's key names) and `config.json` (GPTConfig + extra) into out_dir."""
    from safetensors.numpy import save_file

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    os.makedirs(out_dir, exist_ok=True)
    tensors = to_nanochat_state_dict(model)
    if dtype == "bfloat16":
        import ml_dtypes

        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    path = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, path + ".tmp", metadata={"format": "flaxchat", "dtype": dtype})
    os.replace(path + ".tmp", path)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**(extra_config or {}), "model_config": model.config.to_dict(), "dtype": dtype}, f, indent=2)
    return path


def load_safetensors(out_dir: str, dtype=None) -> tuple[GPT, dict]:
    """Inverse of save_safetensors: (GPT with fp32 master weights, config JSON)."""
    from safetensors.numpy import load_file

    cfg_path, st_path = os.path.join(out_dir, "config.json"), os.path.join(out_dir, "model.safetensors")
    for path in (cfg_path, st_path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"not a flaxchat export (missing {os.path.basename(path)}): {out_dir}")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    tensors = {k: np.asarray(v, dtype=np.float32) for k, v in load_file(st_path).items()}
    return from_nanochat_state_dict(tensors, GPTConfig.from_dict(cfg["model_config"]), dtype=dtype), cfg


def save_nanochat_tokenizer(tokenizer, out_dir: str) -> str:
    """nanochat's `tokenizer.pkl` (a pickled tiktoken Encoding) + `token_bytes.pt`, so its scripts can load ours."""
    import pickle

    torch = _require_torch()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.pkl")
    with open(path, "wb") as f:
        pickle.dump(tokenizer.enc, f)
    torch.save(
        torch.tensor(np.asarray(tokenizer.token_bytes(), dtype=np.int32)), os.path.join(out_dir, "token_bytes.pt")
    )
    return path
