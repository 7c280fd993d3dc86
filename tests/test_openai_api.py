"""The OpenAI-compatible API against the real server (front door + TorchServe + the zoo's handler), with the real
clients: the official ``openai`` package and lm-evaluation-harness's ``local-completions`` model. One server for
the module, started by ``zoo serve start`` on free loopback ports and stopped by PID at the end."""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.conftest import REPO, real_data
from zoo.tools.ports import TORCHSERVE_DEFAULT_PORTS, free_ports, loopback_address
from zoo.tools.serve.launch import java_version
from zoo.tools.serve.lifecycle import stop_server
from zoo.zoo_model import ZooModel, resolve_local

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")  # (the openai client's own transport)

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif((java_version() or 0) < 17, reason="TorchServe needs Java 17 (make system-deps)"),
]

NAME = "default"
TEXTS = ["the company said it expects sales to rise", "mr. smith was n't available\nthe stock fell N %"]


class Server:
    def __init__(self, run_dir: Path, port: int):
        self.run_dir = run_dir
        self.base = f"http://127.0.0.1:{port}"
        keys = json.loads((run_dir / "key_file.json").read_text())
        self.key = keys["inference"]["key"]
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key=self.key, max_retries=0, timeout=60)
        self.http = requests.Session()
        self.http.trust_env = False
        self.model = ZooModel.from_pretrained(resolve_local(NAME)[0])

    def client_at(self, client: int) -> openai.OpenAI:
        """The openai client connecting from client number ``client``'s own loopback address: the front door tells
        clients apart by their address (:func:`zoo.tools.ports.loopback_address`)."""
        transport = httpx.HTTPTransport(local_address=loopback_address(client))
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=self.key, max_retries=0, timeout=60,
                             http_client=httpx.Client(transport=transport, trust_env=False))

    def post(self, path: str, body: bytes | dict, key: str | None = None, **headers: str) -> requests.Response:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key or self.key}", **headers}
        return self.http.post(self.base + path, data=data, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    run_dir, ports = tmp_path_factory.mktemp("openai") / "run", free_ports(4, avoid=TORCHSERVE_DEFAULT_PORTS)
    proc = subprocess.run(
        [sys.executable, "-m", "zoo.cli", "serve", "start", NAME, "--run-dir", str(run_dir),
         "--inference-port", str(ports[0]), "--management-port", str(ports[1]), "--metrics-port", str(ports[2]),
         "--worker-port", str(ports[3]), "--threads", "1", "--timeout", "150"],
        capture_output=True, text=True, timeout=200, cwd=REPO)
    try:
        assert proc.returncode == 0, proc.stderr + proc.stdout
        yield Server(run_dir, ports[0])
    finally:
        stop_server(run_dir)


def test_echoed_logprobs_through_the_openai_client_equal_zoo_score(server):
    for text in TEXTS:
        r = server.client.completions.create(model=NAME, prompt=text, max_tokens=0, echo=True, logprobs=1)
        choice = r.choices[0]
        assert choice.text == text and r.object == "text_completion" and r.model == NAME
        nll = server.model.score(text).texts[0]["nll"]
        assert math.isclose(-sum(choice.logprobs.token_logprobs), nll, rel_tol=1e-6)
        assert r.usage.prompt_tokens == len(choice.logprobs.tokens) and r.usage.completion_tokens == 0


def test_plain_and_streamed_completions_agree_and_equal_the_native_route(server):
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 42}):
        r = server.client.completions.create(model=NAME, prompt="the market", max_tokens=12, **sampling)
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
        stream = server.client.completions.create(model=NAME, prompt="the market", max_tokens=12, stream=True,
                                                  **sampling)
        assert "".join(chunk.choices[0].text for chunk in stream) == text
        native = server.post(f"/predictions/{NAME}", {"task": "generate", "prompt": "the market",
                                                      "max_new_tokens": 12, **sampling})
        assert native.status_code == 200, native.text
        assert text == " " + native.json()["text"]  # the OpenAI text reads on from the prompt: one leading space


