"""Checkpoints with Orbax: model, optimizer state, data-loader state and metadata, saved atomically.

Layout (like nanochat's): <base_dir>/{base,chatsft,chatrl}_checkpoints/<model_tag>/<step>/{model,optimizer,data,meta}.
Orbax writes each step into a temporary directory and renames it when complete, so a save killed at any moment
never leaves something that loads as a checkpoint. Restores go straight into abstract state with the target
shardings, so parameters are allocated once, on the mesh you restore onto (which may differ from the saving mesh).

A new run under a tag that holds an earlier run's checkpoints replaces them, as nanochat does, but never loses
them first: they move aside (<phase dir>/.replaced/<tag>/) just before the new run's first save and are deleted
once that save is committed; a run that dies before then leaves them to be put back by the next reader or writer
of the tag. Tags are plain names, so a tag can never lead outside its phase directory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as ocm

from flaxchat.common import get_base_dir, is_main_process, print0
from flaxchat.data.tokenizer import get_tokenizer
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT
from flaxchat.model.lora import LoraConfig, apply_lora, merge_lora
from flaxchat.sharding import state_shardings

PHASE_DIRS = {"base": "base_checkpoints", "sft": "chatsft_checkpoints", "rl": "chatrl_checkpoints"}
TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # a plain directory name: no separators, no "..", no dot first
REPLACED = ".replaced"  # where an earlier run's checkpoints wait while a new run under its tag makes its first save


def check_model_tag(tag: str) -> str:
    """`tag` if it is a plain name (letters, digits, '.', '_', '-'; not starting with a dot), else ValueError."""
    if not isinstance(tag, str) or not TAG.fullmatch(tag) or ".." in tag:
        raise ValueError(f"model tag {tag!r} is not a plain name: use letters, digits, '.', '_' and '-' (e.g. d12)")
    return tag


def model_tag_arg(text: str) -> str:
    """argparse type for --model-tag and the like: a bad tag is a one-line usage error."""
    try:
        return check_model_tag(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def checkpoint_dir(phase: str, model_tag: str, base_dir: str | None = None) -> str:
    if phase not in PHASE_DIRS:
        raise ValueError(f"unknown checkpoint phase {phase!r}; choose one of {', '.join(PHASE_DIRS)}")
    return os.path.join(base_dir or get_base_dir(), PHASE_DIRS[phase], check_model_tag(model_tag))


def committed_steps(directory: str) -> list[int]:
    """The steps whose saves were committed in `directory` (Orbax renames a step's folder to its number when the
    save is complete; unfinished saves keep a temporary name)."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def _owner_is_running(aside: str) -> bool:
    """Whether the run that set `aside` up is still running on this machine (this process or another: its first save
    may be under way, and the checkpoints there are its to drop or keep)."""
    try:
        with open(os.path.join(aside, "owner.json"), encoding="utf-8") as f:
            owner = json.load(f)
        if owner["host"] != socket.gethostname():
            return False
        os.kill(owner["pid"], 0)
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def abstract_state(tree, mesh=None):
    """ShapeDtypeStructs (with target shardings) for every Variable of `tree` (a model or an nnx.Optimizer)."""
    state = nnx.state(tree)
    if mesh is None:
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=single), state)
    shardings = state_shardings(state, mesh)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def _gather_json(obj) -> list:
    """Every process's JSON-able object, on every process (data-loader states are per process)."""
    if jax.process_count() == 1:
        return [obj]
    raw = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    lengths = multihost_utils.process_allgather(np.array([raw.size], np.int32)).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: raw.size] = raw
    everyone = multihost_utils.process_allgather(padded).reshape(len(lengths), -1)
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(everyone, lengths)]


