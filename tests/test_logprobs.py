"""Log-probabilities and the tokenizer routes: the on-device top-k equals a full sort, prompt scores never bring a
(T, vocabulary) array to the host, generated tokens' logprobs equal the model's own, the decode loop's tokens do not
change when it also scores them, and the OpenAI / vLLM shapes (/tokenize, /detokenize, /tokenizer_info, token-id
prompts, echo + logprobs with max_tokens 1, chat top_logprobs)."""

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxchat.generate.programs import DecodeSettings, controls, pad_prompts, programs
from flaxchat.generate.sampling import token_logprobs, top_values
from flaxchat.serve.app import BackgroundServer, create_app
from flaxchat.serve.server import ServeConfig

TEXT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def url(scheduler, tok):
    app = create_app(scheduler, tok, ServeConfig(rate_limit=0, max_new_tokens=64), own_scheduler=False)
    with BackgroundServer(app) as url:
        yield url


def model_logprobs(scheduler, ids) -> np.ndarray:
    """log_softmax of the model's logits over ids (T, V): the independent computation (padded to 64 positions,
    which a causal model's first ones do not see, so one shape serves every length)."""
    x = jnp.asarray([list(ids) + [0] * (-len(ids) % 64)])
    return np.asarray(jax.nn.log_softmax(scheduler.model(x)[0, : len(ids)].astype(jnp.float32), axis=-1))


def post(url, path, **body):
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# -----------------------------------------------------------------------------
# The device-side pieces


@pytest.mark.parametrize(("V", "k"), [(1000, 5), (1000, 20), (70, 20), (7, 20), (300, 0)])
def test_top_values_and_token_logprobs_equal_a_full_sort(V, k):
    x = jax.random.normal(jax.random.key(V), (3, V)) * 4
    values, ids = top_values(x, k)
    order = np.argsort(-np.asarray(x), axis=-1, kind="stable")[:, : min(k, V)]
    np.testing.assert_array_equal(np.asarray(ids), order)
    np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(np.asarray(x), order, axis=-1))
    tokens = jnp.array([0, V - 1, int(order[2, 0]) if k else 1])
    chosen, top, top_ids = token_logprobs(x, tokens, k)
    logp = np.asarray(jax.nn.log_softmax(x, axis=-1))
    np.testing.assert_allclose(np.asarray(chosen), logp[np.arange(3), np.asarray(tokens)], atol=1e-5)
    np.testing.assert_allclose(np.asarray(top), np.take_along_axis(logp, order, axis=-1), atol=1e-5)
    if k:  # the same token's value is the same float whether chosen or an alternative (lm-eval's is_greedy)
        assert float(chosen[2]) == float(top[2, 0])


