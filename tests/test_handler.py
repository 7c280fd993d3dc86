"""The TorchServe adapter (serving/handler.py) without Java: its ``handle`` driven call by call as TorchServe 0.12's
continuous batching drives it, with a stand-in for TorchServe's context (the request ids, headers and the
per-request status, headers, content type and ``ts_stream_next`` that the frontend reads back). The real server
runs the same handler in tests/test_serving.py and tests/test_openai_api.py.

What it pins down: the reply protocol (a reply that starts and ends in one call, 200 or error, goes out whole, in
the call that computes it, and the request leaves the scheduler; a request the frontend no longer sends is
forgotten), the dialect chosen per request by ``X-Zoo-Api``, and a full house of generations: a 503 with
``Retry-After`` in each route's own error shape, scoring still admitted."""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest
import torch

from tests.conftest import REPO, tiny_lm, tiny_tokenizer
from zoo.checkpoint import save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")
GENERATIONS = 2


class TorchServeContext:
    """What the handler reads from and writes to TorchServe's ``Context`` for one call: ``batch`` is
    ``[(request id, headers)]`` in the call's order."""

    def __init__(self, model_dir: str, batch: list[tuple[str, dict[str, str]]] = ()):
        self.system_properties = {"model_dir": model_dir, "gpu_id": None, "batch_size": 2 * GENERATIONS}
        self.model_name = "tiny"
        self.model_yaml_config = {"handler": {"gen_slice_ms": 0, "max_generations": GENERATIONS}}
        self.metrics = None  # (the custom metric is optional: the handler logs and goes on)
        self.request_ids = {i: rid for i, (rid, _) in enumerate(batch)}
        self.headers = [dict(h) for _, h in batch]
        self.status: dict[int, int] = {}
        self.content_type: dict[int, str] = {}
        self.response_headers: dict[int, dict[str, str]] = {}
        self.stopping_criteria: list[Any] = []

    def get_all_request_header(self, idx: int) -> dict[str, str]:
        return self.headers[idx]

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self.response_headers.setdefault(idx, {})[key] = value

    def set_response_status(self, code: int, phrase: str, idx: int) -> None:
        assert phrase.isascii() and phrase
        self.status[idx] = code

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.content_type[idx] = value

    def more(self, idx: int) -> bool | None:
        """TorchServe's ``ts_stream_next`` for request ``idx``: True more to come, False last chunk, None whole."""
        stop = self.stopping_criteria[idx](b"")
        return None if stop is None else not stop


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    lm = tiny_lm("alstm").eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in lm.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return str(save_checkpoint(tmp_path_factory.mktemp("handler") / "tiny", lm, tiny_tokenizer(), {"name": "tiny"}))


