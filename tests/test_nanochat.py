import builtins

import jax
import numpy as np
import pytest
from flax import nnx

from flaxchat.export.nanochat import (
    from_nanochat_state_dict,
    load_nanochat_checkpoint,
    save_nanochat_checkpoint,
    to_nanochat_state_dict,
)
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT

CFG = GPTConfig(sequence_len=32, vocab_size=100, n_layer=3, n_head=2, n_kv_head=1, n_embd=64)

# nanochat's state-dict keys for CFG, written out by hand (layers 0 and 2 carry value embeddings)
EXPECTED_KEYS = {
    "transformer.wte.weight": (128, 64),
    "lm_head.weight": (128, 64),
    "resid_lambdas": (3,),
    "x0_lambdas": (3,),
    "smear_gate.weight": (1, 24),
    "smear_lambda": (1,),
    "backout_lambda": (1,),
    "value_embeds.0.weight": (128, 32),
    "value_embeds.2.weight": (128, 32),
    **{f"transformer.h.{i}.attn.c_q.weight": (64, 64) for i in range(3)},
    **{f"transformer.h.{i}.attn.c_k.weight": (32, 64) for i in range(3)},
    **{f"transformer.h.{i}.attn.c_v.weight": (32, 64) for i in range(3)},
    **{f"transformer.h.{i}.attn.c_proj.weight": (64, 64) for i in range(3)},
    **{f"transformer.h.{i}.mlp.c_fc.weight": (256, 64) for i in range(3)},
    **{f"transformer.h.{i}.mlp.c_proj.weight": (64, 256) for i in range(3)},
    "transformer.h.0.attn.ve_gate.weight": (1, 12),
    "transformer.h.2.attn.ve_gate.weight": (1, 12),
}


@pytest.fixture(scope="module")
def model():
    return GPT(CFG, rngs=nnx.Rngs(3))


def test_state_dict_has_nanochat_keys_and_shapes(model):
    sd = to_nanochat_state_dict(model)
    assert {k: v.shape for k, v in sd.items()} == EXPECTED_KEYS
    assert all(v.dtype == np.float32 for v in sd.values())


def test_round_trip_is_exact(model):
    sd = to_nanochat_state_dict(model)
    back = to_nanochat_state_dict(from_nanochat_state_dict(sd, CFG))
    assert all(np.array_equal(sd[k], back[k]) for k in sd)
    idx = jax.numpy.arange(32)[None] % 100
    np.testing.assert_array_equal(np.asarray(model(idx)), np.asarray(from_nanochat_state_dict(sd, CFG)(idx)))


def test_compiled_prefix_and_old_checkpoints_accepted(model):
    sd = {"_orig_mod." + k: v for k, v in to_nanochat_state_dict(model).items()}
    del sd["_orig_mod.resid_lambdas"], sd["_orig_mod.x0_lambdas"]  # older nanochat checkpoints lack these
    m = from_nanochat_state_dict(sd, CFG)
    assert np.all(np.asarray(m.resid_lambdas[...]) == 1.0) and np.all(np.asarray(m.x0_lambdas[...]) == 0.0)


def test_mismatches_are_clear_errors(model):
    sd = to_nanochat_state_dict(model)
    with pytest.raises(ValueError, match="missing"):
        from_nanochat_state_dict({k: v for k, v in sd.items() if "c_q" not in k}, CFG)
    with pytest.raises(ValueError, match="shape"):
        from_nanochat_state_dict({**sd, "lm_head.weight": sd["lm_head.weight"][:64]}, CFG)


def test_torch_tensors_and_checkpoint_files(model, tmp_path):
    torch = pytest.importorskip("torch")
    sd = {k: torch.from_numpy(v) for k, v in to_nanochat_state_dict(model).items()}
    sd["lm_head.weight"] = sd["lm_head.weight"].to(torch.bfloat16)  # nanochat stores some tensors in bf16
    m = from_nanochat_state_dict(sd, CFG)
    assert m.lm_head.weight[...].dtype == np.float32
    save_nanochat_checkpoint(model, str(tmp_path), step=7, meta={"note": "x"})
    loaded, meta = load_nanochat_checkpoint(str(tmp_path))
    assert meta["model_config"] == CFG.to_dict() and meta["note"] == "x"
    a, b = to_nanochat_state_dict(model), to_nanochat_state_dict(loaded)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_missing_checkpoint_and_missing_torch(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    with pytest.raises(FileNotFoundError, match="model_"):
        load_nanochat_checkpoint(str(tmp_path))
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch":
            raise ImportError("no torch")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(ImportError, match=r"flaxchat\[torch\]"):
        load_nanochat_checkpoint(str(tmp_path))
