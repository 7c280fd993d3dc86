"""Fair sharing of one model (zoo.api.scheduler): bounded steps, round-robin, generation places, token budgets.

In-process against a real model (a tiny aLSTM with random, far-from-uniform weights); the same scheduler behind
the real TorchServe is tested in tests/test_serving.py."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import tiny_lm, tiny_tokenizer
from zoo.api.completions import OpenAIDialect
from zoo.api.http import error_status, native_error
from zoo.api.native import NativeDialect
from zoo.api.scheduler import Scheduler
from zoo.api.service import Limits, Service, parse_request
from zoo.errors import RequestTooLarge, ServerBusy
from zoo.zoo_model import ZooModel

pytestmark = pytest.mark.usefixtures("one_thread")
LIMITS = Limits(max_total_tokens=2_000, max_generate_tokens=60, max_new_tokens=40)
LONG = " ".join(["the cat sat on the mat", "a dog ran", "mr. smith 's cat"] * 60)  # ~780 tokens
SHORT = "the dog sat on a cat"


@pytest.fixture(scope="module")
def service() -> Service:
    lm = tiny_lm("alstm").eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in lm.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return Service(ZooModel(lm, tiny_tokenizer(), {"name": "tiny-random"}), LIMITS)


def _finish(sched: Scheduler, keys: list[str]) -> dict[str, int]:
    """Run rounds until every job is done; the round in which each finished."""
    finished, rounds = {}, 0
    while any(not sched.jobs[k].done for k in keys):
        rounds += 1
        sched.run(keys, 0.0)
        for k in keys:
            if sched.jobs[k].done and k not in finished:
                finished[k] = rounds
    return finished


def test_scores_in_steps_equal_the_python_api_for_long_and_short_texts_mixed(service):
    sched = Scheduler(service, step_tokens=16)
    requests = {"long": parse_request({"texts": [LONG[:2400], SHORT, LONG[:300]], "return_tokens": True}, LIMITS),
                "short": parse_request({"text": SHORT}, LIMITS)}
    for key, req in requests.items():
        sched.admit(key, req, NativeDialect(service, "tiny"))
    _finish(sched, list(requests))
    for key, req in requests.items():
        served = sched.jobs[key].result
        expected = service.model.score(list(req.texts), return_tokens=req.return_tokens)
        assert served["corpus"]["num_tokens"] == expected.corpus["num_tokens"]
        assert served["corpus"]["nll"] == pytest.approx(expected.corpus["nll"], rel=1e-5)
        for got, want in zip(served["texts"], expected.texts, strict=True):
            assert got["nll"] == pytest.approx(want["nll"], rel=1e-5)
            if req.return_tokens:
                assert [t["logprob"] for t in got["tokens"]] == pytest.approx(
                    [t["logprob"] for t in want["tokens"]], rel=1e-4, abs=1e-5)
    assert sched.jobs["long"].steps_run > 20  # the long request really was cut into bounded steps


def test_a_short_request_finishes_in_a_few_rounds_beside_a_long_one(service):
    """Round-robin: the short request's rounds do not depend on its neighbour's size."""
    sched = Scheduler(service, step_tokens=16)
    sched.admit("long", parse_request({"texts": [LONG] * 2}, LIMITS), NativeDialect(service, "tiny"))
    sched.run(["long"], 0.0)
    sched.admit("short", parse_request({"text": SHORT}, LIMITS), NativeDialect(service, "tiny"))
    finished = _finish(sched, ["long", "short"])
    assert finished["short"] <= 3 < finished["long"]


def test_a_fresh_request_takes_the_next_turn_and_long_ones_take_turns_in_order(service):
    """Beside 16 long jobs, a fresh one-step request is done in the call that starts it after its own turn and
    one long job's (a round of every job's step came first before; one long turn per call, so a stream of short
    requests never starves them), and the long jobs then take one step each per 16 turns."""
    sched, native = Scheduler(service, step_tokens=16), NativeDialect(service, "tiny")
    longs = [f"long{i}" for i in range(16)]
    for key in longs:
        sched.admit(key, parse_request({"text": LONG}, LIMITS), native)
    for _ in range(40):
        sched.run(longs, 0.0)
    before = {k: sched.jobs[k].steps_run for k in longs}
    sched.admit("short", parse_request({"text": SHORT}, LIMITS), native)
    sched.run([*longs, "short"], 0.0)
    advanced = [k for k in longs if sched.jobs[k].steps_run != before[k]]
    assert sched.jobs["short"].done and len(advanced) == 1, advanced
    before = {k: sched.jobs[k].steps_run for k in longs}
    for _ in range(16):
        sched.run(longs, 0.0)
    assert {k: sched.jobs[k].steps_run - before[k] for k in longs} == dict.fromkeys(longs, 1)


def test_long_requests_hold_at_most_their_places_and_short_ones_always_start(service):
    """Requests of more than one step (generations too) hold at most ``max_long`` places: over it a long one is
    refused at once with 503 (ServerBusy, Retry-After), a one-step request is still admitted and a freed place
    is taken again."""
    sched = Scheduler(service, step_tokens=16, max_generations=4, max_long=2)
    native = NativeDialect(service, "tiny")
    sched.admit("a", parse_request({"text": LONG}, LIMITS), native)
    sched.admit("g", parse_request({"task": "generate", "prompt": "the", "max_new_tokens": 5}, LIMITS), native)
    with pytest.raises(ServerBusy) as busy:
        # 4 texts: more than one 16-token step
        sched.admit("b", parse_request({"texts": [SHORT] * 4}, LIMITS), native)
    assert error_status(busy.value) == 503 and "long requests" in str(busy.value)
    sched.admit("s", parse_request({"text": SHORT}, LIMITS), native)  # one step: not affected
    sched.run(["s"], 0.0)
    assert sched.jobs["s"].done
    sched.forget(["a"])
    sched.admit("b", parse_request({"texts": [SHORT] * 4}, LIMITS), native)


def test_generation_in_steps_equals_the_python_api(service):
    sched = Scheduler(service, step_tokens=4)
    prompt = "the cat sat on the mat a dog ran"  # longer than one step: read in pieces
    req = parse_request({"task": "generate", "prompt": prompt, "max_new_tokens": 12, "seed": 5}, LIMITS)
    sched.admit("g", req, NativeDialect(service, "tiny"))
    sched.admit("s", parse_request({"text": LONG}, LIMITS), NativeDialect(service, "tiny"))
    _finish(sched, ["g", "s"])
    job = sched.jobs["g"]
    assert job.result["text"] == service.model.generate(prompt, max_new_tokens=12, seed=5)
    assert job.result["num_tokens"] == 12 == len(job.pieces)


def test_token_budgets_refuse_before_any_model_work_with_413(service):
    sched = Scheduler(service)
    tok = service.model.tokenizer
    n = sum(len(tok.encode(t).ids) for t in [LONG] * 4)
    with pytest.raises(RequestTooLarge) as over:
        sched.admit("big", parse_request({"texts": [LONG] * 4}, LIMITS), NativeDialect(service, "tiny"))
    assert error_status(over.value) == 413 and native_error(over.value)[0] == 413
    assert f"tokenise to {n:,} tokens" in str(over.value) and "limit is 2,000" in str(over.value)
    prompt = "the cat sat on the mat " * 5
    with pytest.raises(RequestTooLarge) as gen_over:
        sched.admit("gen", parse_request({"task": "generate", "prompt": prompt, "max_new_tokens": 40}, LIMITS),
                    NativeDialect(service, "tiny"))
    p = len(tok.encode(prompt, add_eos=False).ids)
    assert f"of {p:,} tokens + max_new_tokens 40 is {p + 40:,} tokens" in str(gen_over.value)
    assert "limit is 60" in str(gen_over.value) and gen_over.value.field == "prompt"
    assert not sched.jobs  # nothing was started


def test_generations_never_take_every_place(service):
    sched = Scheduler(service, max_generations=2)
    gen = {"task": "generate", "prompt": "the", "max_new_tokens": 30}
    sched.admit("a", parse_request(gen, LIMITS), NativeDialect(service, "tiny"))
    sched.admit("b", parse_request(gen, LIMITS), NativeDialect(service, "tiny"))
    with pytest.raises(ServerBusy) as busy:
        sched.admit("c", parse_request(gen, LIMITS), NativeDialect(service, "tiny"))
    assert error_status(busy.value) == 503 and busy.value.retry_after_s >= 1
    sched.admit("s", parse_request({"text": SHORT}, LIMITS), NativeDialect(service, "tiny"))  # scoring still gets in
    _finish(sched, ["a", "b", "s"])
    sched.forget(["a"])
    sched.admit("c", parse_request(gen, LIMITS), NativeDialect(service, "tiny"))  # a place freed


def test_completions_share_the_generation_places_and_score_in_steps(service):
    """The scheduler asks each request's dialect, never its type: an OpenAI completion that generates takes a place
    like a native generation (the third of either is refused), one that only scores (``max_tokens: 0``) does not,
    and a completion run in steps answers what the Python API answers."""
    native, openai = NativeDialect(service, "tiny"), OpenAIDialect(service, "tiny")
    sched = Scheduler(service, step_tokens=4, max_generations=2)

    def completion(**fields):
        body = json.dumps({"model": "tiny", "prompt": "the cat", **fields}).encode()
        return openai.parse(body, "application/json", LIMITS)

    sched.admit("o", completion(max_tokens=20, seed=3), openai)
    sched.admit("n", parse_request({"task": "generate", "prompt": "the", "max_new_tokens": 20}, LIMITS), native)
    for key, request, dialect in (("o2", completion(max_tokens=1), openai),
                                  ("n2", parse_request({"task": "generate", "prompt": "a"}, LIMITS), native)):
        with pytest.raises(ServerBusy):
            sched.admit(key, request, dialect)
    sched.admit("scored", completion(max_tokens=0, echo=True, logprobs=0), openai)
    assert [k for k, j in sched.jobs.items() if j.generates] == ["o", "n"]
    _finish(sched, ["o", "n", "scored"])
    reply = sched.jobs["o"].result
    assert reply["choices"][0]["text"].lstrip(" ") == service.model.generate("the cat", max_new_tokens=20, seed=3)
    logprobs = sched.jobs["scored"].result["choices"][0]["logprobs"]["token_logprobs"]
    want = [t["logprob"] for t in service.model.score("the cat", return_tokens=True).texts[0]["tokens"]]
    assert logprobs == pytest.approx(want, rel=1e-5)


def _completion(service: Service, **fields) -> object:
    body = json.dumps({"model": "tiny", "prompt": "the cat", **fields}).encode()
    return OpenAIDialect(service, "tiny").parse(body, "application/json", LIMITS)


def test_fresh_requests_that_fit_one_step_share_one_model_call_per_dialect(service, monkeypatch):
    """Eight one-sentence score requests and three completions that only read their prompts, fresh in one call:
    two model calls (one per wire format), every one answered in that call with the Python API's numbers (float
    tolerance: rows batched together, as the Python API batches a call's texts). Each used to be a model call."""
    native, openai = NativeDialect(service, "tiny"), OpenAIDialect(service, "tiny")
    sched = Scheduler(service, step_tokens=64)
    texts = [f"{SHORT} {w}" for w in ("a", "the cat", "mr. smith 's dog sat", "", "on the mat", "a b", "ran", "x")]
    for i, text in enumerate(texts):
        sched.admit(f"s{i}", parse_request({"text": text, "return_tokens": True}, LIMITS), native, client=i)
    prompts = ["the cat sat", "a dog ran on the mat", "mr. smith"]
    for i, prompt in enumerate(prompts):
        sched.admit(f"v{i}", _completion(service, prompt=prompt, max_tokens=0, echo=True, logprobs=2), openai)
    lm, calls = service.model.lm, []
    real = lm.forward_hidden
    monkeypatch.setattr(lm, "forward_hidden", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    sched.run(list(sched.jobs), 0.0)
    monkeypatch.undo()
    assert [tuple(shape)[0] for shape in calls] == [8, 3] or [tuple(shape)[0] for shape in calls] == [3, 8], calls
    for i, text in enumerate(texts):
        job = sched.jobs[f"s{i}"]
        assert job.done and job.steps_run == 1 and job.status == 200
        want = service.model.score([text], return_tokens=True).texts[0]
        assert [t["logprob"] for t in job.result["texts"][0]["tokens"]] == pytest.approx(
            [t["logprob"] for t in want["tokens"]], rel=1e-5, abs=1e-6)
    for i, prompt in enumerate(prompts):  # what the same request answers run alone, in its own steps
        job, alone = sched.jobs[f"v{i}"], Scheduler(service, step_tokens=4)
        alone.admit("one", _completion(service, prompt=prompt, max_tokens=0, echo=True, logprobs=2), openai)
        _finish(alone, ["one"])
        got, want = job.result["choices"][0], alone.jobs["one"].result["choices"][0]
        assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], rel=1e-5)
        assert [sorted(t) for t in got["logprobs"]["top_logprobs"]] == [
            sorted(t) for t in want["logprobs"]["top_logprobs"]]
        assert job.result["usage"] == alone.jobs["one"].result["usage"]