class Checkpointer:
    """Keeps the last `keep` checkpoints plus the `keep_best` with the lowest val_bpb.

    read_only: only read what is there (loading a model): a directory with no checkpoint is FileNotFoundError, and
    nothing is created."""

    def __init__(
        self, directory: str, keep: int = 2, keep_best: int = 1, async_save: bool = True, read_only: bool = False
    ):
        self.directory = os.path.abspath(os.path.expanduser(directory))
        self.aside = os.path.join(os.path.dirname(self.directory), REPLACED, os.path.basename(self.directory))
        self.replacing = False  # an earlier run's checkpoints are aside until this run's first save is committed
        self._settle_earlier_run()
        if read_only and not committed_steps(self.directory):
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        policies = [ocm.preservation_policy.LatestN(n=keep)]
        if keep_best:
            policies.append(
                ocm.preservation_policy.BestN(
                    get_metric_fn=lambda m: m["val_bpb"],
                    reverse=True,
                    n=keep_best,
                    keep_checkpoints_without_metrics=False,
                )
            )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocm.preservation_policy.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,  # leftovers of a killed save are removed, never loaded
            create=not read_only,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(
        self,
        step: int,
        model,
        optimizer=None,
        data_state=None,
        meta: dict | None = None,
        metrics: dict | None = None,
        params=nnx.Param,
    ) -> None:
        """Start an (async) save of everything needed to resume at `step`; call wait() before exiting.

        params: which of the model's Variables to save (LoraConfig.trainable(): a LoRA run's trained weights alone)."""
        self._drop_earlier_run()  # once the first save is committed; until then, again at the next save or wait
        # saved_at tells this step's weights from another run's at the same tag and step (a LoRA run's base)
        meta = {**(meta or {}), "step": step, "model_config": model.config.to_dict(), "saved_at": time.time()}
        items = {"model": ocp.args.StandardSave(nnx.state(model, params)), "meta": ocp.args.JsonSave(meta)}
        if optimizer is not None:
            items["optimizer"] = ocp.args.StandardSave(nnx.state(optimizer))
        if data_state is not None:
            items["data"] = ocp.args.JsonSave({"processes": _gather_json(data_state)})
        self.manager.save(step, args=ocp.args.Composite(**items), metrics=metrics, force=True)

    def replace_earlier_run(self) -> None:
        """Move checkpoints an earlier run left in this directory aside; a new run calls it just before its first
        save, and they are deleted once that save is committed (wait, close).

        As nanochat, a new run replaces the model under its tag; left in place, an earlier run's later steps would
        be what `load_model` and `--resume` pick as the latest (and saving a step it already has fails). Moved, not
        deleted, so a run killed before its first checkpoint is complete loses nothing: the next Checkpointer on
        this directory puts them back.
        """
        steps = self.all_steps()
        if not steps:
            return
        print0(
            f"replacing the checkpoints of an earlier run in {self.directory} (steps {sorted(steps)}) once this "
            "run's first save is complete"
        )
        if is_main_process():
            shutil.rmtree(self.aside, ignore_errors=True)  # a stale copy from a crash after a committed save
            os.makedirs(self.aside)
            with open(os.path.join(self.aside, "owner.json"), "w", encoding="utf-8") as f:
                json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
            for step in steps:
                os.rename(os.path.join(self.directory, str(step)), os.path.join(self.aside, str(step)))
        _sync("flaxchat-replace-earlier-run")
        self.manager.reload()
        self.replacing = True

    def _settle_earlier_run(self) -> None:
        """An earlier run's checkpoints set aside by a run that has since stopped: deleted if that run committed a
        checkpoint, put back if it did not."""
        if not os.path.isdir(self.aside) or _owner_is_running(self.aside):
            return
        if is_main_process():
            if committed_steps(self.directory):
                shutil.rmtree(self.aside, ignore_errors=True)
            else:
                steps = committed_steps(self.aside)
                os.makedirs(self.directory, exist_ok=True)
                for step in steps:
                    os.rename(os.path.join(self.aside, str(step)), os.path.join(self.directory, str(step)))
                shutil.rmtree(self.aside, ignore_errors=True)
                print0(
                    f"put back the checkpoints of an earlier run in {self.directory} (steps {steps}): the run "
                    "that was replacing them stopped before its first save was complete"
                )
        _sync("flaxchat-settle-earlier-run")

    def _drop_earlier_run(self) -> None:
        if self.replacing and committed_steps(self.directory):
            if is_main_process():
                shutil.rmtree(self.aside, ignore_errors=True)
            self.replacing = False

    def wait(self) -> None:
        self.manager.wait_until_finished()
        self._drop_earlier_run()

    def read_meta(self, step: int | None = None) -> dict:
        return self._read_json("meta", step)

    def read_data_states(self, step: int | None = None) -> list:
        """Every process's data-loader state saved at `step` (one per process, in process order)."""
        return self._read_json("data", step)["processes"]

    def _read_json(self, item: str, step: int | None) -> dict:
        step = self._resolve(step)
        return self.manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))[item]

    def restore(self, model, optimizer=None, step: int | None = None, mesh=None, params=nnx.Param) -> dict:
        """Restore into `model` (and `optimizer`), which may be abstract (nnx.eval_shape); returns
        {"step", "meta", "data_states"}: data_states holds every saving process's loader state (or None), so a
        loader on another number of processes can carry the data position over. params: as in `save`."""
        step = self._resolve(step)
        items = {
            "model": ocp.args.StandardRestore(abstract_state(nnx.state(model, params), mesh)),
            "meta": ocp.args.JsonRestore(),
        }
        if optimizer is not None:
            items["optimizer"] = ocp.args.StandardRestore(abstract_state(optimizer, mesh))
        has_data = os.path.isdir(os.path.join(self.directory, str(step), "data"))
        if has_data:
            items["data"] = ocp.args.JsonRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        nnx.update(model, restored["model"])
        if optimizer is not None:
            nnx.update(optimizer, restored["optimizer"])
        data_states = restored["data"]["processes"] if has_data else None
        return {"step": step, "meta": restored["meta"], "data_states": data_states}

    def _resolve(self, step):
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step is None:
            return max(steps)
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory} (have {sorted(steps)})")
        return step

    def close(self) -> None:
        self.wait()
        self.manager.close()


