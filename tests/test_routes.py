"""One seed, the same tokens and text on every route that generates: the Python API, the server's native route and
its OpenAI-compatible route (the scheduler and both dialects, in process: tests/test_openai_api.py asks the real
server the same), lm-evaluation-harness's ``generate_until`` (``ZooLM``) and transformers' ``generate``.

Every route runs :func:`zoo.generation.generate_steps` with :class:`zoo.generation.Sampler` and spaces words with
:class:`zoo.generation.Detokenizer`; this is the test that they do (a second loop or sampling rule drifts here
first). Bundled models: a word model and a character model."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import zoo
from zoo.api.dialects import load_dialects
from zoo.api.scheduler import Scheduler
from zoo.api.service import Limits, Service
from zoo.catalog import bundled_dir

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = ["alstm-ptb-5m-light", "lstm-ptbchar-1.5m-long"]
SAMPLINGS = [{"temperature": 0}, {"temperature": 1.0, "seed": 7}, {"temperature": 0.8, "top_k": 20, "seed": 3},
             {"temperature": 0.9, "top_p": 0.8, "seed": 11}]
PROMPT, N = "the stock market", 24


@pytest.fixture(scope="module", params=MODELS)
def model(request) -> zoo.ZooModel:
    return zoo.load(request.param)


def _served(model: zoo.ZooModel, dialect: str, payload: dict) -> Any:
    """A request through its dialect and the scheduler, as the server runs it (each step one token)."""
    service = Service(model, Limits())
    dialects = load_dialects(service, "m")
    sched = Scheduler(service, step_tokens=8)
    sched.admit("r", dialects[dialect].parse(json.dumps(payload).encode(), "application/json", service.limits),
                dialects[dialect])
    while not sched.jobs["r"].done:
        sched.run(["r"], 0.0)
    job = sched.jobs["r"]
    assert job.error is None, job.error
    return json.loads(dialects[dialect].chunk(job, job.take_pieces()))


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_one_seed_gives_the_same_tokens_and_text_on_every_route(model, sampling):
    ids = model.generate_ids(PROMPT, max_new_tokens=N, **sampling)
    text = model.generate(PROMPT, max_new_tokens=N, **sampling)
    assert len(ids) == N

    native = _served(model, "zoo", {"task": "generate", "prompt": PROMPT, "max_new_tokens": N, **sampling})
    assert native["text"] == text and native["num_tokens"] == N

    openai_sampling = {k: v for k, v in sampling.items() if k != "top_k"}
    if "top_k" not in sampling:  # (OpenAI's schema has no top_k)
        body = {"model": "m", "prompt": PROMPT, "max_tokens": N, "logprobs": 0, **openai_sampling}
        reply = _served(model, "openai", body)
        choice = reply["choices"][0]
        lead = "" if model.tokenizer.is_char else " "  # the completion reads on from the prompt
        assert choice["text"] == lead + text
        assert choice["logprobs"]["tokens"] == [model.tokenizer.vocab[i] for i in ids]

    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from zoo.lm_eval_plugin import ZooLM

    harness = ZooLM(pretrained=model.name)
    kwargs = {"max_gen_toks": N, "do_sample": sampling["temperature"] > 0, **sampling}
    (got,) = harness.generate_until([Instance("generate_until", {}, (PROMPT, kwargs), 0)])
    assert got == (" " if not model.tokenizer.is_char else "") + text

    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import zoo.hf  # noqa: F401 (registers the zoo's classes with transformers)

    folder = bundled_dir() / model.name
    hf, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    prompt = tok("<eos>" + PROMPT, return_tensors="pt").input_ids
    if sampling.get("seed") is not None:
        torch.manual_seed(sampling["seed"])  # transformers draws from torch's global generator
    out = hf.generate(prompt, max_new_tokens=N, eos_token_id=None, do_sample=sampling["temperature"] > 0,
                      temperature=sampling["temperature"] or None, top_k=sampling.get("top_k", 0),
                      top_p=sampling.get("top_p", 1.0))
    assert out[0, prompt.shape[1]:].tolist() == ids
    assert tok.decode(ids) == text
