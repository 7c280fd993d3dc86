"""One device argument everywhere (``zoo.device``): every entry point takes it and runs there, a device this machine
lacks is refused in one line (a ``DeviceError`` in Python, exit 2 on the command lines), and on CUDA the numbers are
the CPU's (the checks that need a GPU are skipped without one, saying so)."""

from __future__ import annotations

import contextlib
import json
import os
import string
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import zoo
from tests.conftest import REPO, WORDS
from tests.test_dynamic import tiny_data  # noqa: F401 (a fixture: a PTB-style corpus over the tiny vocabulary)
from zoo.adaptation import trace_text
from zoo.device import check_gpus, device_of, resolve_device
from zoo.errors import DeviceError, ZooError

HAS_CUDA = torch.cuda.is_available()
NO_CUDA = pytest.mark.skipif(HAS_CUDA, reason="checks the refusal of CUDA on a machine without it")
NEEDS_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run on the device tool's machine)")
#: The devices the placement checks run on: the CPU everywhere, CUDA where there is one (skipped, saying so,
#: elsewhere).
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]
TEXTS = ["the cat sat on the mat", "a dog ran\nthe mat"]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(*cmd: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, env=ENV, cwd=REPO, timeout=timeout)


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert all(n in lines[0] for n in needles), lines[0]


# -- the one parser ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [None, "cpu", " CPU ".strip().lower(), torch.device("cpu")])
def test_cpu_spellings(spec):
    assert resolve_device(spec) == torch.device("cpu")


def test_auto_takes_cuda_only_when_there_is_one():
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else "cpu")
    assert resolve_device("AUTO") == resolve_device("auto")


@pytest.mark.parametrize("spec, needle", [("gpu", "is not a device"), ("cuda:x", "is not a device"),
                                          ("mps", "the zoo runs on cpu or cuda"), (3, "must be a str")])
def test_what_is_not_a_device_is_refused_in_one_line(spec, needle):
    with pytest.raises(DeviceError, match=needle) as e:
        resolve_device(spec, "--device")
    assert "\n" not in str(e.value) and isinstance(e.value, ZooError) and isinstance(e.value, ValueError)


@NO_CUDA
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3", torch.device("cuda", 1)])
def test_cuda_without_cuda_is_a_device_error(spec):
    with pytest.raises(DeviceError, match="no CUDA device torch can use"):
        resolve_device(spec)


@NEEDS_CUDA
def test_a_cuda_index_past_the_last_gpu_is_refused():
    n = torch.cuda.device_count()
    with pytest.raises(DeviceError, match=f"has {n} CUDA device"):
        resolve_device(f"cuda:{n}")
    assert resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())  # (with its index)


def test_gpu_counts():
    assert check_gpus(0) == 0
    with pytest.raises(DeviceError, match=">= 0"):
        check_gpus(-1)
    if not HAS_CUDA:
        with pytest.raises(DeviceError, match="no CUDA device"):
            check_gpus(1)
    else:
        with pytest.raises(DeviceError, match="CUDA device"):
            check_gpus(torch.cuda.device_count() + 1)


# -- the library on the CPU: same placement, bit-identical numbers ----------------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    """A tiny aLSTM checkpoint."""
    from tests.conftest import tiny_lm, tiny_tokenizer
    from zoo.checkpoint import save_checkpoint

    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", tiny_lm("alstm", init_range=1.0).eval(),
                           tiny_tokenizer(), {"name": "tiny", "dataset": "ptb"})


@pytest.fixture(scope="module")
def pair(tiny_path):
    """The tiny checkpoint loaded twice: by default and with ``device="cpu"``."""
    return zoo.load(tiny_path), zoo.load(tiny_path, device="cpu")


@contextlib.contextmanager
def inputs_seen(model: zoo.ZooModel) -> Iterator[list[torch.device]]:
    """Every device a tensor (or state tensor) handed to the real model's forward, its stack's forward or its
    single step was on, while the block runs."""
    seen: list[torch.device] = []

    def record(args: tuple) -> None:
        seen.extend(a.device for a in args if isinstance(a, torch.Tensor))
        seen.extend(s.device for a in args if isinstance(a, tuple) for s in a if isinstance(s, torch.Tensor))

    step = model.lm.step
    model.lm.step = lambda *args: (record(args), step(*args))[1]
    hooks = [m.register_forward_pre_hook(lambda _m, args: record(args)) for m in (model.lm, model.lm.rnn)]
    try:
        yield seen
    finally:
        del model.lm.step
        for h in hooks:
            h.remove()


