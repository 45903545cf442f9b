"""lm-evaluation-harness against the server, as its users run it: `local-completions` with the remote tokenizer
(vLLM's /tokenize, /detokenize, /tokenizer_info) over a loglikelihood (multiple_choice) task and a generation
(generate_until) task on a few local rows; the loglikelihoods it reports equal the model's own."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat.data.tokenizer import Tokenizer
from flaxchat.generate.scheduler import Scheduler
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT
from flaxchat.serve.app import BackgroundServer, create_app
from flaxchat.serve.server import ServeConfig

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")

MC_ROWS = [
    {"question": "The cat sat on the", "choices": ["mat", "sky", "moon"], "answer": 0},
    {"question": "Birds can", "choices": ["fly", "read"], "answer": 0},
    {"question": "Water is", "choices": ["dry", "wet", "loud"], "answer": 1},
]
GEN_ROWS = [{"question": "Q: what do cats say?\nA:", "answer": "meow"}, {"question": "Q: 2 + 2 =", "answer": "4"}]

MC_TASK = """task: flaxchat_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {rows}}}, cache_dir: {cache}}}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_TASK = """task: flaxchat_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {rows}}}, cache_dir: {cache}}}
test_split: test
output_type: generate_until
doc_to_text: question
doc_to_target: answer
generation_kwargs: {{until: ["\\n"], max_gen_toks: 8, do_sample: false}}
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def served(tiny_corpus):
    tok = Tokenizer.load(str(tiny_corpus / "tokenizer"))
    config = GPTConfig(sequence_len=128, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    scheduler = Scheduler(GPT(config, rngs=nnx.Rngs(2)), tok, slots=2, chunk=4)
    app = create_app(scheduler, tok, ServeConfig(rate_limit=0), own_scheduler=False)
    with BackgroundServer(app) as url:
        yield url, scheduler, tok
    scheduler.close()


def write_tasks(folder) -> None:
    for name, rows, task in [("mc", MC_ROWS, MC_TASK), ("gen", GEN_ROWS, GEN_TASK)]:
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(task.format(rows=data, cache=folder / "cache"))


def own_loglikelihood(scheduler, tok, context: str, continuation: str) -> float:
    """The continuation's loglikelihood from the model directly, split into tokens as lm-eval splits it."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    context_ids, whole = tok.encode(context), tok.encode(context + continuation)
    logp = jax.nn.log_softmax(scheduler.model(jnp.asarray([whole]))[0].astype(jnp.float32), axis=-1)
    return float(sum(logp[i - 1, whole[i]] for i in range(len(context_ids), len(whole))))


def test_remote_tokenizer_reads_the_tokenizer_routes(served):
    from lm_eval.utils import RemoteTokenizer

    url, scheduler, tok = served
    remote = RemoteTokenizer(url + "/v1/completions", timeout=30)
    assert remote.encode("the cat sat") == tok.encode("the cat sat")
    assert remote.decode(tok.encode("the cat sat")) == "the cat sat"
    assert remote.eos_token_id == remote.bos_token_id == tok.get_bos_token_id()


def test_lm_eval_loglikelihood_and_generation_tasks(served, tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    url, scheduler, tok = served
    write_tasks(tmp_path)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"base_url={url}/v1/completions,tokenizer_backend=remote,model=flaxchat,num_concurrent=1,max_retries=1,"
            "max_length=97"  # the server's prompt limit (3/4 of a 128-token context) + 1
        ),
        tasks=["flaxchat_mc", "flaxchat_gen"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        bootstrap_iters=0,
        log_samples=True,
    )
    print(make_table(results))
    assert 0.0 <= results["results"]["flaxchat_mc"]["acc,none"] <= 1.0
    assert 0.0 <= results["results"]["flaxchat_gen"]["exact_match,none"] <= 1.0
    samples = results["samples"]["flaxchat_mc"]
    assert sum(len(s["arguments"]) for s in samples) == sum(len(r["choices"]) for r in MC_ROWS)
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            loglikelihood, greedy = resp[0]
            assert isinstance(greedy, bool)
            expected = own_loglikelihood(scheduler, tok, context, continuation)
            np.testing.assert_allclose(loglikelihood, expected, atol=1e-4, rtol=0)
    assert len(results["samples"]["flaxchat_gen"]) == len(GEN_ROWS)
