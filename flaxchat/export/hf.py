"""Hugging Face interop: a checkpoint as a transformers model directory, and such a directory back into flaxchat.

`export_hf` writes what `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` and
`AutoTokenizer.from_pretrained(dir)` load offline: config.json (model_type "flaxchat", auto_map naming the two files
of hf_files/, which are copied beside it and hold the whole architecture in PyTorch), model.safetensors (nanochat's
names, fp32 or bf16), tokenizer.json (the tiktoken ranks as a byte-level BPE: the same pre-tokenizing regex, every
way of splitting a token into two tokens as a merge ranked by the token, specials added after the merged tokens),
tokenizer_config.json with a Jinja chat template that renders conversations as `Tokenizer.render_conversation` does
(plain text gets a leading <|bos|>, as pretraining documents had, unless `add_special_tokens=False`),
and generation_config.json whose stop tokens are <|assistant_end|> and <|bos|>. Writing needs the `tokenizers`
package (the hf extra), not torch. `load_hf` reads the weights and the tokenizer back, bit for bit; `push_to_hub`
uploads the directory through huggingface_hub.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil

import numpy as np

from flaxchat.data.tokenizer import SPECIAL_TOKENS, Tokenizer, _build_encoding
from flaxchat.export.nanochat import from_nanochat_state_dict, to_nanochat_state_dict
from flaxchat.model.config import GPTConfig

MODEL_TYPE = "flaxchat"
CODE_FILES = ("configuration_flaxchat.py", "modeling_flaxchat.py")
AUTO_MAP = {
    "AutoConfig": "configuration_flaxchat.FlaxchatConfig",
    "AutoModelForCausalLM": "modeling_flaxchat.FlaxchatForCausalLM",
}
STOP_TOKENS = ("<|assistant_end|>", "<|bos|>")

# render_conversation as Jinja: <|bos|>, a system message folded into the first user turn ("system\n\nuser"),
# user turns between <|user_start|>/<|user_end|>, assistant turns between <|assistant_start|>/<|assistant_end|> whose
# content is a string or flaxchat's parts (text, python = a tool call, python_output = the tool's reply);
# add_generation_prompt opens the assistant's turn, as render_for_completion does.
CHAT_TEMPLATE = (
    "<|bos|>"
    "{%- set ns = namespace(system='', turn=0) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if not loop.first -%}{{ raise_exception('only the first message may be a system message') }}{%- endif -%}"
    "{%- set ns.system = message['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- if message['role'] != ['user', 'assistant'][ns.turn % 2] -%}"
    "{{ raise_exception('turns alternate user / assistant, starting with the user') }}"
    "{%- endif -%}"
    "{%- set ns.turn = ns.turn + 1 -%}"
    "{%- if message['role'] == 'user' -%}"
    "<|user_start|>{{ ns.system + message['content'] }}<|user_end|>{%- set ns.system = '' -%}"
    "{%- else -%}<|assistant_start|>"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'python' -%}<|python_start|>{{ part['text'] }}<|python_end|>"
    "{%- elif part['type'] == 'python_output' -%}<|output_start|>{{ part['text'] }}<|output_end|>"
    "{%- else -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|assistant_end|>"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant_start|>{%- endif -%}"
)


# -----------------------------------------------------------------------------
# The tokenizer: tiktoken ranks <-> a byte-level BPE


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are written in: printable
    Latin-1 bytes stand for themselves, the other 68 bytes for the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Merges that make a BPE pick the tokens tiktoken picks. tiktoken merges any adjacent pair whose concatenation is
    a token, lowest rank first, so every split of a token into two tokens is a merge, ranked by that token."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        for i in range(1, len(token)):
            if token[:i] in ranks and token[i:] in ranks:
                merges.append((rank, i, token[:i], token[i:]))
    merges.sort(key=lambda m: (m[0], m[1]))
    return [(a, b) for _, _, a, b in merges]


def hf_tokenizer_json(tokenizer: Tokenizer) -> str:
    """tokenizer.json for the `tokenizers` library: the same ids as the tiktoken Encoding, specials included."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    enc = tokenizer.enc
    ranks = enc._mergeable_ranks
    table = byte_to_unicode()
    spell = lambda b: "".join(table[x] for x in b)
    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges = [(spell(a), spell(b)) for a, b in bpe_merges(ranks)]
    # ignore_merges: a piece that is a token is that token, as tiktoken looks a piece up before merging
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False, byte_fallback=False))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(enc._pat_str), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),  # bytes -> characters only
        ]
    )
    hf.decoder = decoders.ByteLevel()
    specials = sorted(enc._special_tokens.items(), key=lambda kv: kv[1])
    if [i for _, i in specials] != list(range(len(ranks), len(ranks) + len(specials))):
        raise ValueError("special tokens must follow the merged tokens with consecutive ids")
    hf.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in specials])
    for name, i in specials:
        if hf.token_to_id(name) != i:
            raise ValueError(f"{name} would get id {hf.token_to_id(name)} instead of {i}")
    # tok(text) starts with <|bos|>, as every pretraining document did and as Llama-style tokenizers do by default
    # (issue 86); tok(text, add_special_tokens=False) is the bare ids, and the chat template writes its own <|bos|>
    bos = ("<|bos|>", tokenizer.get_bos_token_id())
    hf.post_processor = processors.TemplateProcessing(
        single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]}:1 $B:1", special_tokens=[bos]
    )
    return hf.to_str(pretty=False)


