"""One request schema and one service core for every front end: the TorchServe handler, the Gradio demo, the CLI.

Why: validation used to be written three times (the handler, ``app.py``, ``SamplingParams``), so one bad value
had three behaviours, and a request the handler did not foresee (a lone surrogate in a JSON key) raised out of
it and failed every request of its batch. Here:

* :func:`parse_request` / :func:`parse_body` turn what a client sent into a :class:`ScoreRequest` or
  :class:`GenerateRequest`, or raise :class:`~zoo.errors.InvalidRequest` naming the field (a 400 over HTTP,
  exit 2 on the CLI, a readable error in the demo). The value checks are :mod:`zoo.validate`'s, the sampling
  ranges :class:`~zoo.generation.SamplingParams`'s: each rule is written once.
* :class:`Service` runs validated requests on one model with per-request isolation: a batch of score requests
  goes through one ``ZooModel.score`` call, and if that fails, each request is retried alone so only the
  culprit fails. Nothing a client sends escapes as an exception.
* Replies are encoded by :func:`zoo.api.http.to_json` (NaN/Infinity become null; nothing can fail to encode), errors
  shaped by :mod:`zoo.api.http`.

Framework-free: no TorchServe, no Gradio imports.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from zoo.api.http import JSON_TYPE
from zoo.errors import InvalidRequest, RequestTooLarge, ZooError
from zoo.generation import MAX_NEW_TOKENS_LIMIT, MAX_TEMPERATURE, SamplingParams
from zoo.scoring import Steps, aggregate, padded_positions, run_steps
from zoo.validate import as_bool, as_float, as_int, check_text, json_type, surrogate_position

log = logging.getLogger(__name__)

SCORE_FIELDS = ("task", "texts", "text", "return_tokens", "dynamic")
GENERATE_FIELDS = ("task", "prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_at_eos",
                   "allow_unk", "stream")
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_at_eos", "allow_unk")


@dataclass(frozen=True)
class Limits:
    """What one deployment accepts. The defaults are the HTTP server's; the demo narrows them to its sliders.

    ``max_total_tokens``: tokens per score request, and ``max_generate_tokens``: prompt tokens + ``max_new_tokens``
    per generate request, both counted after tokenisation and checked before any model work (a
    :class:`~zoo.errors.RequestTooLarge`, HTTP 413). They bound a request's *work*, which the character caps do not
    (a character model spells a character outside its alphabet as the five symbols of ``<unk>``; one 10,000-character
    text costs as much as 64 short ones). Sized so that the largest request each allows costs about 2 s of one core
    on the default model (``benchmarks/request_cost.py`` measures it: ``benchmarks/results/request_cost.json``).
    ``truncate``: cut an over-long text to ``max_chars`` with a warning instead of refusing it. ``allow_dynamic``:
    accept ``"dynamic": true`` (dynamic evaluation, :mod:`zoo.dynamic`: ~8x the time of a plain score and a
    one-time pass over the model's training split); off on the server by default, on in the demo.
    """

    max_texts: int = 64
    max_chars: int = 10_000
    max_total_chars: int = 100_000
    # the budgets count a request's work: a score request's padded positions (zoo.scoring.padded_positions), and
    # prompt + generated tokens together on both routes. The largest allowed request of each shape on the default
    # model, one thread (benchmarks/request_cost.py, 2026-11-28, a quiet machine): score 0.48-0.75 CPU-s (one text at
    # the character cap, few long texts, 64 texts, 15 one-word texts beside a long one); generate 1.02;
    # /v1/completions 0.94 (64 prompts read, echo + logprobs), 1.16 (a prompt + 512 generated), 0.99 (8 prompts x 72
    # generated)
    max_total_tokens: int = 2_400
    max_generate_tokens: int = 640
    max_prompt_chars: int = 10_000
    max_new_tokens: int = 512
    max_temperature: float = MAX_TEMPERATURE
    max_top_k: int | None = None
    truncate: bool = False
    allow_dynamic: bool = False

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> Limits:
        """From a config section (the archive's ``handler:`` yaml): known keys only, values checked."""
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in cfg:
                value = cfg[f.name]
                if f.type in ("bool", bool):
                    kw[f.name] = as_bool(value, f.name)
                elif f.name == "max_temperature":
                    kw[f.name] = as_float(value, f.name, 0.0, MAX_TEMPERATURE, lo_open=True)
                else:
                    kw[f.name] = as_int(value, f.name, 1)
        lim = cls(**kw)
        if lim.max_new_tokens > MAX_NEW_TOKENS_LIMIT:
            raise InvalidRequest("max_new_tokens", f"limit {lim.max_new_tokens} is above the library's "
                                                   f"{MAX_NEW_TOKENS_LIMIT}")
        return lim


#: The command line's limits: the schema's types and ranges, no size caps (the user's own machine).
CLI_LIMITS = Limits(max_texts=10**9, max_chars=10**12, max_total_chars=10**12, max_prompt_chars=10**12,
                    max_total_tokens=10**15, max_generate_tokens=10**15, max_new_tokens=MAX_NEW_TOKENS_LIMIT)


@dataclass(frozen=True)
class ScoreRequest:
    texts: tuple[str, ...]
    return_tokens: bool = False
    warnings: tuple[str, ...] = ()
    dynamic: bool = False
    task: str = field(default="score", init=False)


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    sampling: SamplingParams
    stream: bool = False
    warnings: tuple[str, ...] = ()
    task: str = field(default="generate", init=False)


Request = ScoreRequest | GenerateRequest


# -- parsing -------------------------------------------------------------------------------------------------
def _field_name(key: Any) -> str:
    """A client's key or value as it can be shown back, cut short whatever its type (a list or object is named by
    its JSON type, never echoed whole; a key with a lone surrogate is shown escaped)."""
    if not isinstance(key, str):
        return f"({json_type(key)})" if isinstance(key, list | tuple | dict) else ascii(key)[:66]
    return key if surrogate_position(key) is None and key.isprintable() and len(key) <= 64 else ascii(key)[:66]


def _opt(payload: Mapping[str, Any], key: str, default: Any) -> Any:
    """An optional field: absent or ``null`` is its default (the rule for every optional field, as for the
    sampling ones, whose documented ``"seed": null`` means unseeded)."""
    value = payload.get(key)
    return default if value is None else value


def parse_request(payload: Any, limits: Limits = Limits()) -> Request:
    """A decoded JSON object (or the demo's/CLI's keyword dict) -> a validated request."""
    if not isinstance(payload, Mapping):
        raise InvalidRequest("body", f"expected a JSON object, got {json_type(payload)}")
    task = _opt(payload, "task", "score")
    if task not in ("score", "generate"):
        raise InvalidRequest("task", f"unknown task {_field_name(task)}; use 'score' or 'generate'")
    allowed = SCORE_FIELDS if task == "score" else GENERATE_FIELDS
    unknown = sorted(_field_name(k) for k in payload if k not in allowed)
    if unknown:
        raise InvalidRequest(unknown[0], f"is not a field of task {task!r} (allowed: {', '.join(allowed)})")
    return parse_score(payload, limits) if task == "score" else parse_generate(payload, limits)


def parse_score(payload: Mapping[str, Any], limits: Limits = Limits()) -> ScoreRequest:
    if "texts" in payload and "text" in payload:
        raise InvalidRequest("texts", "give either texts or text, not both")
    warnings: list[str] = []
    if "text" in payload:
        text, warns = check_text(payload["text"], "text", limits.max_chars, truncate=limits.truncate)
        texts, warnings = [text], warns
    else:
        if "texts" not in payload:
            raise InvalidRequest("texts", "is missing: give a list of strings to score")
        raw = payload["texts"]
        if not isinstance(raw, list | tuple):
            raise InvalidRequest("texts", f"must be a list of strings, got {json_type(raw)}")
        if not raw:
            raise InvalidRequest("texts", "is an empty list")
        if len(raw) > limits.max_texts:
            raise InvalidRequest("texts", f"has {len(raw)} texts; the limit is {limits.max_texts} per request")
        texts = []
        for i, t in enumerate(raw):
            text, warns = check_text(t, f"texts[{i}]", limits.max_chars, truncate=limits.truncate)
            texts.append(text)
            warnings += warns
    total = sum(len(t) for t in texts)
    if total > limits.max_total_chars:
        raise InvalidRequest("texts", f"has {total:,} characters in all; the limit is {limits.max_total_chars:,} "
                                      "per request")
    dynamic = as_bool(_opt(payload, "dynamic", False), "dynamic")
    if dynamic and not limits.allow_dynamic:
        raise InvalidRequest("dynamic", "evaluation is not enabled here (it takes gradient steps: ~8x the time)")
    return ScoreRequest(tuple(texts), as_bool(_opt(payload, "return_tokens", False), "return_tokens"),
                        tuple(warnings), dynamic)


def parse_generate(payload: Mapping[str, Any], limits: Limits = Limits()) -> GenerateRequest:
    prompt, warnings = check_text(_opt(payload, "prompt", ""), "prompt", limits.max_prompt_chars, allow_empty=True,
                                  truncate=limits.truncate)
    sampling = {k: payload[k] for k in SAMPLING_FIELDS if k in payload and payload[k] is not None}
    if "max_new_tokens" not in sampling:  # the library's default, within this deployment's cap
        sampling["max_new_tokens"] = min(SamplingParams.max_new_tokens, limits.max_new_tokens)
    params = SamplingParams(**sampling)  # the library's ranges (raises InvalidRequest naming the field)
    if params.max_new_tokens > limits.max_new_tokens:
        raise InvalidRequest("max_new_tokens", f"must be an integer between 0 and {limits.max_new_tokens} here, "
                                               f"got {params.max_new_tokens}")
    if params.temperature > limits.max_temperature:
        raise InvalidRequest("temperature", f"must be at most {limits.max_temperature:g} here, "
                                            f"got {params.temperature:g}")
    if limits.max_top_k is not None and params.top_k > limits.max_top_k:
        raise InvalidRequest("top_k", f"must be an integer between 0 and {limits.max_top_k} here, "
                                      f"got {params.top_k}")
    return GenerateRequest(prompt, params, as_bool(_opt(payload, "stream", False), "stream"), tuple(warnings))


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a repeated key (which one would win is the parser's choice, not the client's)."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"the key {_field_name(key)} appears more than once")
        seen.add(key)
    return dict(pairs)


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None


def parse_body(raw: bytes | bytearray | str | None, content_type: str = "",
               limits: Limits = Limits()) -> Request:
    """An HTTP body: ``application/json`` (a request object) or ``text/plain`` / no type (one text to score)."""
    if isinstance(raw, str):
        pos = surrogate_position(raw)
        if pos is not None:
            raise InvalidRequest("body", f"not valid UTF-8 (an unpaired surrogate at character {pos})")
        raw = raw.encode("utf-8")
    if not isinstance(raw, bytes | bytearray):
        raise InvalidRequest("body", "send a JSON object (Content-Type: application/json) or text/plain")
    media = (content_type or "").split(";")[0].strip().lower()
    if media and media != JSON_TYPE and not media.startswith("text/"):
        raise InvalidRequest("Content-Type", f"unsupported {_short(media, 60)!r}; send application/json or "
                                             "text/plain")
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest("body", f"not valid UTF-8 (byte {e.start})") from None
    if not media and text.lstrip().startswith("{") and isinstance(_json_or_none(text), dict):
        raise InvalidRequest("Content-Type", "is missing and the body is a JSON object: send Content-Type: "
                                             "application/json (or text/plain to score it as text)")
    if media != JSON_TYPE:
        body, warnings = check_text(text, "body", limits.max_chars, truncate=limits.truncate)
        return ScoreRequest((body,), warnings=tuple(warnings))
    return parse_request(decode_json(text), limits)


def decode_json(text: str) -> Any:
    """A JSON body, strictly: no NaN/Infinity literals, no repeated key (:class:`~zoo.errors.InvalidRequest`
    naming ``body`` otherwise). Every dialect's parser reads its JSON with this."""
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_object)
    except RecursionError:
        raise InvalidRequest("body", "JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity literals, integers over Python's digit limit
        raise InvalidRequest("body", f"not valid JSON ({_short(str(e))})") from None


def check_score_budget(lengths: Sequence[int], limit: int) -> None:
    """A score request's work against ``max_total_tokens``: the positions it computes, its texts padded as they
    are batched together (:func:`zoo.scoring.padded_positions`), not only its tokens (raises
    :class:`~zoo.errors.RequestTooLarge` naming both counts and the limit)."""
    n, padded = sum(lengths), padded_positions(lengths)
    if padded <= limit:
        return
    if padded == n:
        raise RequestTooLarge("texts", f"tokenise to {n:,} tokens for this model; the limit is {limit:,} per request")
    raise RequestTooLarge("texts", f"tokenise to {n:,} tokens for this model, {padded:,} positions as they are "
                                   "scored (a request's texts are batched together, each padded to the longest of "
                                   f"its batch: send texts of similar length); the limit is {limit:,} per request")


def _short(msg: str, n: int = 120) -> str:
    msg = msg.encode("ascii", "backslashreplace").decode("ascii")
    return msg if len(msg) <= n else msg[: n - 3] + "..."


# -- replies -------------------------------------------------------------------------------------------------
# -- running requests ----------------------------------------------------------------------------------------
class Service:
    """Runs validated requests on one loaded model (``ZooModel``); each request succeeds or fails alone."""

    def __init__(self, model: Any, limits: Limits = Limits()):
        self.model = model
        self.limits = limits

    def score(self, requests: Sequence[ScoreRequest]) -> list[dict[str, Any] | Exception]:
        """One reply per request, in order: ``{"texts", "corpus", "warnings"}``, or the exception that request
        alone raised. All texts go through one batched library call first (batched scores equal unbatched ones
        to float tolerance); if it fails, each request is scored alone so the others are still answered."""
        if not requests:
            return []
        over = self._over_token_limit(requests)
        if over:
            rest = iter(self.score([r for k, r in enumerate(requests) if k not in over]))
            return [over[k] if k in over else next(rest) for k in range(len(requests))]
        if any(r.dynamic for r in requests) and len(requests) > 1:  # dynamic ones are scored apart from the rest
            return [reply for r in requests for reply in self.score([r])]
        texts = [t for r in requests for t in r.texts]
        try:
            report = self.model.score(texts, return_tokens=any(r.return_tokens for r in requests),
                                      dynamic=requests[0].dynamic)
        except ZooError as e:  # the caller's own problem (e.g. no training data for the statistics): its 4xx
            if len(requests) == 1:
                return [e]
            return [reply for r in requests for reply in self.score([r])]
        except Exception:
            if len(requests) == 1:
                log.exception("scoring failed")
                return [RuntimeError("scoring failed")]
            return [reply for r in requests for reply in self.score([r])]
        out: list[dict[str, Any] | Exception] = []
        pos = 0
        for r in requests:
            out.append(self.reply_of(r, report.texts[pos:pos + len(r.texts)]))
            pos += len(r.texts)
        return out

    def reply_of(self, request: ScoreRequest, results: list[dict[str, Any]]) -> dict[str, Any]:
        """The reply to one score request from its texts' results."""
        if not request.return_tokens:
            results = [{k: v for k, v in res.items() if k != "tokens"} for res in results]
        return {"texts": results, "corpus": corpus_of(results, request.texts, self.model.tokenizer),
                "warnings": list(request.warnings)}

    def within_budget(self, request: Request) -> list[Any]:
        """Check ``request``'s tokens against this deployment's budget before any model work (raises
        :class:`~zoo.errors.RequestTooLarge` naming the limit and the count); returns a score request's
        encodings, for scoring to reuse (``[]`` for a generate request)."""
        tok = self.model.tokenizer
        if isinstance(request, ScoreRequest):
            at_least, limit = sum(tok.min_tokens(t) for t in request.texts), self.limits.max_total_tokens
            if at_least > limit:  # refused without tokenising (a flood of such requests took the worker's time)
                raise RequestTooLarge("texts", f"tokenise to {at_least:,} tokens or more for this model; the limit "
                                               f"is {limit:,} per request")
            encs = [tok.encode(t) for t in request.texts]
            check_score_budget([len(e.ids) for e in encs], self.limits.max_total_tokens)
            return encs
        prompt = len(tok.encode(request.prompt, add_eos=False).ids)
        n, limit = prompt + request.sampling.max_new_tokens, self.limits.max_generate_tokens
        if n > limit:
            raise RequestTooLarge("prompt", f"of {prompt:,} tokens + max_new_tokens {request.sampling.max_new_tokens:,}"
                                            f" is {n:,} tokens for this model; the limit is {limit:,} per request")
        return []

    def score_steps(self, request: ScoreRequest, step_tokens: int,
                    encodings: list[Any] | None = None) -> Steps[dict[str, Any]]:
        """One score request's reply, computed in steps of at most ``step_tokens`` tokens (its own texts
        batched together only; the same numbers as :meth:`score`). Dynamic evaluation, where a deployment enables it, is
        one step (it takes gradient steps text by text)."""
        if request.dynamic:
            reply = self.score([request])[0]
            if isinstance(reply, Exception):
                raise reply
            return reply
        report = yield from self.model.score_steps(list(request.texts), return_tokens=request.return_tokens,
                                                   step_tokens=step_tokens, encodings=encodings)
        return self.reply_of(request, report.texts)

    def score_together(self, items: Sequence[tuple[ScoreRequest, list[Any]]]) -> list[dict[str, Any] | Exception]:
        """Several plain score requests, each with its texts' encodings (:meth:`within_budget`'s), as one batched
        library call (their texts sorted by length and batched together, as :meth:`score` batches them); a reply or
        the exception that request alone raised, in order. If the call fails, each request is scored alone."""
        texts = [t for r, _ in items for t in r.texts]
        encodings = [e for _, encs in items for e in encs]
        try:
            report = run_steps(self.model.score_steps(texts, return_tokens=any(r.return_tokens for r, _ in items),
                                                      encodings=encodings))
        except Exception:
            if len(items) == 1:
                raise
            return [self._alone(r, encs) for r, encs in items]
        out: list[dict[str, Any] | Exception] = []
        pos = 0
        for r, _ in items:
            out.append(self.reply_of(r, report.texts[pos:pos + len(r.texts)]))
            pos += len(r.texts)
        return out

    def _alone(self, request: ScoreRequest, encodings: list[Any]) -> dict[str, Any] | Exception:
        try:
            return self.score_together([(request, encodings)])[0]
        except ZooError as e:
            return e
        except Exception:
            log.exception("scoring failed")
            return RuntimeError("scoring failed")

    def _over_token_limit(self, requests: Sequence[ScoreRequest]) -> dict[int, RequestTooLarge]:
        """The requests whose texts tokenise to more than ``max_total_tokens`` (by index), each refused alone."""
        over = {}
        for k, r in enumerate(requests):
            try:
                self.within_budget(r)
            except RequestTooLarge as e:
                over[k] = e
        return over

    def stream(self, request: GenerateRequest) -> Iterator[str]:
        """The generated pieces (their concatenation is the continuation)."""
        return self.model.stream(request.prompt, **{f.name: getattr(request.sampling, f.name)
                                                    for f in fields(SamplingParams)})

    def stream_steps(self, request: GenerateRequest, step_tokens: int) -> Iterator[str | None]:
        """:meth:`stream`, with a ``None`` after each piece of at most ``step_tokens`` prompt tokens read."""
        return self.model.stream_steps(request.prompt, request.sampling, step_tokens)

    def generate(self, request: GenerateRequest) -> dict[str, Any]:
        return generate_reply(request, list(self.stream(request)))


def generate_reply(request: GenerateRequest, pieces: Sequence[str]) -> dict[str, Any]:
    """The reply to a non-streamed generate request, from its generated pieces (also for a server that advances
    a generation across several calls)."""
    return {"prompt": request.prompt, "text": "".join(pieces), "num_tokens": len(pieces),
            "warnings": list(request.warnings)}


def corpus_of(results: list[dict[str, Any]], texts: Sequence[str], tokenizer: Any) -> dict[str, Any]:
    """The token-weighted aggregate over one request's texts: :func:`zoo.scoring.aggregate`, as the library's."""
    return aggregate(results, sum(len(t) for t in texts), tokenizer)
