import pytest

from flaxchat.model.config import GPTConfig


def nanochat_dims(depth, aspect_ratio=64, head_dim=128):
    # nanochat base_train: model_dim = depth*aspect_ratio rounded up to a multiple of head_dim
    base = depth * aspect_ratio
    dim = ((base + head_dim - 1) // head_dim) * head_dim
    return dim, dim // head_dim


@pytest.mark.parametrize("depth", range(4, 27))
def test_from_depth_matches_nanochat(depth):
    c = GPTConfig.from_depth(depth)
    dim, heads = nanochat_dims(depth)
    assert (c.n_layer, c.n_embd, c.n_head, c.n_kv_head) == (depth, dim, heads, heads)
    assert c.head_dim == 128 and c.sequence_len == 2048 and c.vocab_size == 32768 and c.window_pattern == "SSSL"


def test_from_depth_known_values():
    assert GPTConfig.from_depth(20).n_embd == 1280 and GPTConfig.from_depth(20).n_head == 10
    assert GPTConfig.from_depth(26).n_embd == 1664
    assert GPTConfig.from_depth(5).n_embd == 384  # 320 rounded up to a multiple of 128
    c = GPTConfig.from_depth(4, head_dim=64, n_kv_head=2, max_seq_len=512, vocab_size=1000)
    assert (c.n_embd, c.n_head, c.n_kv_head, c.sequence_len, c.vocab_size) == (256, 4, 2, 512, 1000)


def test_window_sizes():
    c = GPTConfig.from_depth(6, max_seq_len=2048)
    assert c.window_sizes() == [512, 512, 512, 2048, 512, 2048]  # SSSL tiled, last always L
    assert GPTConfig.from_depth(4, max_seq_len=512).window_sizes() == [128, 128, 128, 512]
    assert GPTConfig.from_depth(3, max_seq_len=600, window_pattern="L").window_sizes() == [600] * 3
    assert GPTConfig.from_depth(2, max_seq_len=600).window_sizes()[0] == 256  # 150 rounded up to 128s


def test_value_embedding_layers():
    c = GPTConfig.from_depth(5)
    assert [c.has_ve(i) for i in range(5)] == [True, False, True, False, True]
    c = GPTConfig.from_depth(4)
    assert [c.has_ve(i) for i in range(4)] == [False, True, False, True]


def test_padded_vocab():
    assert GPTConfig(vocab_size=300).padded_vocab_size == 320
    assert GPTConfig(vocab_size=32768).padded_vocab_size == 32768


@pytest.mark.parametrize(
    "kwargs",
    [dict(n_embd=100, n_head=3), dict(n_head=6, n_kv_head=4), dict(window_pattern="SXL"), dict(window_pattern="")],
)
def test_bad_config_is_a_clear_error(kwargs):
    with pytest.raises(ValueError):
        GPTConfig(**kwargs)


def test_dict_round_trip():
    c = GPTConfig.from_depth(4)
    assert GPTConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="unknown"):
        GPTConfig.from_dict({**c.to_dict(), "n_layers": 3})
