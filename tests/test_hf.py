"""The Hugging Face door (zoo/hf/): zoo checkpoints through the real transformers' Auto classes, generate, pipeline
and lm-eval's own ``hf`` model give the zoo's numbers and tokens."""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, pipeline  # noqa: E402

import zoo  # noqa: E402
import zoo.hf  # noqa: E402,F401 (registers the zoo with transformers)
from tests.conftest import real_data, tiny_lm, tiny_tokenizer  # noqa: E402
from zoo.catalog import bundled_dir  # noqa: E402
from zoo.checkpoint import save_checkpoint  # noqa: E402
from zoo.errors import CheckpointError  # noqa: E402
from zoo.hf import AlstmZooCache, AlstmZooConfig, AlstmZooForCausalLM, AlstmZooTokenizer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
BUNDLED = sorted(p.name for p in bundled_dir().iterdir() if (p / "config.json").is_file())
TEXT = "The Dow rose 3.5% on Monday, Mr. Smith's fund didn't.\nIt was the best week since 1987 for the U.S. market."

pytestmark = pytest.mark.usefixtures("one_thread")


def _zoo_ids(model: zoo.ZooModel, text: str) -> list[int]:
    """What the zoo scores for ``text``: its ids, after the one ``<eos>`` its first token is conditioned on."""
    return [model.tokenizer.eos_id, *model.tokenizer.encode(text).ids]


def spread_lm(variant: str, seed: int = 3):
    """A tiny model whose weights are drawn wide (N(0, 0.5)): untrained tiny models have logits of order 1e-9, whose
    ties float rounding breaks either way, and a greedy comparison needs a clear winner at each step."""
    lm = tiny_lm(variant, seed=seed).eval()
    with torch.no_grad():
        for p in lm.parameters():
            p.normal_(0.0, 0.5)
    return lm


@pytest.fixture
def tiny_dir(tmp_path, variant) -> Path:
    lm = spread_lm(variant)
    return save_checkpoint(tmp_path / variant, lm, tiny_tokenizer(), {"name": f"tiny-{variant}", "dataset": "ptb"})


# -- every registered architecture ---------------------------------------------------------------------------------
def test_every_architecture_through_the_auto_classes(tiny_dir):
    """A checkpoint the zoo saves names its transformers classes; the Auto classes load it strictly, and its logits,
    loss, greedy tokens and beam scores are the zoo's."""
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "alstm_zoo" and config["architectures"] == ["AlstmZooForCausalLM"]
    assert type(AutoConfig.from_pretrained(tiny_dir)) is AlstmZooConfig
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert type(model) is AlstmZooForCausalLM and type(tok) is AlstmZooTokenizer and model.dtype == torch.float32
    ref = zoo.load(tiny_dir)
    text = "the cat sat on the mat\na dog ran"
    ids = tok("<eos>" + text + "\n", return_tensors="pt").input_ids
    assert ids[0].tolist() == _zoo_ids(ref, text)
    with torch.no_grad():
        out = model(ids, labels=ids)
    assert out.loss.item() == pytest.approx(ref.score(text)[0]["avg_nll"], rel=1e-6)
    assert isinstance(out.cache, AlstmZooCache) and out.cache.get_seq_length() == ids.shape[1]

    prompt = tok("<eos>the cat", return_tensors="pt").input_ids
    greedy = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert greedy[0, prompt.shape[1]:].tolist() == ref.generate_ids("the cat", max_new_tokens=12, temperature=0)

    # beam search reorders the cache: each returned beam's score is the zoo's log-probability of its tokens
    beams = model.generate(prompt, max_new_tokens=6, num_beams=4,
                           num_return_sequences=4, do_sample=False,
                           eos_token_id=None, length_penalty=0.0, output_scores=True, return_dict_in_generate=True)
    for seq, score in zip(beams.sequences, beams.sequences_scores, strict=True):
        full = seq.tolist()
        with torch.no_grad():
            logits = ref.lm(torch.tensor([full[:-1]]))[0].log_softmax(-1)[0]
        logp = sum(float(logits[t - 1, full[t]]) for t in range(prompt.shape[1], len(full)))
        assert float(score) == pytest.approx(logp, abs=1e-4)


