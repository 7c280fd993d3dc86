"""The OpenAI-compatible completions schema and its numbers (zoo/api/completions.py), without a server: every field's
rules, the exactness of echoed log-probabilities against ``zoo score``, sampling equal to the native route's, stop
sequences, streaming equal to the whole reply. The real server and real clients: tests/test_openai_api.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.conftest import TINY_ARCHS, tiny_lm, tiny_tokenizer
from zoo.api.completions import MAX_LOGPROBS, CompletionRun, OpenAIDialect, parse_completion
from zoo.api.http import openai_error_of
from zoo.api.service import Limits, Service, parse_body
from zoo.errors import InvalidRequest, ModelNotServed, RequestTooLarge
from zoo.zoo_model import ZooModel

LIMITS = Limits(max_texts=4, max_chars=500, max_total_chars=1000, max_total_tokens=400, max_generate_tokens=100,
                max_new_tokens=40)
TEXTS = ["the cat sat on the mat", "a dog ran\nthe cat sat on a mat", "mr. smith 's cat ran", "N dogs zebra"]


def _model(variant: str = "alstm") -> ZooModel:
    lm = tiny_lm(variant).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # far from uniform, so log-probabilities differ from token to token
        for p in lm.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return ZooModel(lm, tiny_tokenizer(), {"name": "tiny"})


@pytest.fixture(scope="module")
def model() -> ZooModel:
    return _model()


def _run(model: ZooModel, **payload) -> tuple[dict, bytes]:
    req = parse_completion({"model": "tiny", **payload}, model.tokenizer, LIMITS, served="tiny")
    run = CompletionRun(model, req)
    events = b""
    while not run.done:
        events += run.advance()
    return run.reply(), events


@pytest.mark.parametrize("variant", sorted(TINY_ARCHS))
def test_echoed_logprobs_sum_to_zoo_score(variant):
    model = _model(variant)
    for text in TEXTS:
        reply, _ = _run(model, prompt=text, max_tokens=0, echo=True, logprobs=1)
        lp = reply["choices"][0]["logprobs"]
        report = model.score(text, return_tokens=True).texts[0]
        assert lp["tokens"] == [t["token"] for t in report["tokens"]]  # the same tokens, <eos> included
        assert None not in lp["token_logprobs"]  # a text's first token is conditioned on <eos>: never null
        assert math.isclose(-sum(lp["token_logprobs"]), report["nll"], rel_tol=1e-6)
        assert reply["usage"] == {"prompt_tokens": report["num_tokens"], "completion_tokens": 0,
                                  "total_tokens": report["num_tokens"]}


def test_top_logprobs_are_the_most_likely_tokens_and_agree_with_the_token(model):
    reply, _ = _run(model, prompt=TEXTS[1], max_tokens=0, echo=True, logprobs=3)
    lp = reply["choices"][0]["logprobs"]
    outside = 0
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top[tok] == value  # the token is always there (as vLLM), the same float32 softmax: equal to the bit
        best = dict(list(top.items())[:3])
        assert list(best.values()) == sorted(best.values(), reverse=True) and value <= max(best.values())
        assert len(top) == 3 + (tok not in best)  # the top 3, and the token when it is not among them
        outside += tok not in best
    assert outside > 0  # (the case that matters occurs in this text)


def test_token_id_prompt_is_literal_and_its_first_id_has_no_logprob(model):
    tok = model.tokenizer
    ids = tok.encode(TEXTS[0]).ids
    reply, _ = _run(model, prompt=[tok.eos_id, *ids], max_tokens=0, echo=True, logprobs=0)
    lp = reply["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(t == {tk: v} for t, tk, v in zip(lp["top_logprobs"][1:], lp["tokens"][1:], lp["token_logprobs"][1:],
                                                 strict=True))  # logprobs: 0 -> the token alone
    text, _ = _run(model, prompt=TEXTS[0], max_tokens=0, echo=True, logprobs=0)
    assert lp["token_logprobs"][1:] == text["choices"][0]["logprobs"]["token_logprobs"]  # lm-eval's [<eos>, ...]


def test_text_offsets_point_at_each_tokens_text(model):
    text = "The Cat sat,  on the mat\nmr. Smith 's cat"
    reply, _ = _run(model, prompt=text, max_tokens=0, echo=True, logprobs=1)
    choice = reply["choices"][0]
    assert choice["text"] == text
    lp = choice["logprobs"]
    for tok, off in zip(lp["tokens"], lp["text_offset"], strict=True):
        if tok == "<eos>":
            assert off == len(text) or text[off] == "\n"
        elif tok != "<unk>":
            assert text[off:off + len(tok)].lower() == tok, (tok, off)
    assert lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7},
                                      {"temperature": 0.7, "top_p": 0.9, "seed": 11}])
def test_generation_equals_the_native_route(model, sampling):
    for prompt in ("the cat", "", "a dog ran\nthe"):
        reply, _ = _run(model, prompt=prompt, max_tokens=12, **sampling)
        native = model.generate(prompt, max_new_tokens=12, **sampling)
        lead = " " if prompt and native and not native.startswith("\n") else ""
        assert reply["choices"][0]["text"] == lead + native
        assert reply["choices"][0]["finish_reason"] == "length"
        assert reply["usage"]["completion_tokens"] == 12


def test_echo_with_generation_reports_prompt_and_generated_tokens(model):
    reply, _ = _run(model, prompt="the cat", max_tokens=5, echo=True, logprobs=2, seed=1)
    choice = reply["choices"][0]
    plain, _ = _run(model, prompt="the cat", max_tokens=5, seed=1)
    assert choice["text"] == "the cat" + plain["choices"][0]["text"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 2 + 5 and lp["tokens"][:2] == ["the", "cat"]
    for tok, off in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert choice["text"][off:].lstrip(" ").startswith("\n" if tok == "<eos>" else tok)
    # the prompt's logprobs are the scoring protocol's (its last line left open: no final <eos>)
    scored = model.score("the cat", return_tokens=True).texts[0]["tokens"]
    assert lp["token_logprobs"][:2] == pytest.approx([t["logprob"] for t in scored[:2]], rel=1e-6)


def test_stop_sequences_cut_the_text_and_its_tokens(model):
    full, _ = _run(model, prompt="the", max_tokens=30, seed=5, logprobs=1)
    text = full["choices"][0]["text"]
    stop = text.split()[3]  # a word that occurs in the generation
    cut, _ = _run(model, prompt="the", max_tokens=30, seed=5, logprobs=1, stop=[stop, "zzz"])
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]
    assert text.startswith(choice["text"]) and choice["text"] == text[: text.index(stop)]
    assert all(off < len("the" + choice["text"]) for off in choice["logprobs"]["text_offset"])  # (prompt + text)
    # the tokens are cut with the text: only those whose own text starts before the stop are reported and counted
    kept = len(choice["logprobs"]["tokens"])
    assert cut["usage"]["completion_tokens"] == kept < full["usage"]["completion_tokens"]
    assert choice["logprobs"]["tokens"] == full["choices"][0]["logprobs"]["tokens"][:kept]


def test_one_text_offset_convention_for_echoed_and_generated_tokens(model):
    """Every offset is where the token's own text starts in the prompt followed by the completion (``text`` with
    echo, ``prompt + text`` without), the space between words not included."""
    for prompt in ("the cat sat", [model.tokenizer.eos_id, *model.tokenizer.encode("the cat", add_eos=False).ids]):
        for echo in (True, False):
            reply, _ = _run(model, prompt=prompt, max_tokens=12, echo=echo, logprobs=1, seed=4)
            choice = reply["choices"][0]
            shown = prompt if isinstance(prompt, str) else "\nthe cat"  # (the ids' display text: <eos> a line end)
            whole = choice["text"] if echo else shown + choice["text"]
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == (3 if echo else 0) + 12
            for tok, off in zip(lp["tokens"], lp["text_offset"], strict=True):
                piece = "\n" if tok == "<eos>" else tok
                assert whole[off:off + len(piece)] == piece, (prompt, echo, tok, off, whole)


def test_a_prompt_ending_in_a_line_end_is_read_with_that_line_ended(model):
    reply, _ = _run(model, prompt="the cat sat\n", max_tokens=8, echo=True, logprobs=0, seed=2)
    choice = reply["choices"][0]
    assert choice["logprobs"]["tokens"][:4] == ["the", "cat", "sat", "<eos>"]  # what the model read
    native = model.generate("the cat sat\n", max_new_tokens=8, seed=2)
    assert choice["text"] == "the cat sat\n" + native and not native.startswith(" ")
    assert [model.tokenizer.vocab[i] for i in model.generate_ids("the cat sat\n", max_new_tokens=8, seed=2)] == \
        choice["logprobs"]["tokens"][4:]


def test_top_k_is_honoured_as_the_native_routes(model):
    def native(**sampling) -> str:
        text = model.generate("the cat", max_new_tokens=12, seed=9, **sampling)
        return text if text.startswith("\n") else " " + text  # (the completion reads on from the prompt)

    for k in (1, 3):
        reply, _ = _run(model, prompt="the cat", max_tokens=12, temperature=1.0, seed=9, top_k=k)
        assert reply["choices"][0]["text"] == native(top_k=k)
    greedy, _ = _run(model, prompt="the cat", max_tokens=12, temperature=0)
    top1, _ = _run(model, prompt="the cat", max_tokens=12, temperature=1.0, seed=9, top_k=1)
    assert top1["choices"][0]["text"] == greedy["choices"][0]["text"]
    for off in (0, -1):  # every token (vLLM's -1 and 0)
        reply, _ = _run(model, prompt="the cat", max_tokens=12, temperature=1.0, seed=9, top_k=off)
        assert reply["choices"][0]["text"] == native()


def test_stream_events_add_up_to_the_whole_reply(model):
    for payload in ({"prompt": ["the cat", "a dog"], "max_tokens": 9, "echo": True, "logprobs": 2, "seed": 2},
                    {"prompt": "the", "max_tokens": 20, "seed": 5, "stop": ["cat"], "logprobs": 1},
                    {"prompt": TEXTS[1], "max_tokens": 0, "echo": True, "logprobs": 1}):
        whole, _ = _run(model, **payload)
        _, events = _run(model, **payload, stream=True, stream_options={"include_usage": True})
        frames = events.decode().split("\n\n")
        assert frames[-2:] == ["data: [DONE]", ""]
        chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]
        usage = chunks.pop()
        assert usage["choices"] == [] and usage["usage"] == whole["usage"]
        for choice in whole["choices"]:
            mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
            assert "".join(c["text"] for c in mine) == choice["text"]
            assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"]
            assert all(c["finish_reason"] is None for c in mine[:-1])
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                assert [v for c in mine for v in c["logprobs"][key]] == choice["logprobs"][key]
        assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["object"] == "text_completion"


def test_reply_shape(model):
    reply, _ = _run(model, prompt=["the cat", "a dog"], max_tokens=3, seed=1)
    assert set(reply) == {"id", "object", "created", "model", "choices", "usage"}
    assert reply["id"].startswith("cmpl-") and reply["object"] == "text_completion" and reply["model"] == "tiny"
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in reply["choices"])  # not asked for
    assert reply["usage"]["completion_tokens"] == 6


BAD = [
    ({"prompt": "x", "model": None}, "model", 400),
    ({"prompt": "x", "model": 3}, "model", 400),
    ({"prompt": "x", "model": "other"}, "model", 404),
    ({}, "prompt", 400),
    ({"prompt": 5}, "prompt", 400),
    ({"prompt": []}, "prompt", 400),
    ({"prompt": [[]]}, "prompt", 400),
    ({"prompt": [1, 2, 10**6]}, "prompt[2]", 400),
    ({"prompt": [1, -1]}, "prompt[1]", 400),
    ({"prompt": [1, True]}, "prompt[1]", 400),
    ({"prompt": ["a", 3]}, "prompt[1]", 400),
    ({"prompt": "\ud800"}, "prompt", 400),
    ({"prompt": ["a"] * 5}, "prompt", 400),
    ({"prompt": "a " * 400}, "prompt", 400),
    ({"prompt": ["a " * 240, "a " * 240], "max_tokens": 0, "echo": True}, "prompt", 413),
    ({"prompt": "the", "max_tokens": 41}, "max_tokens", 400),
    ({"prompt": ["the", "a", "cat"], "max_tokens": 40}, "max_tokens", 413),
    ({"prompt": "the", "max_tokens": -1}, "max_tokens", 400),
    ({"prompt": "the", "max_tokens": "5"}, "max_tokens", 400),
    ({"prompt": "the", "max_tokens": 1e300}, "max_tokens", 400),
    ({"prompt": "the", "logprobs": MAX_LOGPROBS + 1}, "logprobs", 400),
    ({"prompt": "the", "logprobs": True}, "logprobs", 400),
    ({"prompt": "the", "echo": "yes"}, "echo", 400),
    ({"prompt": "the", "temperature": -0.1}, "temperature", 400),
    ({"prompt": "the", "temperature": float("nan")}, "temperature", 400),
    ({"prompt": "the", "top_p": 0}, "top_p", 400),
    ({"prompt": "the", "top_k": -2}, "top_k", 400),
    ({"prompt": "the", "top_k": "5"}, "top_k", 400),
    ({"prompt": "the", "top_k": 1.5}, "top_k", 400),
    ({"prompt": "the", "seed": -1}, "seed", 400),
    ({"prompt": "the", "seed": 2**64}, "seed", 400),
    ({"prompt": "the", "stop": ""}, "stop[0]", 400),
    ({"prompt": "the", "stop": ["a"] * 5}, "stop", 400),
    ({"prompt": "the", "stop": [3]}, "stop[0]", 400),
    ({"prompt": "the", "n": 2}, "n", 400),
    ({"prompt": "the", "best_of": 3}, "best_of", 400),
    ({"prompt": "the", "logit_bias": {"5": 1}}, "logit_bias", 400),
    ({"prompt": "the", "suffix": "x"}, "suffix", 400),
    ({"prompt": "the", "stream": 1}, "stream", 400),
    ({"prompt": "the", "stream_options": []}, "stream_options", 400),
    ({"prompt": "", "max_tokens": 0, "echo": True}, "prompt", 400),
]


@pytest.mark.parametrize(("payload", "param", "status"), BAD)
def test_bad_requests_are_refused_naming_the_field(model, payload, param, status):
    payload = {"model": "tiny", **payload}
    with pytest.raises((InvalidRequest, ModelNotServed)) as info:
        parse_completion(payload, model.tokenizer, LIMITS, served="tiny")
    code, body = openai_error_of(info.value)
    assert code == status and set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["param"] == param
    assert len(body["error"]["message"]) < 300
    assert isinstance(info.value, RequestTooLarge) == (status == 413)


def test_a_repeated_key_is_refused_as_on_the_native_route(model):
    """Which of two values would win is the JSON parser's choice, not the client's: both routes refuse it."""
    body = b'{"model": "tiny", "prompt": "the", "max_tokens": 2, "max_tokens": 3}'
    with pytest.raises(InvalidRequest) as openai_route:
        OpenAIDialect(Service(model, LIMITS), "tiny").parse(body, "application/json", LIMITS)
    with pytest.raises(InvalidRequest) as native_route:
        parse_body(b'{"task": "generate", "prompt": "the", "max_new_tokens": 2, "max_new_tokens": 3}',
                   "application/json", LIMITS)
    assert openai_route.value.field == native_route.value.field == "body"
    assert "appears more than once" in str(openai_route.value) and "appears more than once" in str(native_route.value)


def test_unknown_and_neutral_fields_are_accepted(model):
    reply, _ = _run(model, prompt="the", max_tokens=2, seed=1, user="me", presence_penalty=0, frequency_penalty=0,
                    best_of=1, n=1, logit_bias={}, suffix=None, something_new={"x": 1})
    assert reply["usage"]["completion_tokens"] == 2


def test_an_unexpected_failure_is_a_500_in_openai_shape():
    code, body = openai_error_of(RuntimeError("boom"))
    assert code == 500 and body["error"]["type"] == "server_error" and "boom" not in body["error"]["message"]
