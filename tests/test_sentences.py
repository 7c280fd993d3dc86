"""Sentence-level training and scoring (``mode = "sentences"``): every line an independent sequence.

Checked on the real PTB format (the first lines of each split) with tiny models: the sequences are the lines
(truncated, ``<eos>``-framed, empty lines out, a fixed sample), padding never contributes to the loss or the
evaluation count, each sequence starts from a zero state, and a killed run resumes to the same weights.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_train import kill_resume_and_compare, tiny_data, write_recipe  # noqa: F401  (a fixture)
from zoo.data import PAD_TARGET, pad_batch, sentences
from zoo.scoring import evaluate_sentences
from zoo.training import Recipe, Trainer

SENTENCE_MODE = 'mode = "sentences"\nmax_len = 30\ntrain_sentences = 120'


def test_sentences_are_lines_truncated_and_framed():
    eos = 0
    stream = torch.tensor([5, 6, 0, 0, 7, 8, 9, 10, 0, 11, 0])   # lines: [5 6], [], [7 8 9 10], [11]
    seqs = sentences(stream, eos, max_len=3)
    assert [s.tolist() for s in seqs] == [[0, 5, 6, 0], [0, 7, 8, 9], [0, 11, 0]]   # [7 8 9 10] truncated: no <eos>
    sample = sentences(stream, eos, max_len=3, limit=2)
    assert len(sample) == 2 and [s.tolist() for s in sample] == [s.tolist() for s in sentences(stream, eos, 3, 2)]
    assert all(s.tolist() in [t.tolist() for t in seqs] for s in sample)  # a sample of the lines, fixed by the seed
    with pytest.raises(ValueError, match="max_len"):
        sentences(stream, eos, max_len=0)


def test_padding_never_counts():
    from tests.conftest import tiny_lm

    lm = tiny_lm("pnorm_gru").eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.cat([torch.tensor([0]), torch.randint(2, 15, (n,), generator=g), torch.tensor([0])])
            for n in (3, 9, 1, 6, 12)]
    x, y = pad_batch(seqs, pad_id=0)
    assert int((y != PAD_TARGET).sum()) == sum(s.numel() - 1 for s in seqs)
    batched = evaluate_sentences(lm, seqs, batch_size=5, progress=False)
    alone = [evaluate_sentences(lm, [s], batch_size=1, progress=False) for s in seqs]
    assert batched["num_tokens"] == sum(a["num_tokens"] for a in alone) == sum(s.numel() - 1 for s in seqs)
    assert batched["nll"] == pytest.approx(sum(a["nll"] for a in alone), rel=1e-5)
    # what the padding holds changes nothing: other pad ids give the same numbers
    other = evaluate_sentences(lm, seqs, batch_size=5, pad_id=7, progress=False)
    assert other["nll"] == pytest.approx(batched["nll"], rel=1e-6)
    # nor does the batching: in batches of 2 (three batches, the state reset for each) the same numbers
    split = evaluate_sentences(lm, seqs, batch_size=2, progress=False)
    assert split["num_tokens"] == batched["num_tokens"] and split["nll"] == pytest.approx(batched["nll"], rel=1e-5)


def test_every_training_batch_starts_from_a_zero_state(tmp_path, tiny_data):  # noqa: F811
    """The training loop itself resets the state before each batch of sentences: observed on a real epoch (a
    stream run hands each step the state the previous one left)."""
    seen: dict[str, list] = {}
    for mode, extra in (("sentences", SENTENCE_MODE), ("stream", "")):
        recipe = Recipe.load(write_recipe(tmp_path / f"{mode}.toml", arch="lstm", epochs=1, batch_size=8,
                                          extra_train=extra))
        t = Trainer(recipe, tmp_path / mode, data_dir=str(tiny_data), progress=False)
        real_step, seen[mode] = t.train_step, []

        def spy(x, y, seq_len, t=t, real_step=real_step, log=seen[mode]):
            log.append(t.state)
            return real_step(x, y, seq_len)

        t.train_step = spy
        t.run()
    assert len(seen["sentences"]) > 2 and all(s is None for s in seen["sentences"])
    assert seen["stream"][0] is None and all(s is not None for s in seen["stream"][1:])


def test_training_step_masks_padding_and_resets_state(tmp_path, tiny_data):  # noqa: F811
    recipe = Recipe.load(write_recipe(tmp_path / "r.toml", arch="alstm", dropout=0.0, extra_train=SENTENCE_MODE))
    t = Trainer(recipe, tmp_path / "run", data_dir=str(tiny_data), progress=False)
    assert t.sentence_mode and len(t.sentences["train"]) == 120
    assert max(s.numel() for s in t.sentences["train"]) <= 30 + 2
    order = t._sentence_batches()
    x, y, seq_len, nxt = t._next_batch(order)
    assert nxt == 1 and (y == PAD_TARGET).any(), "the first batch should mix lengths"
    # the trainer's loss is the mean NLL over the real targets only
    t.model.eval()
    with torch.no_grad():
        logits, _ = t.model(x)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1])[y.reshape(-1) != PAD_TARGET],
                                                 y.reshape(-1)[y.reshape(-1) != PAD_TARGET])
    t.model.train()
    t.state = None
    loss = t.train_step(x, y, seq_len)
    assert loss == pytest.approx(float(expected), rel=1e-5)
    # each epoch has its own order, the same on every call (a resumed run sees it again)
    t.epoch = 2
    assert t._sentence_batches() != order and t._sentence_batches() == t._sentence_batches()


def test_sentence_run_end_to_end_and_resume(tmp_path, tiny_data):  # noqa: F811
    recipe = write_recipe(tmp_path / "r.toml", arch="lstm", epochs=2, batch_size=8, extra_train=SENTENCE_MODE)
    base = ["train", str(recipe), "--data-dir", str(tiny_data), "--device", "cpu"]
    wb, _ = kill_resume_and_compare(tmp_path, base, every=4, after=9)
    assert not any(k.startswith("carry.") for k in wb), "no state is carried between sentences"
    ev = json.loads((tmp_path / "a" / "eval.json").read_text())
    assert ev["mode"] == "sentences" and ev["valid"]["mode"] == "sentences"
    t = Trainer(Recipe.load(recipe), tmp_path / "x", data_dir=str(tiny_data), progress=False)
    assert ev["test"]["num_tokens"] == sum(s.numel() - 1 for s in t.sentences["test"])


def test_stream_only_options_are_refused_in_sentence_mode(tmp_path):
    for extra, named in (("bptt = 70", "bptt"), ("variable_bptt = true", "variable_bptt"),
                         ("time_summed_loss = true\neval_bptt = 35", "eval_bptt, time_summed_loss")):
        path = write_recipe(tmp_path / "r.toml", extra_train=SENTENCE_MODE)
        path.write_text(path.read_text() + extra + "\n")
        with pytest.raises(ValueError, match=f"r.toml: {named}: stream-mode option"):
            Recipe.load(path)
    Recipe.load(write_recipe(tmp_path / "r.toml", extra_train=SENTENCE_MODE))  # defaults are fine


def test_unknown_mode_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="mode must be one of stream, sentences, got 'lines'"):
        Recipe.load(write_recipe(tmp_path / "r.toml", extra_train='mode = "lines"'))
