"""Supervision of a real server (HAProxy + TorchServe's Java frontend + a Python worker): each part killed with
SIGKILL under load; ``zoo serve status`` names the part that is down and exits non-zero, ``zoo serve stop`` ends
every process of that server (orphaned workers included) and frees every port, and ``start`` then works on the
same ports. The served model is a tiny random aLSTM (fast to load)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from tests.test_serving import _random_tiny_checkpoint
from zoo.cli import main as cli_main
from zoo.tools.ports import TORCHSERVE_DEFAULT_PORTS, free_ports, port_free
from zoo.tools.serve import supervise
from zoo.tools.serve.config import ArchiveOptions, ServerConfig
from zoo.tools.serve.health import server_status
from zoo.tools.serve.keys import read_keys
from zoo.tools.serve.launch import java_version
from zoo.tools.serve.lifecycle import start_server, stop_server

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif((java_version() or 0) < 17, reason="TorchServe needs Java 17 (make system-deps)"),
]


def _config(ports: list[int]) -> ServerConfig:
    return ServerConfig(inference_port=ports[0], management_port=ports[1], metrics_port=ports[2],
                        worker_port=ports[3], grpc_inference_port=ports[4], grpc_management_port=ports[5],
                        client_timeout=3)


class Load:
    """Clients scoring back to back while a part is killed (what they get is recorded, not asserted: a request
    caught by the kill may fail; the point is what the server says and does afterwards)."""

    def __init__(self, url: str, key: str):
        self.url, self.key, self.stop, self.replies = url, key, threading.Event(), []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(3)]

    def _run(self) -> None:
        http = requests.Session()
        http.trust_env = False
        while not self.stop.is_set():
            try:
                r = http.post(self.url, json={"texts": ["the cat sat"]}, timeout=10,
                              headers={"Authorization": f"Bearer {self.key}"})
                self.replies.append((r.status_code, r.headers.get("Retry-After"), r.content[:4000]))
            except requests.RequestException as e:
                self.replies.append((-1, None, type(e).__name__.encode()))

    def check_errors(self) -> None:
        """What the clients got meanwhile: answers, cut or refused connections (-1), or JSON errors whose code is
        the status (a 503 with Retry-After, never TorchServe's "no worker ... scale workers API")."""
        errors = [(code, retry, body) for code, retry, body in self.replies if code != 200]
        for code, retry, body in errors:
            assert code == -1 or json.loads(body)["code"] == code, (code, body)
            assert code != 503 or (retry and b"scale workers" not in body), (retry, body)
        print("replies other than 200:", sorted({(c, r) for c, r, _ in errors}))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=15)


def _status(capsys, run_dir: Path) -> tuple[int, str]:
    capsys.readouterr()
    code = cli_main(["serve", "status", "--run-dir", str(run_dir)])
    return code, capsys.readouterr().out


