"""The Hugging Face config of an exported flaxchat model: flaxchat's GPTConfig fields under their own names.

Copied next to `config.json` by `flaxchat.export.hf` and loaded by transformers with `trust_remote_code=True`; it
needs transformers only, not flaxchat. The standard names transformers looks for (hidden_size, num_hidden_layers...)
are aliases of nanochat's, so a reader can diff this file against flaxchat/model/config.py.
"""

from transformers import PretrainedConfig


class FlaxchatConfig(PretrainedConfig):
    model_type = "flaxchat"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "num_key_value_heads": "n_kv_head",
        "max_position_embeddings": "sequence_len",
    }

    def __init__(
        self,
        sequence_len=2048,
        vocab_size=32768,
        n_layer=12,
        n_head=6,
        n_kv_head=6,
        n_embd=768,
        window_pattern="SSSL",
        use_cache=True,
        **kwargs,
    ):
        self.sequence_len = sequence_len
        self.vocab_size = vocab_size
        self.n_layer = n_layer
        self.n_head = n_head
        self.n_kv_head = n_kv_head
        self.n_embd = n_embd
        self.window_pattern = window_pattern
        self.use_cache = use_cache
        kwargs.setdefault("tie_word_embeddings", False)  # wte and lm_head are separate matrices
        super().__init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        """The embedding tables' rows: vocab rounded up to a multiple of 64; logits are cropped back to vocab_size."""
        return -(-self.vocab_size // 64) * 64

    def window_sizes(self) -> list:
        """Per-layer left window (keys i-w..i visible): S = quarter context rounded up to 128, L = full; the last
        layer is always L (as flaxchat's GPTConfig.window_sizes)."""
        long_window = self.sequence_len
        short_window = -(-long_window // 4 // 128) * 128
        pattern = self.window_pattern.upper()
        sizes = [long_window if pattern[i % len(pattern)] == "L" else short_window for i in range(self.n_layer)]
        sizes[-1] = long_window
        return sizes

    def has_ve(self, layer_idx: int) -> bool:
        """Value embeddings on alternating layers, the last one included."""
        return layer_idx % 2 == (self.n_layer - 1) % 2
