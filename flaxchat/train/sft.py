"""SFT's start and its schedules (scripts.sft, nanochat's chat_sft): the base model and its optimizer's moments
restored straight onto the mesh, the flags a run inherits from its base, the optimizer (MuonAdamW, or AdamW on LoRA
adapters), what a checkpoint keeps and a resumed run restores, and the LR and momentum that follow the run.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from flaxchat.common import print0
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT
from flaxchat.model.lora import adapter_modules, apply_lora
from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir, git_commit
from flaxchat.train.flags import optimizer_lrs
from flaxchat.train.optim import Schedule, build_lora_optimizer, build_optimizer

# flag -> (fallback, where the base checkpoint keeps it): the flags left at None inherit from the base model
INHERITED = {
    "max_seq_len": (2048, "meta"),
    "device_batch_size": (32, "meta"),
    "total_batch_size": (524288, "meta"),
    "embedding_lr": (0.3, "user_config"),
    "unembedding_lr": (0.004, "user_config"),
    "matrix_lr": (0.02, "user_config"),
}


def inherit(args, meta: dict) -> None:
    """Fill flags left at None from the base checkpoint, as nanochat does (explicit flags win)."""
    for name, (fallback, where) in INHERITED.items():
        source = meta if where == "meta" else meta.get("user_config", {})
        saved = source.get(name)
        if getattr(args, name) is None:
            setattr(args, name, saved if saved is not None else fallback)
            print0(f"inherited {name}={getattr(args, name)} from the base checkpoint")
        elif saved is not None and getattr(args, name) != saved:
            print0(f"--{name.replace('_', '-')}={getattr(args, name)} overrides the base checkpoint's {saved}")


# -----------------------------------------------------------------------------
# Model and optimizer from the base checkpoint


def restore_base(model_tag, step, mesh, dtype, with_optimizer: bool, **model_kwargs):
    """(model, optimizer inner state or None, meta, step) restored straight onto the mesh; model_kwargs go to
    GPT (attention, remat)."""
    ckpt = Checkpointer(checkpoint_dir("base", model_tag), async_save=False, read_only=True)
    try:
        meta = ckpt.read_meta(step)
        step = meta["step"]
        config = GPTConfig.from_dict(meta["model_config"])
        model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0), dtype=dtype, **model_kwargs))
        base_opt = None
        if with_optimizer and os.path.isdir(os.path.join(ckpt.directory, str(step), "optimizer")):
            # pretraining's optimizer follows a Schedule; only its inner state (moments, momentum buffers)
            # carries over, and that has the same structure whatever the schedule
            base_opt = nnx.eval_shape(lambda m: build_optimizer(m, schedule=Schedule(1)), model)
        ckpt.restore(model, base_opt, step=step, mesh=mesh)
    finally:
        ckpt.close()
    inner = None if base_opt is None else nnx.state(base_opt)["opt_state"]["inner_state"]
    return model, inner, meta, step


def sft_optimizer(model, lora, base_inner, args, mesh):
    """(model, optimizer, trainable): with `lora` the model with adapters and AdamW on them alone (--lora-lr; the
    base frozen, so the base optimizer's moments are of no use), else MuonAdamW over every weight at the flags' LRs
    with the base run's moments (base_inner) when there are some. trainable: the nnx filter of what trains.
    ValueError: LoRA targets that match no matrix."""
    if lora is not None:
        model = apply_lora(model, lora, seed=args.seed)
        optimizer = build_lora_optimizer(model, args.lora_lr, lora)
        print0(
            f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on {len(adapter_modules(model))} matrices ({lora.targets}) | "
            f"AdamW lr {args.lora_lr:g} on the adapters{''.join(', ' + n for n in lora.full)}; the rest frozen"
        )
        return model, optimizer, lora.trainable()
    # nanochat: weight decay 0 (pretraining ends with it decayed to zero); LRs x init_lr_frac via the multiplier
    with jax.set_mesh(mesh):
        optimizer = build_optimizer(model, **optimizer_lrs(args), weight_decay=0.0)
    if base_inner is not None:
        nnx.update(optimizer, nnx.State({"opt_state": {"inner_state": base_inner}}))
        print0("optimizer state warm-started from the base checkpoint (moments only; SFT's own LRs)")
    elif args.load_optimizer:
        print0("warning: the base checkpoint has no optimizer state; starting with a fresh optimizer")
    return model, optimizer, nnx.Param


# -----------------------------------------------------------------------------
# Checkpoints: what one keeps, and a resumed run


def fresh_loop() -> dict:
    """The loop state of a run at step 0 (a checkpoint keeps it; --resume continues from it)."""
    return {
        "step": 0,
        "smooth": 0.0,
        "train_time": 0.0,
        "val_bpb": None,
        "min_val_bpb": float("inf"),
        "last_step": False,
        "progress": 0.0,
    }


def checkpoint_meta(args, loop, user_config, which, base_ref, tokenizer_hash, lora) -> dict:
    """What an SFT checkpoint keeps beside the weights: the flags, the batch, the mixture and --chats, the base it
    started from, the tokenizer, the commit, the loop state, and the LoRA settings (load_model merges them)."""
    return {
        "val_bpb": loop["val_bpb"],
        "user_config": user_config,
        "max_seq_len": args.max_seq_len,
        "device_batch_size": args.device_batch_size,
        "total_batch_size": args.total_batch_size,
        "mixture": which,
        "chats": [list(d) for d in args.chats],
        "base": base_ref,
        "tokenizer_hash": tokenizer_hash,
        "git_commit": git_commit(),
        "loop_state": loop,
        **({"lora": lora.to_dict()} if lora is not None else {}),
    }


def resume(out_dir, model, optimizer, train_loader, mesh, trainable, lora, base_ref) -> tuple[dict, int]:
    """Restore the latest checkpoint of out_dir into model (its `trainable` Variables), optimizer and train_loader;
    returns (loop state, step). The checkpoint must come from a run with the same base, LoRA settings and readers."""
    ckpt = Checkpointer(out_dir, async_save=False, read_only=True)
    try:
        step = ckpt.latest_step()
        meta = ckpt.read_meta(step)
        if meta.get("lora") != (lora.to_dict() if lora is not None else None) or meta.get("base") != base_ref:
            raise ValueError(
                f"the checkpoint in {out_dir} (step {step}) was trained from {meta.get('base')} with LoRA "
                f"{meta.get('lora')}; these flags ask for {base_ref} with LoRA {lora}"
            )
        if "loop_state" not in meta or meta["loop_state"]["last_step"]:
            raise ValueError(f"the run in {out_dir} already finished at step {step}")
        info = ckpt.restore(model, optimizer, step=step, mesh=mesh, params=trainable)
    finally:
        ckpt.close()
    states = info["data_states"] or []
    if len(states) != jax.process_count():
        raise ValueError(f"the checkpoint has data positions for {len(states)} processes; resume on as many")
    train_loader.set_state(states[jax.process_index()])
    return meta["loop_state"], step


# -----------------------------------------------------------------------------
# Schedules (nanochat's chat_sft: the LR follows progress through the data, since an epoch's length in
# steps is not known in advance)


def lr_multiplier(progress: float, warmup_ratio: float, warmdown_ratio: float, final_lr_frac: float) -> float:
    # progress counts conversations taken and ends an epoch a little past 1.0; past 1 the LR stays at its
    # final value (nanochat's formula would turn it negative there)
    progress = min(progress, 1.0)
    if progress < warmup_ratio:
        return (progress + 1e-8) / warmup_ratio
    if progress <= 1.0 - warmdown_ratio:
        return 1.0
    decay = (progress - (1.0 - warmdown_ratio)) / warmdown_ratio
    return (1 - decay) * 1.0 + decay * final_lr_frac


def muon_momentum(step: int) -> float:
    frac = min(step / 300, 1)
    return (1 - frac) * 0.85 + frac * 0.95


def set_hyperparams(optimizer, **values) -> None:
    """Write the optimizer's injected hyperparameters (lr_multiplier, muon_momentum) before a step."""
    for name, value in values.items():
        var = optimizer.opt_state.hyperparams[name]
        var[...] = jnp.asarray(value, var.dtype)