def test_stop_sequence_and_several_prompts(server):
    r = server.client.completions.create(model=NAME, prompt=["the market", "the company"], max_tokens=20, seed=1,
                                         temperature=1.0, stop=["\n"])
    assert [c.index for c in r.choices] == [0, 1]
    assert all("\n" not in c.text for c in r.choices)


def test_a_full_house_of_generations_is_a_503_in_openai_shape_with_retry_after(server):
    """With batch size 8, at most 4 generations run at once (completions take the same places as the native route's
    generations): a fifth completion is answered at once with 503, ``Retry-After`` and OpenAI's ``server_error`` /
    ``overloaded`` (the front door's own 503 on this route says the same), and a scoring completion still runs."""
    opened = threading.Barrier(5)

    def stream(seed: int) -> str | None:  # four clients (one may hold at most 3 places for long work)
        chunks = server.client_at(seed).completions.create(model=NAME, prompt="the", max_tokens=512, seed=seed,
                                                           stream=True)
        first = next(iter(chunks))
        opened.wait(timeout=60)
        return [c.choices[0].finish_reason for c in chunks if c.choices][-1] or first.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, seed) for seed in range(4)]
        opened.wait(timeout=60)
        with pytest.raises(openai.APIStatusError) as busy:
            server.client.completions.create(model=NAME, prompt="the", max_tokens=5)
        scored = server.client.completions.create(model=NAME, prompt="the cat", max_tokens=0, echo=True, logprobs=0)
        reasons = [f.result() for f in futures]
    assert reasons == ["length"] * 4  # the four ran to their length, undisturbed
    assert busy.value.status_code == 503 and int(busy.value.response.headers["Retry-After"]) >= 1
    err = busy.value.response.json()["error"]
    assert (err["type"], err["code"]) == ("server_error", "overloaded") and "generation" in err["message"]
    assert scored.usage.prompt_tokens == 3


# -- the route's contract, point by point (zoo/api/completions.py's docstring), as a client sees it --------------------
def _pieces(tokens: list[str]) -> list[str]:
    return ["\n" if t == "<eos>" else t for t in tokens]