def test_prompt_scores_never_bring_the_vocabulary_to_the_host(scheduler, tok):
    """Programs.score's outputs are (T,) and (T, k): the (T, V) log-probabilities stay on the device."""
    progs, params = programs(scheduler.model)
    x = jnp.zeros((1, 64), jnp.int32)
    shapes = jax.eval_shape(lambda p, x: progs.score(p, x, top=3), params, x)
    assert [s.shape for s in shapes] == [(64,), (64, 3), (64, 3)]
    ids = tok.encode(TEXT)
    chosen, alt, values = scheduler.score(ids, 3)
    logp = model_logprobs(scheduler, ids)
    assert np.isnan(chosen[0]) and alt.shape == values.shape == (len(ids) - 1, 3)
    np.testing.assert_allclose(chosen[1:], logp[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
    np.testing.assert_array_equal(alt, np.argsort(-logp[:-1], axis=-1, kind="stable")[:, :3])


def test_decode_tokens_do_not_change_when_the_loop_also_scores_them(scheduler):
    """The fast path (no top_logprobs) returns no scores; asking for them changes no token, at any temperature."""
    progs, params = programs(scheduler.model)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    runs = []
    for top in (None, 4):
        tokens, lengths = pad_prompts(prompts, 128, 12)
        slots = progs.start(params, tokens, lengths, copies=1, rows=2, capacity=64)
        ctl = controls(2, remaining=12, seed=[3, 4], temperature=[0.0, 1.0], top_k=[0, 50])
        settings = DecodeSettings(chunk=16, tiers=(50,), top_logprobs=top)
        _, out = progs.decode(params, slots, ctl, np.int32(12), settings=settings)
        runs.append((np.asarray(out.tokens)[:, : int(out.steps)], out.scores))
    (plain, none), (scored, scores) = runs
    assert none is None and [s.shape for s in scores] == [(2, 16), (2, 16, 4), (2, 16, 4)]
    np.testing.assert_array_equal(plain, scored)
    for b, prompt in enumerate(prompts):  # each emitted token's logprob is the model's, from the full forward
        seq = prompt + scored[b].tolist()
        logp = model_logprobs(scheduler, seq)
        at = np.arange(len(prompt) - 1, len(seq) - 1)
        np.testing.assert_allclose(np.asarray(scores[0])[b, :12], logp[at, seq[len(prompt) :]], atol=1e-4)


# -----------------------------------------------------------------------------
# The routes


def test_tokenize_detokenize_and_tokenizer_info(url, tok, scheduler):
    r = post(url, "/tokenize", prompt=TEXT, add_special_tokens=False)  # as lm-eval's remote tokenizer asks
    assert r["tokens"] == tok.encode(TEXT) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 128
    assert post(url, "/detokenize", tokens=r["tokens"]) == {"prompt": TEXT}
    bos = tok.get_bos_token_id()
    assert post(url, "/tokenize", prompt=TEXT)["tokens"] == [bos] + r["tokens"]  # by default, as a completion reads
    # special-token names are those tokens (lm-eval finds EOS / BOS ids so), and round-trip
    spelled = post(url, "/tokenize", prompt="<|bos|>hi<|user_end|>", return_token_strs=True)
    assert spelled["tokens"] == [bos, *tok.encode("hi"), tok.encode_special("<|user_end|>")]
    assert "".join(spelled["token_strs"]) == "<|bos|>hi<|user_end|>"
    assert post(url, "/detokenize", tokens=spelled["tokens"])["prompt"] == "<|bos|>hi<|user_end|>"
    # messages render as /v1/chat/completions renders them
    messages = [{"role": "user", "content": "hello"}]
    expected = tok.render_for_completion({"messages": messages + [{"role": "assistant", "content": ""}]})
    assert post(url, "/tokenize", messages=messages)["tokens"] == expected
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["bos_token"] == info["eos_token"] == "<|bos|>" and info["model_max_length"] == 128
    assert "<|assistant_end|>" in info["additional_special_tokens"]
    for path, body in [
        ("/tokenize", {}),
        ("/tokenize", {"prompt": "a", "messages": messages}),
        ("/detokenize", {"tokens": [10**9]}),
        ("/detokenize", {"tokens": "abc"}),
    ]:
        assert httpx.post(url + path, json=body).status_code == 400, (path, body)


def test_token_id_prompts_equal_text_prompts(url, tok):
    """A text prompt is read after <|bos|>, as every training document began (vLLM's add_special_tokens, on by
    default); token ids are read as given."""
    ids = [tok.get_bos_token_id()] + tok.encode(TEXT)
    body = dict(max_tokens=4, temperature=0.0)
    text = post(url, "/v1/completions", prompt=TEXT, **body)
    assert text["usage"]["prompt_tokens"] == len(ids)
    text = text["choices"][0]["text"]
    r = post(url, "/v1/completions", prompt=ids, **body)
    assert r["choices"][0]["text"] == text and r["usage"]["prompt_tokens"] == len(ids)
    r = post(url, "/v1/completions", prompt=[ids, ids[:3]], **body)
    assert [c["index"] for c in r["choices"]] == [0, 1] and r["choices"][0]["text"] == text
    spelled = post(url, "/v1/completions", prompt="<|bos|>" + TEXT, **body)  # not twice
    assert spelled["usage"]["prompt_tokens"] == len(ids) and spelled["choices"][0]["text"] == text
    bare = post(url, "/v1/completions", prompt=TEXT, add_special_tokens=False, **body)  # vLLM's field: no BOS
    assert bare["usage"]["prompt_tokens"] == len(ids) - 1
    assert bare["choices"][0]["text"] == post(url, "/v1/completions", prompt=ids[1:], **body)["choices"][0]["text"]


def test_echo_logprobs_with_max_tokens_one_scores_like_the_model(url, scheduler, tok):
    """lm-evaluation-harness's loglikelihood request: the prompt's logprobs, then the one generated token's."""
    ids = tok.encode(TEXT)
    r = post(url, "/v1/completions", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0.0)
    lp = r["choices"][0]["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n + 1
    logp = model_logprobs(scheduler, ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1:n], logp[np.arange(n - 1), ids[1:]], atol=1e-4)
    greedy = int(logp[-1].argmax())  # the generated token: greedy, scored from the last prompt position
    assert lp["tokens"][n] == tok.decode([greedy])
    np.testing.assert_allclose(lp["token_logprobs"][n], logp[-1, greedy], atol=1e-4)
    assert lp["token_logprobs"][n] == max(lp["top_logprobs"][n].values())  # greedy, to the float
    for i in range(1, n + 1):  # the chosen token is always among the alternatives (OpenAI: up to k + 1)
        assert 1 <= len(lp["top_logprobs"][i]) <= 2 and lp["tokens"][i] in lp["top_logprobs"][i]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n + 1)]
    assert r["choices"][0]["text"].startswith(TEXT)