def tokenizer_from_hf(out_dir: str) -> Tokenizer:
    """The flaxchat Tokenizer an export's tokenizer.json encodes (ranks = vocab ids, the Split regex, the specials)."""
    with open(os.path.join(out_dir, "tokenizer.json"), encoding="utf-8") as f:
        data = json.load(f)
    unicode_to_byte = {c: b for b, c in byte_to_unicode().items()}
    ranks = {bytes(unicode_to_byte[c] for c in token): rank for token, rank in data["model"]["vocab"].items()}
    split = data["pre_tokenizer"]["pretokenizers"][0]
    specials = {t["content"]: t["id"] for t in data["added_tokens"]}
    return Tokenizer(_build_encoding(split["pattern"]["Regex"], ranks, specials))


# -----------------------------------------------------------------------------
# Export and import


def _write_json(path: str, data: dict) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.replace(path + ".tmp", path)


def hf_config(config: GPTConfig, tokenizer: Tokenizer, dtype: str, extra: dict | None = None) -> dict:
    """config.json: GPTConfig's fields under their own names, plus what transformers reads to load and generate."""
    sp = {name: tokenizer.encode_special(name) for name in SPECIAL_TOKENS}
    return {
        "architectures": ["FlaxchatForCausalLM"],
        "model_type": MODEL_TYPE,
        "auto_map": AUTO_MAP,
        **config.to_dict(),
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": dtype,
        "bos_token_id": sp["<|bos|>"],
        "eos_token_id": [sp[t] for t in STOP_TOKENS],
        "pad_token_id": sp["<|bos|>"],
        "flaxchat": {"padded_vocab_size": config.padded_vocab_size, **(extra or {})},
    }


def export_hf(model, tokenizer: Tokenizer, out_dir: str, dtype: str = "float32", extra: dict | None = None) -> str:
    """Write a transformers model directory (see the module docstring) for `model` and its tokenizer; returns it."""
    from safetensors.numpy import save_file

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    if tokenizer.get_vocab_size() != model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, the model {model.config.vocab_size}")
    tokenizer_json = hf_tokenizer_json(tokenizer)  # first: it is what fails when `tokenizers` is missing
    os.makedirs(out_dir, exist_ok=True)
    tensors = to_nanochat_state_dict(model)
    if dtype == "bfloat16":
        import ml_dtypes

        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    path = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, path + ".tmp", metadata={"format": "pt"})  # transformers refuses other formats' files
    os.replace(path + ".tmp", path)
    _write_json(os.path.join(out_dir, "config.json"), hf_config(model.config, tokenizer, dtype, extra))
    files = importlib.resources.files("flaxchat.export").joinpath("hf_files")
    for name in CODE_FILES:
        with importlib.resources.as_file(files.joinpath(name)) as src:
            shutil.copyfile(src, os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "tokenizer.json.tmp"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json)
    os.replace(os.path.join(out_dir, "tokenizer.json.tmp"), os.path.join(out_dir, "tokenizer.json"))
    _write_json(
        os.path.join(out_dir, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|bos|>",
            "eos_token": "<|assistant_end|>",
            "pad_token": "<|bos|>",
            "add_bos_token": True,  # text begins with <|bos|> (tokenizer.json's post-processor) as in pretraining
            "clean_up_tokenization_spaces": False,
            "model_max_length": model.config.sequence_len,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    sp = {name: tokenizer.encode_special(name) for name in SPECIAL_TOKENS}
    _write_json(
        os.path.join(out_dir, "generation_config.json"),
        {
            "bos_token_id": sp["<|bos|>"],
            "eos_token_id": [sp[t] for t in STOP_TOKENS],
            "pad_token_id": sp["<|bos|>"],
        },
    )
    return out_dir


def push_to_hub(out_dir: str, repo_id: str, private: bool = False, message: str | None = None) -> str:
    """Upload an exported directory to the Hub as model repo `repo_id` (created if missing); returns the commit URL.

    The endpoint and token are read when called (HF_ENDPOINT, HF_TOKEN or `hf auth login`'s token), not when
    huggingface_hub was imported, so a mirror or a test's stand-in set later is the one used."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=os.environ.get("HF_TOKEN") or None)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    commit = api.upload_folder(
        repo_id=repo_id, folder_path=out_dir, repo_type="model", commit_message=message or "flaxchat export"
    )
    return str(commit)


def load_hf(out_dir: str, dtype=None):
    """An exported directory back into flaxchat: (GPT with fp32 master weights, Tokenizer, config.json dict)."""
    from safetensors.numpy import load_file

    cfg_path, st_path = os.path.join(out_dir, "config.json"), os.path.join(out_dir, "model.safetensors")
    for path in (cfg_path, st_path):
        if not os.path.exists(path):
            raise FileNotFoundError(f"not a Hugging Face export (missing {os.path.basename(path)}): {out_dir}")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    if cfg.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{cfg_path} is a {cfg.get('model_type')!r} model, not a flaxchat one")
    config = GPTConfig.from_dict({k: cfg[k] for k in GPTConfig().to_dict()})
    tensors = {k: np.asarray(v, dtype=np.float32) for k, v in load_file(st_path).items()}
    return from_nanochat_state_dict(tensors, config, dtype=dtype), tokenizer_from_hf(out_dir), cfg