def test_device_cpu_is_the_default_bit_for_bit(pair):
    default, cpu = pair
    assert default.device == cpu.device == torch.device("cpu") and cpu.runner is cpu.lm
    assert all(p.device.type == "cpu" for p in cpu.lm.parameters())
    a, b = default.score(TEXTS, return_tokens=True), cpu.score(TEXTS, return_tokens=True)
    assert a.to_dict() == b.to_dict()
    sampling = {"max_new_tokens": 12, "temperature": 0.8, "top_k": 5, "seed": 3}
    assert default.generate_ids("the cat", **sampling) == cpu.generate_ids("the cat", **sampling)
    assert list(default.stream("the", max_new_tokens=5, temperature=0)) == list(cpu.stream("the", max_new_tokens=5,
                                                                                          temperature=0))
    assert trace_text(default.lm, default.tokenizer, TEXTS[0]).to_dict() == \
        trace_text(cpu.lm, cpu.tokenizer, TEXTS[0]).to_dict()


@pytest.mark.usefixtures("tiny_data")
@pytest.mark.parametrize("device", DEVICES)
def test_every_entry_point_feeds_the_model_on_its_device(tiny_path, device):
    """Scoring (plain and dynamic), generation, the adaptation trace and corpus evaluation hand the model tensors
    on the device it was loaded on, and nothing else: on every device this machine has."""
    model = zoo.load(tiny_path, device=device)
    assert model.device.type == device
    with inputs_seen(model) as seen:
        model.score(TEXTS)
        model.score(TEXTS[0], dynamic={"rule": "sgd", "lr": 0.01})
        model.generate("the", max_new_tokens=3)
        trace_text(model.lm, model.tokenizer, TEXTS[0])
        static = model.evaluate(progress=False)
        dyn = model.evaluate(progress=False, dynamic={"rule": "sgd", "lr": 0.01})
    assert len(seen) > 20 and set(seen) == {model.device}
    assert static["num_tokens"] == dyn["num_tokens"] > 0
    assert device_of(model.runner) == model.device == model.lm.device


def test_to_moves_and_returns_the_model(pair):
    _, model = pair
    assert model.to("cpu") is model and model.to("auto" if not HAS_CUDA else "cpu").device.type == "cpu"
    with pytest.raises(ZooError):
        model.to("cpu", cuda_graphs="yes")


@NO_CUDA
def test_a_cuda_request_without_cuda_fails_cleanly(pair):
    _, model = pair
    with pytest.raises(DeviceError, match="no CUDA device"):
        zoo.load("default", device="cuda")   # (refused before anything is read)
    with pytest.raises(DeviceError, match="no CUDA device"):
        model.to("cuda:0")
    assert model.device.type == "cpu" and model.score("the cat")[0]["num_tokens"] == 3  # still usable


@NO_CUDA
def test_lm_eval_plugin_honours_the_harness_device():
    from zoo.lm_eval_plugin import ZooLM

    lm = ZooLM.create_from_arg_string("pretrained=default", {"batch_size": 4, "device": "cpu"})
    assert lm.device == torch.device("cpu")
    with pytest.raises(DeviceError, match="'cuda:0': this machine has no CUDA"):
        ZooLM.create_from_arg_string("pretrained=default", {"batch_size": 4, "device": "cuda:0"})