# Where models may be besides the base dir itself: the laptop demo's folder (scripts.run_tinystories keeps its data,
# tokenizer and checkpoints in <base dir>/tinystories, so that a demo never overwrites a pipeline's own).
DEMO_FOLDER = "tinystories"


def _tags(phase: str, base_dir: str) -> list[str]:
    """The model tags with at least one committed checkpoint under base_dir's phase directory."""
    root = os.path.join(base_dir, PHASE_DIRS[phase])
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(t for t in names if TAG.fullmatch(t) and committed_steps(os.path.join(root, t)))


def find_model_tag(phase: str, base_dir: str | None = None) -> str:
    """The largest model under a phase directory (d26 beats d4), as nanochat guesses it."""
    base = base_dir or get_base_dir()
    tags = _tags(phase, base)
    if not tags:
        hint = {"base": "python -m scripts.pretrain", "sft": "python -m scripts.sft", "rl": "python -m scripts.rl"}
        demo = os.path.join(base, DEMO_FOLDER)
        also = f"; the laptop demo's are in {demo}: run with FLAXCHAT_BASE_DIR={demo}" if _tags(phase, demo) else ""
        root = os.path.join(base, PHASE_DIRS[phase])
        raise FileNotFoundError(f"no {phase} checkpoints under {root}; train one first with `{hint[phase]}`{also}")
    depth = lambda t: int(t[1:]) if t[1:].isdigit() else -1
    return max(tags, key=lambda t: (depth(t), t))


def find_model(phase: str, model_tag: str | None = None) -> tuple[str, str, list[str]]:
    """(base_dir, model_tag, places) for a script that only reads a model: the newest (by its latest save) of the
    base dir's own model and the laptop demo's, each its folder's largest or the one tagged `model_tag`; `places`
    are the folders that had one. FileNotFoundError, saying where to look, when neither has."""
    base = get_base_dir()
    found = []
    for place in (base, os.path.join(base, DEMO_FOLDER)):
        tags = _tags(phase, place)
        if model_tag:
            tag = model_tag if model_tag in tags else None
        else:
            tag = find_model_tag(phase, place) if tags else None
        if tag:
            directory = checkpoint_dir(phase, tag, place)
            found.append((os.path.getmtime(os.path.join(directory, str(committed_steps(directory)[-1]))), place, tag))
    if not found:
        if model_tag:  # as load_model says it
            raise FileNotFoundError(f"no checkpoint in {checkpoint_dir(phase, model_tag, base)}")
        find_model_tag(phase, base)  # raises, naming the base dir's phase directory
    _, place, tag = max(found)
    return place, tag, [p for _, p, _ in found]


def where_found(phase: str, tag: str, step, base_dir: str, places: list[str]) -> tuple[str, str | None]:
    """(the model in words, a sentence for a script to print when find_model had a choice to make, else None)."""
    where = f"{phase} {tag} step {step} in {base_dir}"
    if len(places) > 1:
        return where, f"{where}, the newer of {' and '.join(places)} (FLAXCHAT_BASE_DIR picks one)"
    if base_dir != get_base_dir():
        return where, f"none in {get_base_dir()}; the laptop demo's model: {where}"
    return where, None