def test_left_padded_batch_generates_as_each_row_alone(tmp_path):
    lm = spread_lm("alstm", seed=5)
    folder = save_checkpoint(tmp_path / "m", lm, tiny_tokenizer(), {"name": "m"})
    model, tok = AlstmZooForCausalLM.from_pretrained(folder), AlstmZooTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    prompts = ["<eos>the cat sat on", "<eos>a dog"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert batch.attention_mask[1, 0] == 0
    together = model.generate(**batch, max_new_tokens=8, do_sample=False, eos_token_id=None)
    for row, prompt in enumerate(prompts):
        alone = model.generate(tok(prompt, return_tensors="pt").input_ids, max_new_tokens=8, do_sample=False,
                               eos_token_id=None)
        assert together[row, -8:].tolist() == alone[0, -8:].tolist()


def test_sampling_with_a_seed_is_reproducible(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    prompt = torch.tensor([[0, 2, 3]])

    def sample(seed: int) -> list[int]:
        torch.manual_seed(seed)
        return model.generate(prompt, max_new_tokens=20, do_sample=True, top_k=0, eos_token_id=None)[0].tolist()

    assert sample(0) == sample(0)
    assert sample(0) != sample(1)


def test_save_pretrained_round_trips_to_a_checkpoint_the_zoo_loads(tiny_checkpoint, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    model.save_pretrained(tmp_path / "again")
    back = zoo.load(tmp_path / "again")
    assert back.config["model_type"] == "alstm_zoo" and back.config["name"] == "tiny-alstm"
    for key, value in model.lm.state_dict().items():
        assert torch.equal(back.lm.state_dict()[key], value), key
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    text = "the cat sat"
    assert again.zoo.score(text)[0]["nll"] == zoo.load(tiny_checkpoint).score(text)[0]["nll"]


def test_old_checkpoints_without_model_type_load(tmp_path):
    """Written before transformers' keys (and before tokenizer.json): recognised, the tokenizer made in memory."""
    folder = FIXTURES / "old-checkpoint"
    assert "model_type" not in json.loads((folder / "config.json").read_text())
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    ref = zoo.load(folder)
    text = "the cat sat on the mat"
    ids = tok("<eos>" + text + "\n", return_tensors="pt").input_ids
    assert ids[0].tolist() == _zoo_ids(ref, text)
    assert model(ids, labels=ids).loss.item() == pytest.approx(ref.score(text)[0]["avg_nll"], rel=1e-6)


# -- refusals: the zoo's one-line errors ---------------------------------------------------------------------------
def _refused(folder: Path, match: str) -> None:
    for load in (AutoModelForCausalLM.from_pretrained, AlstmZooForCausalLM.from_pretrained):
        with pytest.raises(CheckpointError, match=match) as err:
            load(folder)
        assert "\n" not in str(err.value)


def test_corrupted_and_mismatched_checkpoints_are_refused(tiny_checkpoint, tmp_path):
    broken = Path(shutil.copytree(tiny_checkpoint, tmp_path / "broken"))
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    _refused(broken, "corrupt or truncated safetensors")

    other = Path(shutil.copytree(tiny_checkpoint, tmp_path / "other"))
    config = json.loads((other / "config.json").read_text())
    config["model_args"]["arch_args"]["hidden_size"] = 16
    (other / "config.json").write_text(json.dumps(config))
    _refused(other, "has shape")


def test_a_catalogue_name_keeps_its_sha256_pins():
    model = AlstmZooForCausalLM.from_pretrained("alstm-ptb-5m")
    assert model.zoo.source == "bundled" and model.zoo.pinned


# -- the bundled models ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BUNDLED)
def test_every_bundled_model_loads_with_the_zoos_tokens_and_loss(name):
    folder = bundled_dir() / name
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    ref = zoo.load(folder)
    text = TEXT if not ref.tokenizer.is_char else TEXT[:60]
    ids = tok("<eos>" + text + "\n", return_tensors="pt").input_ids
    assert ids[0].tolist() == _zoo_ids(ref, text)
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss == pytest.approx(ref.score(text)[0]["avg_nll"], rel=1e-6)
    # decoding is the zoo's (<eos> a line break): the zoo's text of the zoo's tokens
    assert tok.decode(ids[0, 1:]) == ref.tokenizer.decode(ref.tokenizer.encode(text).ids)


@pytest.mark.parametrize("name", ["alstm-ptb-5m", "hyperlstm-ptbchar-1.5m-long"])
def test_generate_and_pipeline_give_zoo_generates_tokens(name):
    folder = bundled_dir() / name
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    ref = zoo.load(folder)
    prompt = "the stock market"
    ids = tok("<eos>" + prompt, return_tensors="pt").input_ids
    got = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)[0, ids.shape[1]:].tolist()
    assert got == ref.generate_ids(prompt, max_new_tokens=40, temperature=0)
    # by default generation stops at <eos> (a line end), as the zoo's stop_at_eos
    stop = model.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1]:].tolist()
    want = ref.generate_ids(prompt, max_new_tokens=40, temperature=0, stop_at_eos=True)
    assert stop == want + ([tok.eos_token_id] if len(want) < 40 else [])

    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    text = pipe("<eos>" + prompt, max_new_tokens=40, do_sample=False)[0]["generated_text"]
    continuation = ref.generate(prompt, max_new_tokens=40, temperature=0, stop_at_eos=True)
    gap = "" if ref.tokenizer.is_char else " "  # (words joined as zoo generate joins them)
    assert text == "<eos>" + prompt + gap + continuation
    by_path = pipeline("text-generation", model=str(folder))
    assert by_path("<eos>" + prompt, max_new_tokens=40, do_sample=False)[0]["generated_text"] == text