class FailingTogether(NativeDialect):
    """The native route with its shared model call broken: what a failure there must cost (nothing but time)."""

    def run_together(self, items):
        raise RuntimeError("the shared call failed")


def test_a_failed_shared_call_leaves_each_request_to_run_alone(service):
    sched, dialect = Scheduler(service, step_tokens=64), FailingTogether(service, "tiny")
    for i in range(3):
        sched.admit(i, parse_request({"text": f"{SHORT} {i}"}, LIMITS), dialect)
    sched.run([0, 1, 2], 0.0)
    for i in range(3):
        job = sched.jobs[i]
        assert job.done and job.status == 200
        assert job.result["corpus"]["nll"] == pytest.approx(service.model.score(f"{SHORT} {i}").corpus["nll"],
                                                            rel=1e-6)


def test_turns_are_fair_between_clients_not_requests(service):
    """A client with four long requests in progress and one with a single one: the single one gets a turn in every
    other call (as many steps as the four together), and the four share theirs."""
    sched, native = Scheduler(service, step_tokens=16, client_long=4), NativeDialect(service, "tiny")
    many = [f"many{i}" for i in range(4)]
    for key in many:
        sched.admit(key, parse_request({"text": LONG}, LIMITS), native, client="10.0.0.1")
    sched.admit("one", parse_request({"text": LONG}, LIMITS), native, client="10.0.0.2")
    sched.run([*many, "one"], 0.0)  # the fresh first steps
    before = {k: sched.jobs[k].steps_run for k in [*many, "one"]}
    for _ in range(16):  # one turn per call (no time budget)
        sched.run([*many, "one"], 0.0)
    steps = {k: sched.jobs[k].steps_run - before[k] for k in [*many, "one"]}
    assert steps["one"] == 8 and sum(steps[k] for k in many) == 8, steps
    assert sorted(steps[k] for k in many) == [2, 2, 2, 2], steps


def test_a_client_holds_at_most_its_share_of_the_places_for_long_work(service):
    """Six places for long work, at most three for one client (half): its fourth long request is a 503 naming the
    share, another client's long request and its own one-step requests still get in; a place it frees is its own
    again."""
    sched, native = Scheduler(service, step_tokens=16, max_long=6), NativeDialect(service, "tiny")
    assert sched.client_long == 3
    for i in range(3):
        sched.admit(f"a{i}", parse_request({"text": LONG}, LIMITS), native, client="10.0.0.1")
    with pytest.raises(ServerBusy) as busy:
        sched.admit("a3", parse_request({"text": LONG}, LIMITS), native, client="10.0.0.1")
    assert error_status(busy.value) == 503 and "3 long request(s) in progress" in str(busy.value)
    sched.admit("b0", parse_request({"text": LONG}, LIMITS), native, client="10.0.0.2")
    sched.admit("a-short", parse_request({"text": SHORT}, LIMITS), native, client="10.0.0.1")
    sched.forget(["a0"])
    sched.admit("a3", parse_request({"text": LONG}, LIMITS), native, client="10.0.0.1")