def _pids(run_dir: Path) -> list[int]:
    return [p.pid for p in supervise.members(json.loads((run_dir / "server.json").read_text()))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return _random_tiny_checkpoint(tmp_path_factory.mktemp("supervision") / "tiny")


@pytest.mark.parametrize("part", ["front door", "TorchServe frontend"])
def test_a_killed_part_is_named_and_stop_frees_every_port(part, tiny, tmp_path, capsys):
    run_dir, ports = tmp_path / "run", free_ports(6, avoid=TORCHSERVE_DEFAULT_PORTS)
    start_server([("tiny", str(tiny))], run_dir, _config(ports), timeout=150)
    try:
        state = json.loads((run_dir / "server.json").read_text())
        url = f"{state['inference']}/predictions/tiny"
        key = read_keys(run_dir)["inference"]
        pids = _pids(run_dir)
        assert len(pids) >= 3 and state["processes"][part]["pid"] in pids  # proxy, Java, worker
        with Load(url, key) as load:
            psutil.Process(state["processes"][part]["pid"]).kill()
            time.sleep(2)
        assert load.replies
        code, out = _status(capsys, run_dir)
        assert code != 0 and f"DOWN  {part}" in out, out
        info = server_status(run_dir)
        assert part in info["down"]
        if part == "TorchServe frontend":  # the proxy answers in JSON, its code the status, with Retry-After
            r = requests.post(url, json={"texts": ["a"]}, headers={"Authorization": f"Bearer {key}"}, timeout=30,
                              proxies={"http": "", "https": ""})
            assert r.status_code in (502, 503) and r.json()["code"] == r.status_code and "Retry-After" in r.headers
            assert any(psutil.pid_exists(p) for p in pids)  # the worker, orphaned, still holds its group
        stop_server(run_dir)
        assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert all(port_free("127.0.0.1", p) for p in ports[:3] + ports[4:6]), ports
        assert _status(capsys, run_dir)[0] == 1
        # and a new server starts on the same ports
        start_server([("tiny", str(tiny))], run_dir, _config(ports), timeout=150)
        r = requests.post(url, json={"texts": ["the cat"]}, timeout=30, proxies={"http": "", "https": ""},
                          headers={"Authorization": f"Bearer {read_keys(run_dir)['inference']}"})
        assert r.status_code == 200, r.text
        assert _status(capsys, run_dir)[0] == 0
        load.check_errors()
    finally:
        stop_server(run_dir)


def test_a_killed_worker_is_reported_until_it_is_back(tiny, tmp_path, capsys):
    """A worker killed mid-stream under load: the stream is cut (an incomplete chunked body), TorchServe restarts
    the worker, and meanwhile status never reports the dead PID as READY.

    Mid-stream for certain, whatever the model's speed: with ``gen_slice_ms=0`` each handler call takes one
    generation step, so a 512-token stream needs 512 calls, each a round trip through the frontend; the test stops
    the worker (SIGSTOP) as soon as the first token is in, before the load starts, and kills it stopped. (The tiny
    model used to finish its 512 tokens in the half second the load took to start.)"""
    run_dir, ports = tmp_path / "run", free_ports(6, avoid=TORCHSERVE_DEFAULT_PORTS)
    start_server([("tiny", str(tiny))], run_dir, _config(ports), ArchiveOptions(gen_slice_ms=0), timeout=150)
    try:
        old = server_status(run_dir)["models"]["tiny"][0]["pid"]
        worker = psutil.Process(old)
        key = read_keys(run_dir)["inference"]
        url = f"http://127.0.0.1:{ports[0]}/predictions/tiny"
        # a streamed reply under way when the worker dies is cut: its chunked body never ends, so the client's
        # library reports an incomplete reply (never a complete-looking 200)
        stream = requests.post(url, json={"task": "generate", "prompt": "the", "max_new_tokens": 512,
                                          "stop_at_eos": False, "stream": True}, stream=True, timeout=60,
                               headers={"Authorization": f"Bearer {key}"}, proxies={"http": "", "https": ""})
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert json.loads(next(lines))["text"] is not None
        worker.suspend()  # one step of 512 taken: the stream's job stays in progress while the load starts
        with Load(url, key) as load:
            worker.kill()
            with pytest.raises(requests.exceptions.ChunkedEncodingError):
                rest = [json.loads(line) for line in lines if line]
                pytest.fail(f"the stream ended cleanly after the worker died: {len(rest)} more lines, {rest[-1:]}")
            time.sleep(1)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                info = server_status(run_dir)
                workers = info["models"]["tiny"]
                assert not any(w["pid"] == old and w["status"] == "READY" for w in workers), workers
                if any(w["status"] == "READY" for w in workers):
                    break
                assert "model tiny: no READY worker" in info["down"], info["down"]
                time.sleep(0.5)
            else:
                pytest.fail("no new READY worker within 90 s")
        assert _status(capsys, run_dir)[0] == 0
        load.check_errors()
    finally:
        stop_server(run_dir)


def test_overload_is_a_json_503_with_retry_after(tiny, tmp_path):
    """More requests at once than TorchServe's job queue holds (1 here): the ones that cannot be queued get a JSON
    503 with Retry-After and a message for the client, never TorchServe's "no worker ... scale workers API".

    Full for certain, whatever the model's speed: the worker is stopped (SIGSTOP) while the requests arrive. The
    front door lets as many requests through to TorchServe as its job queue holds (one) and answers the others 503
    after a second in its own queue; the one let through cannot end while the worker is stopped, so at least six
    of the eight are answered meanwhile, and the test then resumes the worker."""
    run_dir, ports = tmp_path / "run", free_ports(6, avoid=TORCHSERVE_DEFAULT_PORTS)
    cfg = _config(ports)
    cfg.job_queue_size = 1
    start_server([("tiny", str(tiny))], run_dir, cfg, timeout=150)
    worker = psutil.Process(server_status(run_dir)["models"]["tiny"][0]["pid"])
    try:
        key = read_keys(run_dir)["inference"]
        body = {"task": "generate", "prompt": "the", "max_new_tokens": 512, "stop_at_eos": False}

        def send(seed: int) -> requests.Response:
            return requests.post(f"http://127.0.0.1:{ports[0]}/predictions/tiny", json={**body, "seed": seed},
                                 headers={"Authorization": f"Bearer {key}"}, timeout=60,
                                 proxies={"http": "", "https": ""})

        from concurrent.futures import ThreadPoolExecutor, as_completed

        worker.suspend()
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(send, seed) for seed in range(8)]
            try:
                for answered, _ in enumerate(as_completed(futures, timeout=60), 1):
                    if answered == 6:  # the other two wait for the worker
                        break
            finally:
                worker.resume()
            replies = [f.result() for f in futures]
        codes = sorted(r.status_code for r in replies)
        assert 200 in codes and 503 in codes and set(codes) <= {200, 503}, codes
        for r in replies:
            if r.status_code == 503:
                err = r.json()
                assert err["code"] == 503 and "retry" in err["message"].lower() and r.headers["Retry-After"] == "1"
                assert "scale workers" not in r.text
    finally:
        if worker.is_running() and worker.status() == psutil.STATUS_STOPPED:
            worker.resume()
        stop_server(run_dir)
