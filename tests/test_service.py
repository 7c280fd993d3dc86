"""The service core (zoo.api.service): one schema for every front end, per-request isolation, replies that always
encode. The HTTP server runs the same table of bad inputs against a real TorchServe (tests/test_serving.py)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator

import pytest

from zoo.api.http import native_error, openai_error_of, to_json
from zoo.api.service import (
    CLI_LIMITS,
    GenerateRequest,
    Limits,
    ScoreRequest,
    Service,
    parse_body,
    parse_request,
    parse_score,
)
from zoo.errors import InvalidRequest, ModelNotServed, RequestTooLarge, ServerBusy, ZooError
from zoo.generation import SamplingParams
from zoo.scoring import padded_positions
from zoo.zoo_model import ZooModel

pytestmark = pytest.mark.usefixtures("one_thread")
LIMITS = Limits(max_texts=4, max_chars=200, max_total_chars=500, max_prompt_chars=100, max_new_tokens=20)
GEN = {"task": "generate"}

#: (id, payload, field named in the error): every class of bad value the front ends have met.
BAD_PAYLOADS = [
    ("not-object", ["the cat"], "body"),
    ("task-unknown", {"task": "translate"}, "task"),
    ("task-int", {"task": 5}, "task"),
    ("task-list", {"task": ["score"]}, "task"),
    ("unknown-field", {"texts": ["a"], "max_tokens": 3}, "max_tokens"),
    ("unknown-field-generate", dict(GEN, texts=["a"]), "texts"),
    ("surrogate-key", {"texts": ["a"], "\ud800": 1}, "'\\ud800'"),
    ("surrogate-key-generate", dict(GEN, **{"x\udfff": 1}), "'x\\udfff'"),
    ("control-key", {"texts": ["a"], "a\nb": 1}, "'a\\nb'"),
    ("texts-and-text", {"texts": ["a"], "text": "a"}, "texts"),
    ("texts-missing", {"task": "score"}, "texts"),
    ("texts-str", {"texts": "the cat"}, "texts"),
    ("texts-dict", {"texts": {"a": 1}}, "texts"),
    ("texts-empty", {"texts": []}, "texts"),
    ("texts-too-many", {"texts": ["a"] * 5}, "texts"),
    ("texts-item-int", {"texts": ["a", 3]}, "texts[1]"),
    ("texts-item-none", {"texts": [None]}, "texts[0]"),
    ("texts-item-empty", {"texts": [""]}, "texts[0]"),
    ("texts-item-blank", {"texts": [" \n\t "]}, "texts[0]"),
    ("texts-item-surrogate", {"texts": ["the \ud800 cat"]}, "texts[0]"),
    ("texts-item-low-surrogate", {"texts": ["ok", "\udc80"]}, "texts[1]"),
    ("texts-item-nul", {"texts": ["a\x00b"]}, "texts[0]"),
    ("texts-item-binary", {"texts": ["\x01\x02\x03\x04" * 5 + "the"]}, "texts[0]"),
    ("texts-item-too-long", {"texts": ["a " * 101]}, "texts[0]"),
    ("texts-total-too-long", {"texts": ["a " * 99] * 3}, "texts"),
    ("text-int", {"text": 7}, "text"),
    ("text-surrogate", {"text": "\ud83d"}, "text"),
    ("return-tokens-str", {"texts": ["a"], "return_tokens": "yes"}, "return_tokens"),
    ("return-tokens-int", {"texts": ["a"], "return_tokens": 1}, "return_tokens"),
    ("prompt-int", dict(GEN, prompt=123), "prompt"),
    ("prompt-surrogate", dict(GEN, prompt="the \udbff"), "prompt"),
    ("prompt-nul", dict(GEN, prompt="\x00"), "prompt"),
    ("prompt-too-long", dict(GEN, prompt="a" * 101), "prompt"),
    ("max-new-tokens-over", dict(GEN, max_new_tokens=21), "max_new_tokens"),
    ("max-new-tokens-negative", dict(GEN, max_new_tokens=-1), "max_new_tokens"),
    ("max-new-tokens-float", dict(GEN, max_new_tokens=2.5), "max_new_tokens"),
    ("max-new-tokens-bool", dict(GEN, max_new_tokens=True), "max_new_tokens"),
    ("max-new-tokens-str", dict(GEN, max_new_tokens="5"), "max_new_tokens"),
    ("max-new-tokens-inf", dict(GEN, max_new_tokens=math.inf), "max_new_tokens"),
    ("max-new-tokens-huge", dict(GEN, max_new_tokens=10**400), "max_new_tokens"),
    ("temperature-negative", dict(GEN, temperature=-0.5), "temperature"),
    ("temperature-tiny", dict(GEN, temperature=1e-40), "temperature"),
    ("temperature-below-min", dict(GEN, temperature=1e-300), "temperature"),
    ("temperature-huge", dict(GEN, temperature=1e300), "temperature"),
    ("temperature-nan", dict(GEN, temperature=math.nan), "temperature"),
    ("temperature-inf", dict(GEN, temperature=math.inf), "temperature"),
    ("temperature-str", dict(GEN, temperature="hot"), "temperature"),
    ("temperature-bool", dict(GEN, temperature=False), "temperature"),
    ("top-p-zero", dict(GEN, top_p=0), "top_p"),
    ("top-p-negative", dict(GEN, top_p=-1e-40), "top_p"),
    ("top-p-above-one", dict(GEN, top_p=1.5), "top_p"),
    ("top-p-nan", dict(GEN, top_p=math.nan), "top_p"),
    ("top-p-list", dict(GEN, top_p=[0.5]), "top_p"),
    ("top-k-negative", dict(GEN, top_k=-3), "top_k"),
    ("top-k-float", dict(GEN, top_k=0.5), "top_k"),
    ("seed-str", dict(GEN, seed="abc"), "seed"),
    ("seed-negative", dict(GEN, seed=-1), "seed"),
    ("seed-too-big", dict(GEN, seed=2**64), "seed"),
    ("seed-float", dict(GEN, seed=1.5), "seed"),
    ("stream-str", dict(GEN, stream="yes"), "stream"),
    ("stop-at-eos-int", dict(GEN, stop_at_eos=0), "stop_at_eos"),
]

BAD_BODIES = [  # (id, raw body, content type, field)
    ("invalid-utf8-json", b'{"texts": ["\xff\xfe"]}', "application/json", "body"),
    ("invalid-utf8-plain", b"the cat \xc3\x28", "text/plain", "body"),
    ("empty-plain", b"", "text/plain", "body"),
    ("not-json", b'{"texts": [', "application/json", "body"),
    ("json-nan-literal", b'{"task": "generate", "temperature": NaN}', "application/json", "body"),
    ("json-infinity-literal", b'{"task": "generate", "top_p": -Infinity}', "application/json", "body"),
    ("json-deep", b"[" * 30_000 + b"]" * 30_000, "application/json", "body"),
    ("json-huge-int", b'{"task": "generate", "seed": 1' + b"0" * 5000 + b"}", "application/json", "body"),
    ("json-escaped-surrogate-key", b'{"texts": ["a"], "\\ud800": 1}', "application/json", "'\\ud800'"),
    ("json-escaped-surrogate-text", b'{"texts": ["\\udfff"]}', "application/json", "texts[0]"),
    ("json-escaped-surrogate-prompt", b'{"task": "generate", "prompt": "\\ud800"}', "application/json", "prompt"),
    ("json-tiny-temperature", b'{"task": "generate", "temperature": 1e-39}', "application/json", "temperature"),
    ("json-tiny-top-p", b'{"task": "generate", "top_p": 1e-300}', "application/json", None),  # valid: see below
    ("form-body", b"text=the+cat&x=%zz", "application/x-www-form-urlencoded", "Content-Type"),
    ("octet-stream", b"the cat", "application/octet-stream", "Content-Type"),
    ("str-with-surrogate", "the \ud800", "text/plain", "body"),
    ("json-duplicate-key", b'{"texts": ["a"], "texts": ["b"]}', "application/json", "body"),
    ("json-duplicate-nested", b'{"task": "generate", "seed": 1, "prompt": "a", "seed": 2}', "application/json",
     "body"),
    ("json-without-content-type", b' {"task": "generate", "prompt": "the"}', "", "Content-Type"),
    ("not-bytes", 42, "application/json", "body"),
]


@pytest.mark.parametrize("case", BAD_PAYLOADS, ids=[c[0] for c in BAD_PAYLOADS])
def test_bad_payload_names_its_field_and_encodes(case):
    _, payload, field = case
    with pytest.raises(InvalidRequest) as info:
        parse_request(payload, LIMITS)
    err = info.value
    assert err.field == field, err.message
    assert err.message.startswith(field)
    body = json.loads(to_json(native_error(err)[1]))
    assert body["code"] == 400 and body["field"] == field


@pytest.mark.parametrize("case", BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_body_names_its_field(case):
    _, raw, content_type, field = case
    if field is None:  # a tiny top_p is a valid request: the sampler always keeps the most likely token
        assert isinstance(parse_body(raw, content_type, LIMITS), GenerateRequest)
        return
    with pytest.raises(InvalidRequest) as info:
        parse_body(raw, content_type, LIMITS)
    assert info.value.field == field, info.value.message
    to_json(native_error(info.value)[1]).decode("utf-8")


def test_duplicate_keys_and_untyped_json_are_named():
    with pytest.raises(InvalidRequest, match="the key texts appears more than once"):
        parse_body(b'{"texts": ["a"], "texts": ["b"]}', "application/json", LIMITS)
    with pytest.raises(InvalidRequest, match="send Content-Type: application/json"):
        parse_body(b'{"texts": ["a"]}', "", LIMITS)
    # text that merely starts with a brace, or JSON that is not an object, is still one text to score
    for raw in (b"{the cat} sat", b'["the cat"]', b"{"):
        assert parse_body(raw, "", LIMITS).texts == (raw.decode(),)
    assert parse_body(b'{"texts": ["a"]}', "text/plain", LIMITS).texts == ('{"texts": ["a"]}',)


def test_null_is_an_optional_fields_default_and_errors_speak_json():
    req = parse_request({"texts": ["a"], "return_tokens": None, "dynamic": None}, LIMITS)
    assert req.return_tokens is False and req.dynamic is False
    assert isinstance(parse_request({"task": None, "texts": ["a"]}, LIMITS), ScoreRequest)  # task too
    gen = parse_request(dict(GEN, prompt=None, stream=None, seed=None, top_k=None), LIMITS)
    assert gen.prompt == "" and gen.stream is False and gen.sampling.seed is None and gen.sampling.top_k == 0
    for payload, message in (({"texts": None}, "texts must be a list of strings, got null"),
                             ({"texts": ["a", {"b": 1}]}, "texts[1] must be a string, got an object"),
                             ([1], "expected a JSON object, got an array"),
                             ({"text": None}, "text must be a string, got null"),
                             (dict(GEN, stream=0), "stream must be true or false, got 0")):
        with pytest.raises(InvalidRequest) as info:
            parse_request(payload, LIMITS)
        assert message in str(info.value), info.value


def test_error_body_of_any_caller_error():
    """A ZooError that is not a field's (e.g. a request the loaded model cannot serve) is still the caller's 400."""
    assert native_error(InvalidRequest("texts", "too long")) == (400, {
        "code": 400, "type": "BadRequest", "field": "texts", "message": "texts too long"})
    assert native_error(ZooError("no training data for the statistics")) == (400, {
        "code": 400, "type": "BadRequest", "field": None, "message": "no training data for the statistics"})


@pytest.mark.parametrize(("err", "status", "native_type", "openai_type", "openai_code"), [
    (InvalidRequest("texts", "too long"), 400, "BadRequest", "invalid_request_error", "invalid_value"),
    (RequestTooLarge("texts", "is 9 tokens"), 413, "PayloadTooLarge", "invalid_request_error", "request_too_large"),
    (ModelNotServed("the model 'x' is not served here"), 404, "NotFound", "invalid_request_error", "model_not_found"),
    (ServerBusy("all places are in use"), 503, "ServiceUnavailable", "server_error", "overloaded"),
    (RuntimeError("a bug"), 500, "InternalServerError", "server_error", "internal_error"),
])
def test_every_error_has_one_status_in_both_shapes(err, status, native_type, openai_type, openai_code):
    """One status per error, whichever dialect answers (an OpenAI client refused for a full house was told 503 with
    an ``invalid_request_error`` body; the native shape had no type for 404)."""
    code, body = native_error(err)
    assert code == body["code"] == status and body["type"] == native_type
    code, body = openai_error_of(err)
    assert code == status and body["error"]["type"] == openai_type and body["error"]["code"] == openai_code
    if status == 500:  # a bug's own text stays in the server's log
        assert "a bug" not in json.dumps(body) and "a bug" not in json.dumps(native_error(err)[1])


def test_good_requests_and_integral_floats():
    req = parse_request({"texts": ["the cat", "a dog"], "return_tokens": True}, LIMITS)
    assert isinstance(req, ScoreRequest) and req.texts == ("the cat", "a dog") and req.return_tokens
    assert parse_body(b"the cat", "text/plain; charset=utf-8", LIMITS).texts == ("the cat",)
    assert parse_body(b"the cat", "", LIMITS).texts == ("the cat",)
    gen = parse_request(dict(GEN, prompt="", max_new_tokens=3.0, temperature=0, seed=None), LIMITS)
    assert gen.sampling == SamplingParams(max_new_tokens=3, temperature=0.0)
    assert isinstance(gen.sampling.max_new_tokens, int)


def test_truncation_is_a_warning_when_the_deployment_asks_for_it():
    lim = Limits(max_chars=10, max_total_chars=100, truncate=True)
    req = parse_request({"text": "x" * 30}, lim)
    assert req.texts == ("x" * 10,) and req.warnings == ("text has 30 characters; only the first 10 were used",)
    with pytest.raises(InvalidRequest, match="limit is 10"):
        parse_request({"text": "x" * 30}, Limits(max_chars=10))


def test_limits_from_config_checked():
    assert Limits.from_mapping({"max_texts": 3, "other": 1}).max_texts == 3
    with pytest.raises(InvalidRequest, match="max_texts"):
        Limits.from_mapping({"max_texts": "many"})
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        Limits.from_mapping({"max_new_tokens": 10**6})
    assert Limits.from_mapping({"allow_dynamic": True, "truncate": False}).allow_dynamic  # the yaml's booleans
    assert Limits.from_mapping({"max_temperature": 1.5}).max_temperature == 1.5
    for bad in ("nan", -1, 0, 1e9):  # NaN would switch the cap off, <= 0 refuse every sampled generation
        with pytest.raises(InvalidRequest, match="max_temperature"):
            Limits.from_mapping({"max_temperature": bad})
    with pytest.raises(InvalidRequest, match="allow_dynamic"):
        Limits.from_mapping({"allow_dynamic": 2})


def test_to_json_never_fails():
    assert json.loads(to_json({"a": math.nan, "b": [math.inf, 1.5]})) == {"a": None, "b": [None, 1.5]}
    assert json.loads(to_json({"k": "\ud800"})) == {"k": "\ud800"}  # escaped ASCII JSON, still parseable
    assert to_json({"k": "é"}) == '{"k": "é"}'.encode()


@pytest.fixture
def service(tiny_checkpoint) -> Service:
    return Service(ZooModel.from_pretrained(tiny_checkpoint), LIMITS)


def test_score_batch_equals_each_alone(service):
    reqs = [parse_request({"texts": ["the cat sat", "a dog ran on the mat"]}, LIMITS),
            parse_request({"text": "mr. cat 's mat", "return_tokens": True}, LIMITS)]
    batched = service.score(reqs)
    for req, reply in zip(reqs, batched, strict=True):
        alone = service.score([req])[0]
        assert reply["corpus"]["num_tokens"] == alone["corpus"]["num_tokens"]
        assert reply["corpus"]["nll"] == pytest.approx(alone["corpus"]["nll"], rel=1e-5)
    assert "tokens" in batched[1]["texts"][0] and "tokens" not in batched[0]["texts"][0]
    assert batched[0]["warnings"] == [] and batched[0]["corpus"]["num_texts"] == 2


def test_token_limit_is_counted_after_tokenisation_and_refuses_one_request_alone(service):
    """The character caps do not bound the tokens (a character model spells an unknown character as five
    symbols): each score request is counted once tokenised, and one over the limit fails alone, as a 400."""
    tok = service.model.tokenizer
    small, big = ScoreRequest(("the cat",)), ScoreRequest(("the cat sat on the mat", "a dog"))
    n_small, n_big = (sum(len(tok.encode(t).ids) for t in r.texts) for r in (small, big))
    capped = Service(service.model, Limits(max_total_tokens=n_big - 1))
    replies = capped.score([small, big, small])
    assert isinstance(replies[1], InvalidRequest) and replies[1].field == "texts"
    assert f"tokenise to {n_big:,} tokens" in replies[1].message and f"limit is {n_big - 1:,}" in replies[1].message
    assert replies[0]["corpus"] == replies[2]["corpus"] == service.score([small])[0]["corpus"]
    assert replies[0]["corpus"]["num_tokens"] == n_small
    # the budget counts the positions computed, the texts padded to the longest as they are batched together
    positions = padded_positions([len(tok.encode(t).ids) for t in big.texts])
    assert positions > n_big
    over = Service(service.model, Limits(max_total_tokens=positions - 1)).score([big])[0]
    assert isinstance(over, InvalidRequest) and f"{positions:,} positions" in over.message
    assert not isinstance(Service(service.model, Limits(max_total_tokens=positions)).score([big])[0], Exception)


class _FailsOn:
    """The real model, except that scoring one given text raises: a bug that only one request triggers."""

    def __init__(self, model: ZooModel, poison: str):
        self.model, self.poison, self.tokenizer = model, poison, model.tokenizer

    def score(self, texts, **kw):
        if self.poison in texts:
            raise RuntimeError("boom")
        return self.model.score(texts, **kw)


def test_a_failing_request_fails_alone(service):
    model = service.model
    poisoned = Service(_FailsOn(model, "the dog ran"), LIMITS)
    reqs = [ScoreRequest(("the cat",)), ScoreRequest(("the dog ran",)), ScoreRequest(("a mat", "on the mat"))]
    replies = poisoned.score(reqs)
    assert isinstance(replies[1], Exception)
    for i in (0, 2):
        assert replies[i]["corpus"] == service.score([reqs[i]])[0]["corpus"]


def test_generation_survives_extreme_but_valid_sampling(service):
    for kw in ({"top_p": 1e-300}, {"top_p": 1e-45, "temperature": 1e-6}, {"temperature": 100.0, "top_k": 1},
               {"temperature": 1e-6}):
        req = parse_request(dict(GEN, prompt="the cat", max_new_tokens=5, seed=3, stop_at_eos=False, **kw),
                            LIMITS)
        out = service.generate(req)
        assert out["num_tokens"] == 5, kw
    greedy = service.generate(parse_request(dict(GEN, prompt="the", max_new_tokens=6, temperature=0,
                                                 stop_at_eos=False), LIMITS))
    tiny_top_p = service.generate(parse_request(dict(GEN, prompt="the", max_new_tokens=6, top_p=1e-30, seed=1,
                                                     stop_at_eos=False), LIMITS))
    assert greedy["text"] == tiny_top_p["text"]  # keeping only the top token is greedy decoding


def fuzz_bodies(seed: int, n: int, gen_cap: int | None = None, form: bool = True) -> Iterator[tuple[bytes, str]]:
    """``n`` seeded request bodies with their content types: random bytes, random JSON objects, and good requests
    with one field changed (often to another good value). ``gen_cap`` bounds the tokens a valid-looking generate
    request asks for (the HTTP fuzzer's time bound); ``form=False`` never sends a form content type (TorchServe's
    frontend decodes form bodies itself, before the handler: a known limit, serving/README.md). Shared by the core
    and HTTP fuzzers."""
    rng = random.Random(seed)
    atoms = [None, True, False, 0, 1, -1, 2**63, 10**400, 0.5, -0.0, 1e-320, 1e308, math.nan, math.inf, "",
             " ", "the cat", "\ud800", "\x00", "\u202e", "🚀", "a" * 300, [], [1], {}, {"a": 1}]
    keys = ["task", "texts", "text", "prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
            "stream", "stop_at_eos", "allow_unk", "return_tokens", "\ud800", "x"]
    for _ in range(n):
        kind = rng.random()
        if kind < 0.15:
            yield (bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40))),
                   rng.choice(["application/json", "text/plain", "", "application/x-www-form-urlencoded" if form
                               else "application/octet-stream"]))
            continue
        payload: dict = {"task": rng.choice(["score", "generate", "score", "x", 3])}
        for k in rng.sample(keys, rng.randrange(0, 5)):
            payload[k] = rng.choice(atoms + [["the cat", rng.choice(atoms)], "the dog"])
        if kind < 0.6:  # one field of a good request changed, often to a good value
            payload = {"texts": ["the cat sat"]} if payload["task"] == "score" else dict(GEN)
            key = rng.choice(keys)
            payload[key] = rng.choice(atoms + [3, 0.9, 10, "the dog", ["a cat", "the mat"], True])
        if gen_cap is not None and payload.get("task") == "generate":
            v = payload.get("max_new_tokens")
            if v is None or (isinstance(v, int) and not isinstance(v, bool) and v > gen_cap):
                payload["max_new_tokens"] = gen_cap
        yield json.dumps(payload, allow_nan=True).encode("utf-8"), "application/json"


def test_seeded_fuzz_never_escapes_the_core(service):
    """2,000 random payloads (mutated good requests, random JSON, random bytes): every one is a validated
    request that the service answers, or an InvalidRequest; every reply encodes as UTF-8 JSON."""
    counts = {"ok": 0, "invalid": 0}
    for raw, ctype in fuzz_bodies(1234, 2000):
        try:
            req = parse_body(raw, ctype, LIMITS)
        except InvalidRequest as e:
            to_json(native_error(e)[1]).decode("utf-8")
            counts["invalid"] += 1
            continue
        if isinstance(req, ScoreRequest):
            reply = service.score([req])[0]
            assert not isinstance(reply, Exception)
        else:
            reply = service.generate(GenerateRequest(req.prompt, SamplingParams(
                max_new_tokens=min(req.sampling.max_new_tokens, 3), temperature=req.sampling.temperature,
                top_k=req.sampling.top_k, top_p=req.sampling.top_p, seed=req.sampling.seed)))
        to_json(reply).decode("utf-8")
        counts["ok"] += 1
    # both kinds well represented (the exact split moves by a few with the process's denormal flushing: 1e-320)
    assert counts["ok"] >= 80 and counts["invalid"] >= 500, counts


def test_cli_limits_have_no_size_caps_but_the_same_types():
    req = parse_request({"texts": ["the cat " * 10_000] * 100}, CLI_LIMITS)
    assert len(req.texts) == 100
    with pytest.raises(InvalidRequest, match="surrogate"):
        parse_request({"texts": ["\udcff"]}, CLI_LIMITS)


# -- dynamic evaluation through the core ------------------------------------------------------------------------
def _tiny_corpus_model(root):
    """A tiny model whose vocabulary is that of a tiny PTB-format corpus in ``root`` (its own training split)."""
    import random

    import torch

    from zoo.data import load_corpus
    from zoo.lm import LanguageModel
    from zoo.tokenizer import Tokenizer
    from zoo.zoo_model import ZooModel

    words = "the cat sat on a mat dog ran far and N".split()
    rng = random.Random(0)
    (root / "ptb").mkdir(parents=True)
    for split, n in (("train", 400), ("valid", 20), ("test", 20)):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(n)]
        (root / "ptb" / f"{split}.txt").write_text("\n".join(lines) + "\n")
    corpus = load_corpus("ptb", root)
    torch.manual_seed(0)
    lm = LanguageModel(len(corpus.vocab), "lstm", {"hidden_size": 8, "num_layers": 1}, emb_size=8)
    return ZooModel(lm, Tokenizer(corpus.vocab, "ptb"), {"name": "tiny", "dataset": "ptb"})


def test_dynamic_scoring_is_opt_in_and_runs_through_the_core(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_DATA_DIR", str(tmp_path))
    model = _tiny_corpus_model(tmp_path)
    with pytest.raises(InvalidRequest, match="dynamic evaluation is not enabled here"):
        parse_request({"text": "the cat sat", "dynamic": True})  # the server's default limits
    assert parse_request({"text": "the cat sat", "dynamic": True}, Limits(allow_dynamic=True)).dynamic
    with pytest.raises(InvalidRequest, match="dynamic must be"):
        parse_score({"text": "the cat sat", "dynamic": "yes"}, Limits(allow_dynamic=True))
    text = "the cat sat on a mat and the dog ran far " * 6
    req = parse_score({"text": text, "dynamic": True}, Limits(allow_dynamic=True))
    service = Service(model, Limits(allow_dynamic=True))
    static, dyn, again = (service.score([r])[0] for r in (ScoreRequest((text,)), req, req))
    assert dyn["texts"][0]["nll"] != static["texts"][0]["nll"]       # the weights adapted
    assert dyn["texts"][0]["nll"] == again["texts"][0]["nll"]        # and were restored
    # in a batch with plain requests each is answered as if alone
    mixed = service.score([ScoreRequest((text,)), req])
    assert mixed[0]["texts"][0]["nll"] == pytest.approx(static["texts"][0]["nll"], rel=1e-6)
    assert mixed[1]["texts"][0]["nll"] == dyn["texts"][0]["nll"]
    # without the model's training data the request fails alone, with a user error (not a bug)
    monkeypatch.setenv("ZOO_DATA_DIR", str(tmp_path / "nowhere"))
    other = _tiny_corpus_model(tmp_path / "b")
    (reply,) = Service(other, Limits(allow_dynamic=True)).score([req])
    assert isinstance(reply, ZooError) and "not found" in str(reply)


def test_an_echoed_content_type_is_cut_short():
    """A client's value shown back in an error is a short prefix (a 16 KiB header is not echoed whole)."""
    with pytest.raises(InvalidRequest) as info:
        parse_body(b"the cat", "x-custom/" + "a" * 16_000)
    assert info.value.field == "Content-Type" and len(info.value.message) < 160 and "..." in info.value.message