def test_generated_logprobs_equal_an_independent_computation(url, scheduler, tok):
    ids = tok.encode(TEXT)
    r = post(url, "/v1/completions", prompt=ids, logprobs=3, max_tokens=10, temperature=0.0)
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert 1 <= len(lp["tokens"]) <= 10 and lp["text_offset"][0] == 0
    # greedy: each token is the argmax of a full forward over the prompt and the tokens before it
    seq = list(ids)
    for piece, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        logp = model_logprobs(scheduler, seq)[-1]
        best = np.argsort(-logp, kind="stable")[:3]
        assert piece == tok.decode([int(best[0])])
        np.testing.assert_allclose(logprob, logp[best[0]], atol=1e-4)
        assert logprob == max(top.values()) and all(np.isclose(logp[best], v, atol=1e-4).any() for v in top.values())
        seq.append(int(best[0]))
    if choice["finish_reason"] == "length":  # (a stop token is reported, but is not in the text)
        assert "".join(lp["tokens"]) == choice["text"]


def test_chat_logprobs_have_openai_shape(url, tok):
    body = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0.0)
    r = post(url, "/v1/chat/completions", logprobs=True, top_logprobs=2, **body)
    choice = r["choices"][0]
    content = choice["logprobs"]["content"]
    assert choice["logprobs"]["refusal"] is None and len(content) <= 6
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 2
        assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])
        assert entry["logprob"] == entry["top_logprobs"][0]["logprob"]  # greedy
        assert (
            entry["logprob"] <= 0
            and entry["bytes"]
            and entry["token"] == bytes(entry["bytes"]).decode(errors="replace")
        )
    if "```" not in choice["message"]["content"]:  # no tool call: the tokens spell the content
        assert bytes(b for e in content for b in e["bytes"]).decode(errors="replace") == choice["message"]["content"]
    plain = post(url, "/v1/chat/completions", logprobs=True, **body)["choices"][0]
    assert all(e["top_logprobs"] == [] for e in plain["logprobs"]["content"])
    assert plain["message"]["content"] == choice["message"]["content"]
    assert post(url, "/v1/chat/completions", **body)["choices"][0]["logprobs"] is None
    for bad in (dict(top_logprobs=2), dict(logprobs=True, stream=True), dict(logprobs=True, top_logprobs=21)):
        resp = httpx.post(url + "/v1/chat/completions", json={**body, **bad})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_message", bad