def _worker(model_dir: str):
    spec = importlib.util.spec_from_file_location("zoo_torchserve_handler", REPO / "serving" / "handler.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    handler = module.TorchServeHandler()
    handler.initialize(TorchServeContext(model_dir))
    return handler


@pytest.fixture
def worker(model_dir):
    return _worker(model_dir)


class Call:
    """One ``handle`` call: the batch's rows (a new request has a body; a running one none) and what came back."""

    def __init__(self, worker, model_dir: str, rows: list[tuple[str, dict[str, Any] | bytes | None, dict[str, str]]]):
        self.context = TorchServeContext(model_dir, [(rid, headers) for rid, _, headers in rows])
        data = [{} if body is None else {"body": body if isinstance(body, bytes) else json.dumps(body).encode()}
                for _, body, _ in rows]
        self.out = worker.handle(data, self.context)
        self.ids = [rid for rid, _, _ in rows]

    def __getitem__(self, rid: str) -> tuple[int, bytes, bool | None, dict[str, str]]:
        """``(status, body, more, response headers)`` of one request (status 200 unless set)."""
        i = self.ids.index(rid)
        return (self.context.status.get(i, 200), self.out[i], self.context.more(i),
                self.context.response_headers.get(i, {}))


JSON = {"content-type": "application/json"}
OPENAI = {**JSON, "X-Zoo-Api": "openai"}


def test_a_reply_computed_in_one_call_goes_out_whole_in_that_call(worker, model_dir):
    first = Call(worker, model_dir, [("s", {"task": "score", "texts": ["the cat sat"]}, JSON),
                                     ("v", {"model": "tiny", "prompt": "the cat", "max_tokens": 0, "echo": True,
                                            "logprobs": 1}, OPENAI)])
    status, body, more, headers = first["s"]
    assert status == 200 and more is None and json.loads(body)["corpus"]["num_tokens"] == 4
    assert headers["X-Zoo-Batch-Size"] == "2" and first.context.content_type[0] == "application/json"
    status, body, more, _ = first["v"]
    reply = json.loads(body)
    assert status == 200 and more is None and reply["usage"]["prompt_tokens"] == 3  # the, cat, <eos>
    assert reply["choices"][0]["logprobs"]["tokens"] == ["the", "cat", "<eos>"]
    assert not worker.scheduler.jobs and not worker.scheduler.turns  # nothing left to close


def test_an_error_goes_out_whole(worker, model_dir):
    call = Call(worker, model_dir, [("bad", {"task": "score", "texts": 3}, JSON),
                                    ("bad-v1", {"model": "tiny", "prompt": 3}, OPENAI),
                                    ("api", {"texts": ["the"]}, {**JSON, "X-Zoo-Api": "klingon"})])
    status, body, more, _ = call["bad"]
    assert (status, more) == (400, None) and json.loads(body)["field"] == "texts"
    status, body, more, _ = call["bad-v1"]
    assert (status, more) == (400, None) and json.loads(body)["error"]["param"] == "prompt"
    status, body, more, _ = call["api"]
    assert (status, more) == (400, None) and json.loads(body)["field"] == "X-Zoo-Api"
    assert not worker.scheduler.jobs


def test_a_streamed_generation_goes_out_in_chunks_and_a_gone_client_stops_it(worker, model_dir):
    gen = {"task": "generate", "prompt": "the", "max_new_tokens": 6, "seed": 1, "stream": True}
    rows = [("g", gen, JSON)]
    lines, calls = [], 0
    while True:
        call = Call(worker, model_dir, rows)
        status, body, more, _ = call["g"]
        lines += [json.loads(x) for x in body.splitlines()]
        rows, calls = [("g", None, JSON)], calls + 1
        if not more:
            break
    assert status == 200 and calls > 2 and lines[-1]["done"] and lines[-1]["num_tokens"] == 6
    assert "".join(x["text"] for x in lines) == worker.model.generate("the", max_new_tokens=6, seed=1)
    Call(worker, model_dir, [("long", {**gen, "max_new_tokens": 30}, JSON)])
    assert "long" in worker.scheduler.jobs
    Call(worker, model_dir, [])  # the client went away: its work stops
    assert not worker.scheduler.jobs


def test_a_full_house_of_generations_is_a_503_with_retry_after_on_both_routes(worker, model_dir):
    """Generation places filled by one native and one OpenAI generation (the scheduler admits completions into the
    same places): a third generation, native or OpenAI, is refused at once with 503 and Retry-After, each in its
    route's error shape (OpenAI's ``server_error`` / ``overloaded``, as the front door's own 503); a score request
    and a completion that only scores (``max_tokens: 0``) still get in."""
    native = {"task": "generate", "prompt": "the", "max_new_tokens": 30, "seed": 1}
    completion = {"model": "tiny", "prompt": "the", "max_tokens": 30, "seed": 1}
    full = Call(worker, model_dir, [("n", native, JSON), ("o", completion, OPENAI)])
    assert full["n"][2] is True and full["o"][2] is True
    assert sorted(k for k, j in worker.scheduler.jobs.items() if j.generates) == ["n", "o"]
    call = Call(worker, model_dir, [("n", None, JSON), ("o", None, OPENAI), ("n2", native, JSON),
                                    ("o2", completion, OPENAI), ("s", {"texts": ["the cat"]}, JSON),
                                    ("o3", {**completion, "max_tokens": 0, "echo": True, "logprobs": 0}, OPENAI)])
    status, body, more, headers = call["n2"]
    err = json.loads(body)
    assert (status, more) == (503, None) and int(headers["Retry-After"]) >= 1
    assert err["code"] == 503 and err["type"] == "ServiceUnavailable" and "generation" in err["message"]
    status, body, more, headers = call["o2"]
    err = json.loads(body)["error"]
    assert (status, more) == (503, None) and int(headers["Retry-After"]) >= 1
    assert (err["type"], err["code"]) == ("server_error", "overloaded") and "generation" in err["message"]
    assert call["s"][:3] == (200, call["s"][1], None) and json.loads(call["s"][1])["corpus"]["num_tokens"] == 3
    assert call["o3"][0] == 200 and call["o3"][2] is None


class PlainScores:
    """A third wire format, as docs/develop/extending.md describes one: a text/plain body in, its NLL as one text
    line out. One class and one registry entry; the scheduler and the adapter are not touched."""

    def __init__(self, service, served: str):
        self.service = service

    def parse(self, raw: Any, content_type: str, limits: Any) -> Any:
        from zoo.api.service import ScoreRequest

        return ScoreRequest((bytes(raw).decode("utf-8"),))

    def generates(self, request: Any) -> bool:
        return False

    def work(self, request: Any, step_tokens: int) -> Any:
        from zoo.api.dialects import Work

        return Work(self.service.score_steps(request, step_tokens, self.service.within_budget(request)), long=True)

    def content_type(self, request: Any) -> str:
        return "text/plain"

    def chunk(self, job: Any, fresh: list[Any]) -> bytes:
        return f"{job.result['corpus']['nll']!r}\n".encode() if job.done else b""

    def error(self, err: Exception | None, what: str = "request") -> tuple[int, dict[str, Any]]:
        from zoo.api.http import native_error

        return native_error(err, what)


def test_a_third_dialect_is_one_class_and_one_registry_entry(model_dir, monkeypatch):
    from zoo.api import dialects

    monkeypatch.setitem(dialects.DIALECTS, "plain", f"{__name__}:PlainScores")
    worker = _worker(model_dir)
    call = Call(worker, model_dir, [("p", b"the cat sat", {"X-Zoo-Api": "plain"})])
    status, body, more, _ = call["p"]
    assert (status, more) == (200, None) and call.context.content_type[0] == "text/plain"
    assert float(body) == pytest.approx(worker.model.score("the cat sat").corpus["nll"], rel=1e-6)