def test_every_checkpoint_carries_the_special_tokens_transformers_needs(tiny_checkpoint, tmp_path):
    """transformers without the zoo's classes (lm-eval's ``local-completions`` with ``tokenizer=<checkpoint folder>``)
    reads ``tokenizer.json`` + ``tokenizer_config.json``: ``<eos>`` is BOS, EOS and padding, nothing is added unless
    asked, ``add_special_tokens`` ends a text with ``<eos>``. Bundled folders carry the file (pinned, derived from the
    vocabulary alone), ``save_checkpoint`` writes it, and a release published without it gets the pinned bytes
    written where it is verified."""
    from transformers import PreTrainedTokenizerFast

    from zoo.catalog import catalog, release
    from zoo.checkpoint import TOKENIZER_CONFIG_FILE, tokenizer_config_text
    from zoo.hub import verify_files

    for name in BUNDLED:
        folder = bundled_dir() / name
        ref = zoo.load(folder)
        assert (folder / TOKENIZER_CONFIG_FILE).read_text() == tokenizer_config_text(ref.tokenizer)
        assert TOKENIZER_CONFIG_FILE in catalog()["models"][name]["files"]
        tok = PreTrainedTokenizerFast.from_pretrained(folder)  # (the file as it is: no zoo code)
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (ref.tokenizer.eos_id,) * 3
        enc = ref.tokenizer.encode("the stock market fell")  # (tokenizer.json reads the corpus's spaced symbols)
        line = " ".join(enc.tokens[:-1]) + "\n"
        assert tok(line, add_special_tokens=False).input_ids == enc.ids[:-1]
        assert tok(line).input_ids == enc.ids  # (a document's last <eos>: lm-eval's add_bos_token=True)
    assert (tiny_checkpoint / TOKENIZER_CONFIG_FILE).is_file()
    published = tmp_path / "v1.0"  # a Hub snapshot of a release made before the file existed
    shutil.copytree(bundled_dir() / "alstm-ptb-5m", published)
    (published / TOKENIZER_CONFIG_FILE).unlink()
    verify_files(published, release("alstm-ptb-5m"), "a snapshot")
    assert (published / TOKENIZER_CONFIG_FILE).read_bytes() == (bundled_dir() / "alstm-ptb-5m" /
                                                                TOKENIZER_CONFIG_FILE).read_bytes()