def load_model(
    phase: str = "base",
    model_tag: str | None = None,
    step: int | None = None,
    mesh=None,
    base_dir: str | None = None,
    dtype=None,
):
    """(model, tokenizer, meta) from a checkpoint; parameters are restored straight onto `mesh`.

    A LoRA checkpoint (meta["lora"]: the adapters and any weights trained in full, nothing else) loads its base
    checkpoint (meta["base"]) and returns the base with them merged in (flaxchat.model.lora.merge_lora): an ordinary
    GPT."""
    model_tag = model_tag or find_model_tag(phase, base_dir)
    ckpt = Checkpointer(checkpoint_dir(phase, model_tag, base_dir), async_save=False, read_only=True)
    try:
        meta = ckpt.read_meta(step)
        config = GPTConfig.from_dict(meta["model_config"])
        if "lora" in meta:
            return _load_lora(ckpt, meta, mesh, base_dir, dtype)
        model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0), dtype=dtype))
        info = ckpt.restore(model, step=step, mesh=mesh)
    finally:
        ckpt.close()
    tokenizer = get_tokenizer(base_dir)
    if tokenizer.get_vocab_size() != config.vocab_size:
        raise ValueError(
            f"tokenizer vocab {tokenizer.get_vocab_size()} != model vocab {config.vocab_size}; "
            "was the tokenizer retrained after this model?"
        )
    return model, tokenizer, info["meta"]


def load_named_model(spec: str, default_source: str, flag: str, dtype=None, base_dir: str | None = None):
    """The latest checkpoint named "[SOURCE:]TAG" by a script's flag (e.g. d4 or base:d4; SOURCE defaults to
    `default_source`) under base_dir (default: the base dir) -> model."""
    source, _, tag = spec.rpartition(":")
    source = source or default_source
    if source not in PHASE_DIRS or not tag:
        raise ValueError(f"{flag} takes [SOURCE:]TAG with SOURCE base, sft or rl (e.g. d4 or base:d4), got {spec!r}")
    model, _, _ = load_model(source, tag, dtype=dtype, base_dir=base_dir)
    return model


def _load_lora(ckpt: Checkpointer, meta: dict, mesh, base_dir, dtype):
    """(merged model, tokenizer, meta) of the adapter checkpoint `ckpt` at meta["step"]."""
    base = meta["base"]
    name = f"{base['phase']} {base['model_tag']} step {base['step']}"
    try:
        model, tokenizer, base_meta = load_model(base["phase"], base["model_tag"], base["step"], mesh, base_dir, dtype)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"the LoRA checkpoint {ckpt.directory} (step {meta['step']}) was trained on {name}, which is gone "
            "(a later run under that tag or its checkpoint retention removed it): retrain the adapters on a base "
            "that exists"
        ) from None
    if base.get("saved_at") is not None and base_meta.get("saved_at") != base["saved_at"]:
        raise ValueError(
            f"the LoRA checkpoint {ckpt.directory} (step {meta['step']}) was trained on {name} as saved at "
            f"{time.ctime(base['saved_at'])}, which a later run has replaced: retrain the adapters on it"
        )
    if model.config.to_dict() != meta["model_config"]:
        raise ValueError(
            f"the LoRA checkpoint {ckpt.directory} was trained on another model than {base['phase']} "
            f"{base['model_tag']} step {base['step']} now holds"
        )
    lora = LoraConfig.from_dict(meta["lora"])
    lora_model = apply_lora(model, lora)
    ckpt.restore(lora_model, step=meta["step"], mesh=mesh, params=lora.trainable())
    return merge_lora(lora_model, lora), tokenizer, meta


def merge_lora_checkpoint(model_tag: str | None, step: int | None, output_tag: str | None) -> tuple[str, str]:
    """Write the LoRA checkpoint sft/<model_tag> (default: the largest; latest or `step`) as an ordinary sft
    checkpoint of merged weights under output_tag (default: <model_tag>-merged), replacing what was there; returns
    (model_tag, its directory). scripts.sft --merge."""
    model_tag = model_tag or find_model_tag("sft")
    output_tag = output_tag or f"{model_tag}-merged"
    if output_tag == model_tag:
        raise ValueError("--merge writes a new checkpoint: --output-tag must differ from --model-tag")
    ckpt = Checkpointer(checkpoint_dir("sft", model_tag), async_save=False, read_only=True)
    try:
        meta = ckpt.read_meta(step)
    finally:
        ckpt.close()
    if "lora" not in meta:
        raise ValueError(
            f"{ckpt.directory} step {meta['step']} holds full weights, not LoRA adapters: nothing to merge"
        )
    model, _, meta = load_model("sft", model_tag, meta["step"])
    out = Checkpointer(checkpoint_dir("sft", output_tag), keep=1, keep_best=0, async_save=False)
    out.replace_earlier_run()
    kept = {k: v for k, v in meta.items() if k not in ("lora", "loop_state", "step", "model_config")}
    out.save(
        meta["step"],
        model,
        meta={
            **kept,
            "merged_from": {"phase": "sft", "model_tag": model_tag, "step": meta["step"], "lora": meta["lora"]},
        },
    )
    out.close()
    return model_tag, out.directory
