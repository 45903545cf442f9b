"""flaxchat's GPT in PyTorch for Hugging Face transformers: flaxchat/model/gpt.py's architecture, weight for weight.

Copied next to `model.safetensors` by `flaxchat.export.hf` and loaded with
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`; it needs torch and transformers, not flaxchat or
JAX. Parameters keep nanochat's names and layouts (Linear weights (out, in), as torch's), so the safetensors file is
flaxchat's state dict as it is. What it computes, in order: RMS-normed token embedding; smear (each position mixes in
the previous token's normed embedding through a sigmoid gate); per layer x = resid_lambda * x + x0_lambda * x0, then
a pre-norm block: attention (q, k, v projections; value embeddings gated by 3 * sigmoid on alternating layers; rotary
with base 100k in nanochat's rotation sense; QK RMS-norm times 1.2; causal attention with a left window; GQA) and a
ReLU^2 MLP; backout (subtract backout_lambda times the residual after layer n_layer // 2); a final RMS-norm; the untied
lm_head over the vocab padded to a multiple of 64, cropped, soft-capped at 15. The KV cache is transformers'
DynamicCache; the smear's previous-token embedding rides on it as one extra attribute.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_flaxchat import FlaxchatConfig

ROPE_BASE = 100_000
VE_GATE_CHANNELS = 12
SMEAR_CHANNELS = 24
QK_SCALE = 1.2
SOFTCAP = 15.0
PREV_ATTR = "flaxchat_prev_embedding"  # the attribute of the cache that holds the smear state (B, C)
# transformers 5 renamed the output's past_key_values to cache
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def rms_norm(x):
    """Parameter-free RMSNorm in fp32 with the input dtype's machine epsilon (torch's rms_norm default)."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)
    return y.to(x.dtype)