def test_line_task_documents_tokenize_to_what_the_task_counts(tmp_path):
    """The harness's line tasks through this door: transformers' tokenizer adds a text's last ``<eos>`` only for a
    final line break, so each line document carries its own (``corpus_documents``); the ids are the zoo's, and as
    many as ``word_perplexity`` divides by (without the line end the ``hf`` model scored one token less per line:
    69.348 against the zoo's 75.082 on PTB's test lines)."""
    pytest.importorskip("lm_eval")
    from tests.conftest import synthetic_corpus
    from zoo.lm_eval_plugin import corpus_documents, corpus_token_count

    folder = bundled_dir() / "alstm-ptb-5m-light"
    tok, ref = AutoTokenizer.from_pretrained(folder), zoo.load(folder)
    data = synthetic_corpus(tmp_path, {"train": 4, "valid": 4, "test": 30})
    docs = corpus_documents("ptb", "test", "line", zoo_data_dir=str(data))["test"]["text"]
    assert len(docs) == 30
    for doc in docs:
        ids = tok(doc).input_ids
        assert ids == ref.tokenizer.encode(doc).ids and ids[-1] == tok.eos_token_id
        assert len(ids) == corpus_token_count(doc)


def test_stop_strings_stop_where_the_text_holds_them():
    """``generate(stop_strings=...)`` (transformers' own criteria failed: "substring not found"): a row stops at the
    token that completes a stop string of the text as the zoo prints it, across words too; with or without
    ``tokenizer=``; in the pipeline as well."""
    folder = bundled_dir() / "alstm-ptb-5m"
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    ids = tok("<eos>the stock market", return_tensors="pt").input_ids
    full = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, ids.shape[1]:].tolist()
    words = tok.decode(full).split()
    assert len(words) >= 4
    for stop in (words[2], f"{words[1]} {words[2]}", words[2][:-1] or words[2]):
        for kwargs in ({"tokenizer": tok}, {}):
            got = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, stop_strings=[stop],
                                 **kwargs)[0, ids.shape[1]:].tolist()
            assert got == full[:3], (stop, kwargs)
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    text = pipe("<eos>the stock market", max_new_tokens=12, do_sample=False, stop_strings=[words[2]], tokenizer=tok)
    assert text[0]["generated_text"].endswith(" " + " ".join(words[:3]))


def test_devices_follow_the_zoos_rules(tiny_checkpoint):
    """``device_map`` and ``.to``/``.cuda`` go through :meth:`zoo.ZooModel.to`: the zoo's one-line
    ``DeviceError`` for a device the machine lacks (torch's AssertionError before), ``"auto"`` CUDA when there is
    one, ``model.zoo.device`` where the model runs, and a dtype still casts."""
    from zoo.errors import DeviceError

    auto = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, device_map="auto")
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert auto.device.type == want and auto.zoo.device.type == want
    if not torch.cuda.is_available():
        for device_map in ("cuda", "cuda:0", 0):
            with pytest.raises(DeviceError, match="no CUDA device torch can use"):
                AutoModelForCausalLM.from_pretrained(tiny_checkpoint, device_map=device_map)
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
        for move in (lambda: model.to("cuda"), lambda: model.to(torch.device("cuda", 0)), model.cuda,
                     lambda: pipeline("text-generation", model=model, tokenizer=AutoTokenizer.from_pretrained(
                         tiny_checkpoint), device="cuda")):
            with pytest.raises(DeviceError, match="no CUDA device"):
                move()
        assert model.device.type == "cpu" and model.zoo.device.type == "cpu"
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).to("cpu", torch.float64)
    assert model.dtype == torch.float64 and model.zoo.device.type == "cpu"