@NO_CUDA
def test_harness_command_refuses_a_missing_gpu_with_exit_2():
    proc = _run(sys.executable, "-m", "zoo.lm_eval_plugin", "--model", "zoo", "--model_args", "pretrained=default",
                "--tasks", "zoo_ptb_test", "--device", "cuda:0", "--limit", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("zoo-lm-eval: error: device 'cuda:0': this machine has no")


# -- command lines ------------------------------------------------------------------------------------------------
def test_cli_info_says_the_device():
    proc = _run(sys.executable, "-m", "zoo.cli", "info", "default", "--json", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["device"] == "cpu"


@NO_CUDA
@pytest.mark.parametrize("argv", [["score", "default", "--text", "the cat", "--device", "cuda"],
                                  ["generate", "default", "--device", "cuda:1"],
                                  ["eval", "default", "--device", "cuda"], ["info", "default", "--device", "cuda"]])
def test_cli_refuses_a_missing_gpu_in_one_line(argv):
    _one_line_error(_run(sys.executable, "-m", "zoo.cli", *argv), "zoo: error: --device", "no CUDA device")


def test_cli_refuses_a_bad_device_in_one_line():
    _one_line_error(_run(sys.executable, "-m", "zoo.cli", "score", "default", "--text", "a", "--device", "tpu"),
                    "--device 'tpu' is not a device")


@NO_CUDA
def test_demo_refuses_a_missing_gpu_in_one_line():
    _one_line_error(_run(sys.executable, "app.py", "--device", "cuda", "--port", "1"), "app.py: error: --device",
                    "no CUDA device")


@NO_CUDA
def test_serve_start_refuses_gpus_it_does_not_have(tmp_path):
    _one_line_error(_run(sys.executable, "-m", "zoo.cli", "serve", "start", "--gpus", "1", "--run-dir",
                         str(tmp_path / "run"), "--no-build"), "--gpus 1", "no CUDA device")
    assert not (tmp_path / "run" / "server.json").exists()


def test_torchserve_gets_the_gpu_count_and_workers_their_gpu():
    sys.path.insert(0, str(REPO / "serving"))
    try:
        from handler import worker_device
    finally:
        sys.path.remove(str(REPO / "serving"))
    from zoo.tools.serve.config import ServerConfig

    text = string.Template((REPO / "serving" / "config.properties").read_text()).safe_substitute(
        asdict(ServerConfig(gpus=2)))
    assert "\nnumber_of_gpu=2\n" in text
    assert "number_of_gpu=0" in string.Template((REPO / "serving" / "config.properties").read_text()
                                                ).safe_substitute(asdict(ServerConfig()))
    assert worker_device(None) == "cpu"
    assert worker_device(1) == ("cuda:1" if HAS_CUDA else "cpu")


# -- the GPU benchmark, end to end in its tiny CPU mode -----------------------------------------------------------
@pytest.mark.slow
def test_gpu_benchmark_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "gi.json"
    # (the Python loops: --quick's speeds mean nothing, and the C++ loops' build folder is shared between processes)
    proc = subprocess.run([sys.executable, "benchmarks/gpu_inference.py", "--device", "cpu", "--quick", "--out",
                           str(out)], capture_output=True, text=True, env=dict(ENV, ZOO_NO_EXTENSIONS="1"), cwd=REPO,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["quick"] and set(data["targets"]) == {"dynamic_eval_10x_cpu", "batch64_scoring_20x_cpu",
                                                              "graph_generation_3x_eager"}
    assert {"pnorm-gru-ptbchar-sent-p1", zoo.catalog.catalog()["default"]} == set(data["equality"])
    assert all(r["ok"] and r["prefix_rel_diff"] == 0.0 for r in data["equality"].values())  # CPU vs CPU: equal
    assert data["dynamic"]["ok"] and data["scoring"]["batch1"]["device_graphs"]["tokens"] > 0
    lstm = data["dynamic_equality"]["lstm-ptb-5m-long-light"]  # (the LSTM baseline's dynamic evaluation: cuDNN's)
    assert lstm["ok"] and lstm["rel_diff"] == 0.0 and lstm["tokens"] == 50
    table = out.with_suffix(".md").read_text()
    assert "| scoring tokens/s, batch 64, fp32 |" in table and "--quick" in table


def test_benchmark_groups_hold_every_bundled_model_once():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_inference
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    names = [n for g in gpu_inference.GROUPS for n in g]
    assert sorted(names) == sorted(zoo.catalog.catalog()["models"]) and len(set(names)) == len(names)
    assert gpu_inference.GROUPS[0][0] == zoo.catalog.catalog()["default"]
    bundled = zoo.catalog.bundled_dir()
    for group in gpu_inference.GROUPS:   # what one device call carries: 64 MiB with the tree (~5 MB) and data
        size = sum((bundled / n / "model.safetensors").stat().st_size for n in group if (bundled / n).is_dir())
        assert size < 52 * 2**20, (group, size)


# -- on a GPU ---------------------------------------------------------------------------------------------------------
@NEEDS_CUDA
def test_cuda_scores_equal_the_cpu_and_graphs_equal_eager(pair):
    _, cpu = pair
    path = cpu.directory
    dev = zoo.load(path, device="cuda")
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert all(p.is_cuda for p in dev.lm.parameters()) and dev.device.type == "cuda"
    for a, b in zip(cpu.score(TEXTS * 3).texts, dev.score(TEXTS * 3).texts, strict=True):
        assert b["nll"] == pytest.approx(a["nll"], rel=1e-5)
    for _ in range(3):   # the second call of a shape captures it, the third replays
        assert cpu.generate_ids("the cat", max_new_tokens=20, temperature=0) == \
            dev.generate_ids("the cat", max_new_tokens=20, temperature=0)
    assert dev.runner.captures > 0 and not dev.runner.failures
    eager = zoo.load(path, device="cuda").to("cuda", cuda_graphs=False)
    assert eager.runner is eager.lm
    long = " ".join(WORDS[2:] * 40)
    for _ in range(3):   # replayed: the same kernels
        assert eager.score(long).texts[0]["nll"] == pytest.approx(dev.score(long).texts[0]["nll"], rel=1e-6)


@NEEDS_CUDA
def test_cuda_dynamic_segments_replay_the_eager_numbers(pair):
    from zoo.dynamic import DynamicParams, dynamic_logprobs

    dev = zoo.load(pair[1].directory, device="cuda")
    seq = torch.randint(2, len(WORDS), (401,), generator=torch.Generator().manual_seed(0))
    p = DynamicParams(segment=20, lr=0.01, decay=0.001, rule="sgd")
    eager = dynamic_logprobs(dev.lm, seq[:-1], seq[1:], p, cuda_graphs=False)
    torch.testing.assert_close(dynamic_logprobs(dev.lm, seq[:-1], seq[1:], p), eager, rtol=1e-6, atol=1e-7)
    cpu = dynamic_logprobs(pair[1].lm, seq[:-1], seq[1:], p)
    assert float(eager.sum()) == pytest.approx(float(cpu.sum()), rel=1e-4)


@NEEDS_CUDA
@pytest.mark.parametrize("variant", ["lstm", "alstm", "hyperlstm", "pnorm_gru"])
def test_cuda_dynamic_evaluation_of_every_architecture(variant):
    """Dynamic evaluation (its gradient statistics too) on CUDA, CUDA graphs and eager, equals the CPU's (1e-4, the
    GPU benchmark's dynamic tolerance): the LSTM baseline's cuDNN kernel runs in training mode (dropout 0) whenever
    autograd records, or its backward is refused (issue 51)."""
    from tests.conftest import tiny_lm
    from zoo.dynamic import DynamicParams, dynamic_logprobs, gradient_stats

    cpu = tiny_lm(variant, init_range=1.0).eval()
    dev = tiny_lm(variant, init_range=1.0).eval().cuda()
    train = torch.randint(2, len(WORDS), (600,), generator=torch.Generator().manual_seed(9))
    p = DynamicParams(segment=20, lr=1e-3, stats_tokens=400, stats_batch=4, stats_bptt=9)
    stats, dev_stats = gradient_stats(cpu, train, p), gradient_stats(dev, train, p)
    for a, b in zip(stats.rms, dev_stats.rms, strict=True):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-7)
    seq = torch.randint(2, len(WORDS), (201,), generator=torch.Generator().manual_seed(0))
    want = float(dynamic_logprobs(cpu, seq[:-1], seq[1:], p, stats=stats).sum())
    for graphs in (True, False):
        got = dynamic_logprobs(dev, seq[:-1], seq[1:], p, stats=dev_stats, cuda_graphs=graphs)
        assert float(got.sum()) == pytest.approx(want, rel=1e-4), graphs


@NEEDS_CUDA
def test_cuda_dynamic_evaluation_and_bf16_batched_scoring(pair):
    _, cpu = pair
    dev = zoo.load(cpu.directory, device="cuda")
    text = " ".join(WORDS[2:] * 20)
    dyn = {"rule": "sgd", "lr": 0.01}
    assert dev.score(text, dynamic=dyn)[0]["nll"] == pytest.approx(cpu.score(text, dynamic=dyn)[0]["nll"], rel=1e-4)
    bf16 = zoo.load(cpu.directory, device="cuda", precision="bf16")
    assert bf16.score(TEXTS, batch_size=2)[0]["nll"] == pytest.approx(cpu.score(TEXTS)[0]["nll"], rel=5e-2)


@NEEDS_CUDA
def test_lm_eval_plugin_runs_on_cuda():
    from zoo.lm_eval_plugin import ZooLM

    lm = ZooLM.create_from_arg_string("pretrained=default", {"batch_size": 4, "device": "cuda:0"})
    assert lm.device.type == "cuda" and lm.model.device.type == "cuda"
    assert Path(lm.model.directory).is_dir()
