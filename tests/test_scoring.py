"""Scoring is exact, stateful, batch-invariant and chunk-invariant; corpus eval is standard perplexity."""

from __future__ import annotations

import math

import pytest
import torch

import zoo.scoring as scoring
from tests.conftest import tiny_lm, tiny_tokenizer
from zoo.zoo_model import ZooModel

TEXTS = ["The cat sat on the mat.", "a dog ran\nthe cat sat", "Mr. Smith's dog didn't run $ 5", "zebra"]


@pytest.fixture(scope="module", params=["alstm", "hyperlstm", "pnorm_gru-p2", "lstm"])
def model(request) -> ZooModel:
    return ZooModel(tiny_lm(request.param), tiny_tokenizer(), {"name": "tiny"})


def test_fields_and_definitions(model):
    r = model.score(TEXTS[0], return_tokens=True)[0]
    for key in ("num_tokens", "nll", "avg_nll", "ppl", "bits_per_token", "bits_per_input_char", "oov", "num_unk",
                "num_dropped", "num_visible_chars", "warnings", "tokens"):
        assert key in r
    assert r["num_tokens"] == len(r["tokens"]) == 7  # the cat sat on the mat <eos>
    assert r["nll"] == pytest.approx(-sum(t["logprob"] for t in r["tokens"]), rel=1e-9)
    assert r["avg_nll"] == pytest.approx(r["nll"] / r["num_tokens"])
    assert r["ppl"] == pytest.approx(math.exp(r["avg_nll"]))
    assert r["bits_per_token"] == pytest.approx(r["avg_nll"] / math.log(2))
    assert r["bits_per_input_char"] == pytest.approx(r["nll"] / math.log(2) / len(TEXTS[0]))


def test_first_token_is_conditioned_on_eos(model):
    """The first token's log-probability is the model's next-token distribution after one <eos>."""
    r = model.score("the cat", return_tokens=True)[0]
    with torch.no_grad():
        logits, _ = model.lm(torch.tensor([[model.tokenizer.eos_id]]))
    want = torch.log_softmax(logits[0, -1], -1)[model.tokenizer.index["the"]].item()
    assert r["tokens"][0]["logprob"] == pytest.approx(want, abs=1e-5)


def test_batched_equals_one_at_a_time(model):
    batched = model.score(TEXTS, batch_size=8)
    for text, res in zip(TEXTS, batched.texts, strict=True):
        single = model.score(text)[0]
        assert res["nll"] == pytest.approx(single["nll"], rel=1e-5)
        assert res["num_tokens"] == single["num_tokens"]
    c = batched.corpus
    assert c["num_tokens"] == sum(r["num_tokens"] for r in batched.texts)
    assert c["ppl"] == pytest.approx(math.exp(sum(r["nll"] for r in batched.texts) / c["num_tokens"]))


def test_chunked_long_text_equals_one_pass(model, monkeypatch):
    text = " ".join(["the cat sat on the mat"] * 40)
    whole = model.score(text)[0]["nll"]
    monkeypatch.setattr(scoring, "LOGIT_BUDGET", 3 * len(model.tokenizer))  # 3 tokens per chunk
    assert model.score(text)[0]["nll"] == pytest.approx(whole, rel=1e-6)


def test_unk_is_reported(model):
    r = model.score("zebra giraffe the cat")[0]
    assert r["oov"] == 2 and r["num_unk"] == 2 and set(r["oov_items"]) == {"zebra", "giraffe"}


def test_corpus_eval_equals_independent_mean_nll(model):
    """evaluate_stream == exp(mean NLL) computed in one pass per column, without chunking."""
    torch.manual_seed(3)
    stream = torch.randint(0, len(model.tokenizer), (523,))
    res = scoring.evaluate_stream(model.runner, stream, batch_size=4, bptt=7, progress=False)
    cols = stream[: (523 // 4) * 4].view(4, -1)
    with torch.no_grad():
        logits, _ = model.lm(cols[:, :-1])
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), cols[:, 1:].reshape(-1))
    assert res["num_tokens"] == cols[:, 1:].numel()
    assert res["ppl"] == pytest.approx(math.exp(nll.item()), rel=1e-5)