def test_auto_classes_take_a_folder_and_the_zoo_classes_a_catalogue_name():
    """What the guide says they take: the Auto classes a checkpoint folder (``zoo.load(NAME).directory``, or
    ``zoo info NAME --directory``), the zoo's classes a catalogue name (resolved with its pins)."""
    name = "alstm-ptb-5m"
    folder = zoo.load(name).directory
    assert AutoModelForCausalLM.from_pretrained(folder).zoo.pinned is False  # (a folder is loaded as it is)
    by_name = AlstmZooTokenizer.from_pretrained(name)
    assert by_name("<eos>the market").input_ids == AutoTokenizer.from_pretrained(folder)("<eos>the market").input_ids
    with pytest.raises(OSError):  # transformers' own answer: no such repo or folder (HF_HUB_OFFLINE in the suite)
        AutoConfig.from_pretrained(name, local_files_only=True)


# -- packaging -------------------------------------------------------------------------------------------------------
def _env(**extra: str) -> dict[str, str]:
    """The suite's environment with this checkout first (and its lm_eval start-up hook before the venv's copy)."""
    paths = [str(REPO / "zoo" / "tools" / "lm_eval_hook"), str(REPO), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(p for p in paths if p), **extra)


def test_import_zoo_does_not_import_transformers():
    code = "import sys, zoo; print(sorted(m for m in ('transformers', 'tokenizers', 'zoo.hf') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr[-2000:]


@pytest.mark.slow
def test_stock_lm_eval_hf_model_reproduces_the_zoos_word_perplexity(tmp_path):
    """The harness's own ``lm_eval --model hf`` on the zoo's PTB tasks (a 12-line test split: about 300 tokens) finds
    the zoo's classes through the start-up hook and gives the zoo's word perplexity of that text, whole and one
    document per line."""
    name = "alstm-ptb-5m-light"
    data = tmp_path / "data"
    (data / "ptb").mkdir(parents=True)
    real = real_data("ptb")  # the bundled model's vocabulary is the real corpus's
    for split in ("train", "valid"):
        (data / "ptb" / f"{split}.txt").symlink_to(real / f"{split}.txt")
    lines = (real / "test.txt").read_text(encoding="utf-8").splitlines(keepends=True)[:12]
    (data / "ptb" / "test.txt").write_text("".join(lines), encoding="utf-8")
    tasks_dir = subprocess.run([sys.executable, "-m", "zoo.lm_eval_plugin", "--tasks-dir"], capture_output=True,
                               text=True, env=_env(), timeout=300, check=True).stdout.strip()
    cmd = [str(Path(sys.executable).parent / "lm_eval"), "--model", "hf", "--model_args",
           f"pretrained={bundled_dir() / name}", "--tasks", "zoo_ptb_test,zoo_ptb_test_lines",
           "--include_path", tasks_dir,
           "--device", "cpu", "--batch_size", "1", "--metadata", json.dumps({"zoo_data_dir": str(data)}),
           "--output_path", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True))
    results = json.loads(Path(files[-1]).read_text())["results"]
    got = results["zoo_ptb_test"]["word_perplexity,none"]
    model = zoo.load(name)
    whole = model.score("".join(lines)).corpus
    print(f"lm_eval --model hf word_perplexity {got!r}; zoo {whole['ppl']!r} over {whole['num_tokens']} tokens")
    assert whole["num_tokens"] < 400
    assert got == pytest.approx(whole["ppl"], rel=1e-5)
    assert math.isfinite(got)
    per_line = model.score([line for line in lines if line.strip()]).corpus["ppl"]
    assert results["zoo_ptb_test_lines"]["word_perplexity,none"] == pytest.approx(per_line, rel=1e-5)