def rotary(positions, head_dim, dtype):
    """cos, sin (T, head_dim/2) for integer positions (T,), computed in fp32."""
    inv_freq = 1.0 / (
        ROPE_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rotary(x, cos, sin):
    """x (B, H, T, D): the halves (x1, x2) -> (x1 cos + x2 sin, x2 cos - x1 sin), a rotation by -theta."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: FlaxchatConfig, layer_idx: int):
        super().__init__()
        C, H, Hkv, D = config.n_embd, config.n_head, config.n_kv_head, config.head_dim
        self.layer_idx, self.n_head, self.n_kv_head, self.head_dim = layer_idx, H, Hkv, D
        self.window = config.window_sizes()[layer_idx]
        self.c_q = nn.Linear(C, H * D, bias=False)
        self.c_k = nn.Linear(C, Hkv * D, bias=False)
        self.c_v = nn.Linear(C, Hkv * D, bias=False)
        self.c_proj = nn.Linear(H * D, C, bias=False)
        self.ve_gate = nn.Linear(VE_GATE_CHANNELS, Hkv, bias=False) if config.has_ve(layer_idx) else None

    def forward(self, x, ve, cos, sin, cache, past_len, key_mask):
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:  # value residual, gated per kv head in (0, 3)
            gate = 3.0 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))  # (B, T, Hkv)
            v = v + gate[..., None] * ve.view(B, T, self.n_kv_head, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k = rms_norm(q) * QK_SCALE, rms_norm(k) * QK_SCALE
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # every key so far: (B, Hkv, past_len + T, D)
        S = k.shape[2]
        groups = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # query head h reads kv h // G
        qpos = torch.arange(past_len, past_len + T, device=x.device)[:, None]
        kpos = torch.arange(S, device=x.device)[None, :]
        visible = (kpos <= qpos) & (qpos - kpos <= self.window)  # key j seen from position i iff i - w <= j <= i
        visible = visible[None, None] if key_mask is None else visible[None, None] & key_mask[:, None, None, :S]
        scores = (q @ k.transpose(-1, -2)).float() * self.head_dim**-0.5
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).to(q.dtype)
        y = (probs @ v).transpose(1, 2).reshape(B, T, -1)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: FlaxchatConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: FlaxchatConfig, layer_idx: int):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, ve, cos, sin, cache, past_len, key_mask):
        x = x + self.attn(rms_norm(x), ve, cos, sin, cache, past_len, key_mask)
        return x + self.mlp(rms_norm(x))


class Transformer(nn.Module):
    """Holds wte and the blocks, so parameter names read `transformer.wte.weight`, `transformer.h.0...`."""

    def __init__(self, config: FlaxchatConfig):
        super().__init__()
        self.wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.h = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])


class FlaxchatForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = FlaxchatConfig
    base_model_prefix = "flaxchat"  # no submodule of that name: checkpoints load by their full names
    _no_split_modules = ["Block"]
    _supports_cache_class = True

    def __init__(self, config: FlaxchatConfig):
        super().__init__(config)
        C, L, Vp = config.n_embd, config.n_layer, config.padded_vocab_size
        kv_dim = config.n_kv_head * config.head_dim
        self.transformer = Transformer(config)
        self.lm_head = nn.Linear(C, Vp, bias=False)
        self.resid_lambdas = nn.Parameter(torch.ones(L))
        self.x0_lambdas = nn.Parameter(torch.zeros(L))
        self.smear_gate = nn.Linear(SMEAR_CHANNELS, 1, bias=False)
        self.smear_lambda = nn.Parameter(torch.zeros(1))
        self.backout_lambda = nn.Parameter(torch.zeros(1))
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(Vp, kv_dim) for i in range(L) if config.has_ve(i)})
        self.post_init()

    def _init_weights(self, module):
        # Only for weights a checkpoint lacks (an exported model has them all): small normal matrices.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        past_key_values=None,
        cache=None,
        use_cache=None,
        labels=None,
        logits_to_keep=0,
        return_dict=None,
        **kwargs,
    ):
        """input_ids (B, T) -> soft-capped fp32 logits (B, T, vocab_size), continuing past_key_values when given.

        The cache arrives as `cache` (transformers 5) or `past_key_values` (transformers 4), and leaves under the same
        name. attention_mask (B, past + T), if given, hides keys where it is 0 (positions are still counted from 0 on
        every row, as flaxchat counts them: pad on the right, or not at all)."""
        if input_ids is None:
            raise ValueError("flaxchat models take input_ids (token ids), not inputs_embeds")
        B, T = input_ids.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        cache = past_key_values if cache is None else cache
        if use_cache and cache is None:
            cache = DynamicCache()
        past_len = cache.get_seq_length() if cache is not None else 0
        key_mask = None if attention_mask is None else attention_mask.bool()

        x = rms_norm(self.transformer.wte(input_ids))
        # smear: mix the previous token's normed embedding into each position (none before position 0)
        gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(self.smear_gate(x[..., :SMEAR_CHANNELS]))  # (B, T, 1)
        prev = getattr(cache, PREV_ATTR, None) if past_len > 0 else None
        if past_len > 0 and prev is None:
            raise ValueError("this cache was not filled by a flaxchat model (it lacks the smear state)")
        before = x[:, :-1] if prev is None else torch.cat([prev[:, None].to(x.dtype), x[:, :-1]], dim=1)
        if cache is not None:
            setattr(cache, PREV_ATTR, x[:, -1].detach())
        if prev is None:
            x = torch.cat([x[:, :1], x[:, 1:] + gate[:, 1:] * before], dim=1)
        else:
            x = x + gate * before

        cos, sin = rotary(torch.arange(past_len, past_len + T, device=x.device), self.config.head_dim, x.dtype)
        x0, x_backout, backout_layer = x, x, self.config.n_layer // 2
        for i, block in enumerate(self.transformer.h):
            x = self.resid_lambdas[i].to(x.dtype) * x + self.x0_lambdas[i].to(x.dtype) * x0
            ve = self.value_embeds[str(i)](input_ids) if str(i) in self.value_embeds else None
            x = block(x, ve, cos, sin, cache, past_len, key_mask)
            if i == backout_layer:
                x_backout = x
        x = rms_norm(x - self.backout_lambda.to(x.dtype) * x_backout)

        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(x)[..., : self.config.vocab_size].float()
        logits = SOFTCAP * torch.tanh(logits / SOFTCAP)
        loss = None
        if labels is not None:  # next-token loss, -100 ignored (transformers' convention)
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache if use_cache else None})