def test_corpus_eval_runs_a_huge_bptt_in_pieces_with_the_same_numbers(model, monkeypatch):
    """Given the vocabulary size, a bptt chunk whose logits would pass the budget runs in pieces (the state is
    carried): the same perplexity, and no forward call sees more rows than the budget allows."""
    torch.manual_seed(3)
    stream = torch.randint(0, len(model.tokenizer), (523,))
    whole = scoring.evaluate_stream(model.runner, stream, batch_size=4, bptt=10**9, progress=False)
    monkeypatch.setattr(scoring, "LOGIT_BUDGET", len(model.tokenizer) * 4 * 5 // 4)  # 5 rows of 4 columns
    seen = []

    class Counting:
        def init_state(self, b):
            return model.runner.init_state(b)

        def forward(self, x, state):
            seen.append(x.shape[1])
            return model.runner.forward(x, state)

    cut = scoring.evaluate_stream(Counting(), stream, batch_size=4, bptt=10**9, progress=False,
                                  vocab_size=len(model.tokenizer))
    assert max(seen) == 5 and sum(seen) == 523 // 4 - 1
    assert cut["num_tokens"] == whole["num_tokens"] and cut["ppl"] == pytest.approx(whole["ppl"], rel=1e-6)


def test_a_perplexity_past_float_range_is_infinite_not_an_error():
    assert scoring.summarize(800.0, 1, 0)["ppl"] == math.inf
    assert scoring.summarize(708.0, 1, 0)["ppl"] == pytest.approx(math.exp(708.0))
    assert math.isnan(scoring.summarize(math.nan, 1, 0)["ppl"])


def test_rejects_bad_types(model):
    from zoo.errors import ConfigError, WrongType

    with pytest.raises(TypeError):
        model.score(42)  # type: ignore[arg-type]
    for bad, error in ((0, ConfigError), (-3, ConfigError), (2.5, WrongType), (True, WrongType)):
        with pytest.raises(error, match="batch_size must be"):
            model.score("the cat", batch_size=bad)
        with pytest.raises(error, match="batch_size must be"):
            model.evaluate("ptb", "valid", batch_size=bad)
    with pytest.raises(ConfigError, match="bptt must be a positive integer, got 0"):
        model.evaluate("ptb", "valid", bptt=0)
    with pytest.raises(ConfigError, match="texts is an empty list"):
        model.score([])
    with pytest.raises(WrongType, match="return_tokens must be a bool"):
        model.score("the cat", return_tokens="yes")  # type: ignore[arg-type]


def test_load_refuses_what_is_not_a_name_or_path():
    """zoo.load(None) was os.fspath's TypeError and an unknown keyword named an internal function (resolve())."""
    import zoo
    from zoo.errors import WrongType

    for bad in (None, 42, ["default"]):
        with pytest.raises(WrongType, match="name_or_path must be a catalogue name, a folder path or hf-hub:"):
            zoo.load(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^load\(\) got an unexpected keyword argument 'foo'"):
        zoo.load("default", foo=1)  # type: ignore[call-arg]


def test_warnings_flag_text_the_model_does_not_know(tiny_checkpoint):
    """A score result carries a warnings list; a text that is mostly <unk> says its perplexity means little."""
    from zoo.scoring import UNK_SHARE_WARNING
    from zoo.zoo_model import ZooModel

    model = ZooModel.from_pretrained(tiny_checkpoint)
    report = model.score(["the cat sat on the mat", "die katze sitzt auf der matte", "the cat"])
    assert report[0]["warnings"] == [] and report[2]["warnings"] == []
    (warning,) = report[1]["warnings"]
    assert "6 of 7 tokens (86%) are <unk>" in warning and f"{UNK_SHARE_WARNING:.0%}" in warning
    share = report.corpus["num_unk"] / report.corpus["num_tokens"]
    assert (report.corpus["warnings"] != []) == (share > UNK_SHARE_WARNING)
    assert "warnings" in report.to_dict()["texts"][1]


def test_a_character_model_warns_when_its_alphabet_does_not_cover_the_text():
    """A character model spells an unknown character as the five symbols of <unk>, so the unknown share is taken
    of the input's characters: 10 unknown of 12 warns (taken of the 51 scored symbols, no share could ever pass a
    fifth, and the warning never fired)."""
    import zoo

    model = zoo.load("pnorm-gru-ptbchar-sent-p1")
    res = model.score("éééééééééé ab")[0]
    assert res["num_unk"] == 10 and res["num_tokens"] > 50
    (warning,) = res["warnings"]
    assert "10 of 12 characters (83%) are outside the model's alphabet" in warning
    assert model.score("the cat sat on the mat")[0]["warnings"] == []


def test_evaluating_on_another_corpus_names_the_one_the_model_was_trained_on():
    """`zoo eval CHAR_MODEL --dataset ptb` said only that the vocabularies differ."""
    import zoo
    from zoo.data import resolve_data_dir
    from zoo.errors import ConfigError

    if not (resolve_data_dir() / "ptb" / "train.txt").is_file():
        pytest.skip("needs the PTB data")
    model = zoo.load("pnorm-gru-ptbchar-sent-p1")
    with pytest.raises(ConfigError, match=r"\(50 symbols\) is not the ptb vocabulary \(10,000\): it was trained on "
                                          r"ptb-char \(leave the dataset out"):
        model.evaluate("ptb", "valid")
    # options that do not apply are refused, not ignored (the result looked like the options had been used)
    with pytest.raises(ConfigError, match="bptt does not apply to a sentence-level model: each sentence .at most 100"):
        model.evaluate(split="valid", bptt=5)
    with pytest.raises(ConfigError, match="dynamic evaluation scores one stream; this model was trained on single"):
        model.evaluate(split="valid", batch_size=4, dynamic=True)
    stream = zoo.load("lstm-ptb-zaremba-small")
    with pytest.raises(ConfigError, match="batch_size and bptt do not apply to dynamic evaluation"):
        stream.evaluate(split="valid", batch_size=4, dynamic=True)


def test_an_empty_text_is_one_line_end(model):
    """As the module docstring says: "" scores a single <eos> (the CLI and the servers refuse empty input)."""
    r = model.score("", return_tokens=True)[0]
    assert r["num_tokens"] == 1 and r["tokens"][0]["token"] == "<eos>"
    with torch.no_grad():
        logits, _ = model.lm(torch.tensor([[model.tokenizer.eos_id]]))
    assert r["nll"] == pytest.approx(-torch.log_softmax(logits[0, -1], -1)[model.tokenizer.eos_id].item(), abs=1e-5)
    assert r["num_visible_chars"] == 0


def test_every_evaluation_gives_the_same_numbers_through_the_logits(model, monkeypatch):
    """The eager model's fused target log-probabilities (zoo.lm.LanguageModel.target_logprobs) and a runner that
    only returns logits agree on a stream, on padded sentences and on per-token scores."""
    monkeypatch.setattr("zoo.lm.EVAL_BLOCK", 4)  # the tiny vocabulary in blocks, as a word vocabulary is
    monkeypatch.setattr("zoo.lm.EVAL_MIN_LOGITS", 0)

    class LogitsOnly:
        def init_state(self, b):
            return model.lm.init_state(b)

        def forward(self, x, state):
            return model.lm(x, state)

    torch.manual_seed(5)
    stream = torch.randint(0, len(model.tokenizer), (301,))
    a = scoring.evaluate_stream(model.lm, stream, batch_size=3, bptt=11, progress=False)
    b = scoring.evaluate_stream(LogitsOnly(), stream, batch_size=3, bptt=11, progress=False)
    assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-6) and a["num_tokens"] == b["num_tokens"]
    seqs = [torch.randint(0, len(model.tokenizer), (n,)) for n in (2, 9, 5, 14)]
    a = scoring.evaluate_sentences(model.lm, seqs, batch_size=3, progress=False)
    b = scoring.evaluate_sentences(LogitsOnly(), seqs, batch_size=3, progress=False)
    assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-6) and a["num_tokens"] == b["num_tokens"]
    ids = [s.tolist() for s in seqs]
    for x, y in zip(scoring.token_logprobs(model.lm, ids, 0, len(model.tokenizer)),
                    scoring.token_logprobs(LogitsOnly(), ids, 0, len(model.tokenizer)), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