def test_every_text_offset_points_at_its_tokens_own_text(server):
    """One convention for echoed and generated tokens: the offset of the token's first character in the prompt
    followed by the completion (``text`` with echo, ``prompt + text`` without); ``<eos>`` at its line break, a
    normalised token at the text it came from."""
    prompt = "the company said it expects"
    for echo in (True, False):
        r = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, echo=echo,
                                             logprobs=1)
        choice = r.choices[0]
        whole = choice.text if echo else prompt + choice.text
        lp = choice.logprobs
        assert len(lp.tokens) == (5 if echo else 0) + 16 and lp.text_offset == sorted(lp.text_offset)
        for piece, off in zip(_pieces(lp.tokens), lp.text_offset, strict=True):
            assert whole[off:off + len(piece)] == piece, (echo, piece, off, whole)
    r = server.client.completions.create(model=NAME, prompt="Sales rose 5 %", max_tokens=0, echo=True, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["sales", "rose", "N", "N", "<eos>"]  # PTB's normalisation: `5` and `%` are each `N`
    assert lp.text_offset == [0, 6, 11, 13, 14]


def test_a_stop_sequence_cuts_logprobs_and_usage_with_the_text(server):
    """Greedy text with a line end in it, stopped at that line end: the reply keeps the tokens before it, and no
    more, in ``logprobs`` and ``usage``; streamed, the same."""
    whole = server.client.completions.create(model=NAME, prompt="the market", max_tokens=40, temperature=0,
                                             logprobs=1)
    tokens = whole.choices[0].logprobs.tokens
    assert "<eos>" in tokens, whole.choices[0].text  # (the greedy continuation has a line end within 40 tokens)
    k = tokens.index("<eos>")
    cut = server.client.completions.create(model=NAME, prompt="the market", max_tokens=40, temperature=0,
                                           logprobs=1, stop=["\n"])
    choice = cut.choices[0]
    assert choice.finish_reason == "stop" and choice.text == whole.choices[0].text.split("\n")[0]
    assert choice.logprobs.tokens == tokens[:k] and choice.logprobs.token_logprobs == \
        whole.choices[0].logprobs.token_logprobs[:k]
    assert cut.usage.completion_tokens == k and cut.usage.total_tokens == cut.usage.prompt_tokens + k
    stream = server.client.completions.create(model=NAME, prompt="the market", max_tokens=40, temperature=0,
                                              logprobs=1, stop=["\n"], stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(stream)
    assert [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens] == tokens[:k]
    assert chunks[-1].usage.completion_tokens == k


def test_a_prompt_ending_in_a_line_end_is_read_with_that_line_ended(server):
    """The model reads the line end as ``<eos>`` (the last echoed prompt token), so the completion starts a new
    line, as ``prompt + text`` shows it; the native route and the Python API read it the same way."""
    prompt = "the company said\n"
    r = server.client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, echo=True,
                                         logprobs=0)
    lp = r.choices[0].logprobs
    assert lp.tokens[:4] == ["the", "company", "said", "<eos>"]
    ids = server.model.generate_ids(prompt, max_new_tokens=10, temperature=0)
    assert lp.tokens[4:] == [server.model.tokenizer.vocab[i] for i in ids]
    native = server.post(f"/predictions/{NAME}", {"task": "generate", "prompt": prompt, "max_new_tokens": 10,
                                                  "temperature": 0}).json()["text"]
    assert r.choices[0].text == prompt + native and not native.startswith(" ")


def test_a_repeated_key_is_refused_as_on_the_native_route(server):
    body = b'{"model": "default", "prompt": "the", "max_tokens": 2, "max_tokens": 3}'
    r = server.post("/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text
    assert "more than once" in r.json()["error"]["message"]
    native = server.post(f"/predictions/{NAME}", b'{"task": "score", "text": "a", "text": "b"}')
    assert native.status_code == 400 and native.json()["field"] == "body"


def test_top_logprobs_include_the_chosen_token(server):
    r = server.client.completions.create(model=NAME, prompt="the market", max_tokens=20, temperature=1.0, seed=3,
                                         logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[tok] == value and len(top) in (1, 2)
    assert any(len(top) == 2 for top in lp.top_logprobs)  # (sampled tokens that are not the most likely one)


def test_top_k_is_honoured(server):
    """vLLM's ``top_k`` (sent as an extra field by the openai client): the native route's rule; a bad value 400."""
    greedy = server.client.completions.create(model=NAME, prompt="the market", max_tokens=12, temperature=0)
    top1 = server.client.completions.create(model=NAME, prompt="the market", max_tokens=12, temperature=1.0, seed=5,
                                            extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text
    top5 = server.client.completions.create(model=NAME, prompt="the market", max_tokens=12, temperature=1.0, seed=5,
                                            extra_body={"top_k": 5})
    native = server.model.generate("the market", max_new_tokens=12, temperature=1.0, seed=5, top_k=5)
    assert top5.choices[0].text.lstrip(" ") == native
    with pytest.raises(openai.BadRequestError) as bad:
        server.client.completions.create(model=NAME, prompt="the", max_tokens=1, extra_body={"top_k": -5})
    assert bad.value.body["param"] == "top_k"


def test_chat_completions_are_refused_in_one_line_saying_why(server):
    with pytest.raises(openai.NotFoundError) as refused:
        server.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hello"}])
    err = refused.value.body
    assert err["code"] == "chat_not_supported" and "/v1/completions" in err["message"]
    assert "\n" not in err["message"]


def test_models_are_listed_with_the_zoos_facts(server):
    models = server.client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [NAME]
    raw = server.http.get(f"{server.base}/v1/models", headers={"Authorization": f"Bearer {server.key}"},
                          timeout=30).json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "model"


def test_a_wrong_or_missing_key_is_401_in_openai_shape(server):
    bad = openai.OpenAI(base_url=f"{server.base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model=NAME, prompt="the", max_tokens=1)
    assert info.value.status_code == 401
    r = server.http.post(f"{server.base}/v1/completions", json={"model": NAME, "prompt": "x"}, timeout=30)
    assert r.status_code == 401 and set(r.json()["error"]) >= {"message", "type", "code"}
    assert r.headers.get("WWW-Authenticate", "").startswith("Bearer")


BAD_BODIES: list[tuple[str, bytes | dict, int]] = [
    ("unknown model", {"model": "nope", "prompt": "x"}, 404),
    ("missing model", {"prompt": "x"}, 400),
    ("model not a string", {"model": 5, "prompt": "x"}, 404),  # the front door: no served model has that name
    ("missing prompt", {"model": NAME}, 400),
    ("prompt a number", {"model": NAME, "prompt": 3}, 400),
    ("token id out of range", {"model": NAME, "prompt": [1, 10**9]}, 400),
    ("max_tokens huge", {"model": NAME, "prompt": "x", "max_tokens": 10**30}, 400),
    ("max_tokens a string", {"model": NAME, "prompt": "x", "max_tokens": "5"}, 400),
    ("logprobs over the cap", {"model": NAME, "prompt": "x", "logprobs": 1000}, 400),
    ("temperature negative", {"model": NAME, "prompt": "x", "temperature": -1}, 400),
    ("top_p zero", {"model": NAME, "prompt": "x", "top_p": 0}, 400),
    ("seed negative", {"model": NAME, "prompt": "x", "seed": -5}, 400),
    ("n above 1", {"model": NAME, "prompt": "x", "n": 3}, 400),
    ("stop not strings", {"model": NAME, "prompt": "x", "stop": [1, 2]}, 400),
    ("lone surrogate", b'{"model": "default", "prompt": "a\\ud800b"}', 400),
    ("not JSON", b"{not json", 400),
    ("a JSON list", b"[1, 2]", 400),
    ("NaN literal", b'{"model": "default", "prompt": "x", "temperature": NaN}', 400),
    ("deep nesting", b'{"model": "default", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    ("too many tokens", {"model": NAME, "prompt": "the " * 2500, "max_tokens": 0, "echo": True}, 413),
]


@pytest.mark.parametrize(("what", "body", "status"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_requests_get_a_4xx_in_openai_shape(server, what, body, status):
    r = server.post("/v1/completions", body)
    assert r.status_code == status, (what, r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and len(err["message"]) < 400


def test_wrong_methods_and_paths_are_4xx_json(server):
    headers = {"Authorization": f"Bearer {server.key}"}
    for method, path in (("GET", "/v1/completions"), ("PUT", "/v1/completions"), ("DELETE", "/v1/completions"),
                         ("POST", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/v1/nothing")):
        r = server.http.request(method, server.base + path, headers=headers, json={"model": NAME}, timeout=30)
        assert 400 <= r.status_code < 500, (method, path, r.status_code)
        assert "error" in r.json()


@pytest.mark.slow
def test_lm_eval_local_completions_reproduces_the_zoos_numbers(server, tmp_path):
    """The server guide's `lm_eval --model local-completions` command, as written (its tokenizer: the served
    checkpoint's folder, `zoo info default --directory`; only the port is this server's), on the first lines of
    PTB's test split (a document per line, each scored from a zero state): the word perplexity is the zoo's score
    of the same lines. Every checkpoint carries the tokenizer_config.json transformers needs for <eos>."""
    import re

    pytest.importorskip("tenacity")
    guide = (REPO / "serving" / "README.md").read_text(encoding="utf-8")
    command = re.search(r"```bash\n(OPENAI_API_KEY=\$KEY lm_eval .*?)```", guide, re.S)[1]
    assert "tokenizer=\"$(zoo info default --directory)\"" in command
    command = command.replace("http://127.0.0.1:8080", server.base)
    env = dict(os.environ, KEY=server.key, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", command.rstrip() + f" --output_path {tmp_path}"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = glob.glob(str(tmp_path / "**" / "results_*.json"), recursive=True)
    got = json.loads(Path(files[0]).read_text())["results"]["zoo_ptb_test_lines"]["word_perplexity,none"]
    lines = [ln for ln in (real_data("ptb") / "test.txt").read_text().split("\n") if ln.strip()]
    assert got == pytest.approx(server.model.score(lines[:12]).corpus["ppl"], rel=1e-5)
