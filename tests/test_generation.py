"""Generation: seeded sampling is reproducible, greedy is argmax, filters and limits hold."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_lm, tiny_tokenizer
from zoo.generation import SamplingParams, filter_logits
from zoo.zoo_model import ZooModel


@pytest.fixture(scope="module")
def model() -> ZooModel:
    """A tiny aLSTM whose logits differ: at its initialisation they are all within ~1e-7 of each other, so
    "greedy is the argmax" would hinge on float rounding (the step and sequence paths round differently)."""
    lm = tiny_lm("alstm", seed=1)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return ZooModel(lm, tiny_tokenizer(), {"name": "tiny"})


def test_same_seed_same_text(model):
    a = model.generate("the cat", max_new_tokens=30, seed=5, stop_at_eos=False)
    b = model.generate("the cat", max_new_tokens=30, seed=5, stop_at_eos=False)
    c = model.generate("the cat", max_new_tokens=30, seed=6, stop_at_eos=False)
    assert a == b and a != c


def test_greedy_is_argmax_and_top_k_1_equals_greedy(model):
    ids = model.generate_ids("the", max_new_tokens=8, temperature=0, stop_at_eos=False)
    ctx = [model.tokenizer.eos_id, model.tokenizer.index["the"]]
    for nxt in ids:
        with torch.no_grad():
            logits, _ = model.lm(torch.tensor([ctx]))
        assert nxt == int(logits[0, -1].argmax())
        ctx.append(nxt)
    assert model.generate_ids("the", max_new_tokens=8, top_k=1, seed=3, stop_at_eos=False) == ids


def test_stream_concatenates_to_generate(model):
    kw = dict(max_new_tokens=20, seed=11, stop_at_eos=False)
    assert "".join(model.stream("a dog", **kw)) == model.generate("a dog", **kw)


def test_max_new_tokens_means_that_many_and_eos_stop_is_asked_for(model):
    eos = model.tokenizer.eos_id
    for seed in range(5):  # the default: exactly max_new_tokens, <eos> included as a token (a line break)
        ids = model.generate_ids("", max_new_tokens=60, seed=seed)
        assert len(ids) == 60
    assert eos in ids
    pieces = list(model.stream("", max_new_tokens=60, seed=seed))
    assert len(pieces) == 60 and "\n" in pieces and "<eos>" not in "".join(pieces)
    stopped = model.generate_ids("", max_new_tokens=60, seed=seed, stop_at_eos=True)
    assert stopped == ids[:ids.index(eos)]  # the same sample, cut at its first <eos>


def test_allow_unk_false_never_samples_unk(model):
    unk = model.tokenizer.unk_id
    assert unk in model.generate_ids("the", max_new_tokens=300, seed=2, temperature=2.0)
    for seed in range(3):
        assert unk not in model.generate_ids("the", max_new_tokens=300, seed=seed, temperature=2.0, allow_unk=False)
    assert SamplingParams().allow_unk and not SamplingParams().stop_at_eos


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(filter_logits(logits, 0, 0.75))
    assert kept.tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, 0, 0.5)).tolist() == [True, False, False, False]
    assert torch.isfinite(filter_logits(logits, 2, 1.0)).tolist() == [True, True, False, False]


def test_a_long_prompt_runs_in_pieces_with_the_same_continuation(model, monkeypatch):
    """The prompt's logits are never needed, so it runs through in pieces within the scoring budget (no
    [1, T, V] tensor for a long prompt); the state is carried, so the continuation is the same."""
    import zoo.generation as generation

    prompt = " ".join(["the cat sat on the mat"] * 20)
    want = model.generate_ids(prompt, max_new_tokens=15, temperature=0)
    monkeypatch.setattr(generation, "LOGIT_BUDGET", 7 * len(model.tokenizer))
    lengths = []
    forward = model.runner.forward

    def counting(tokens, state=None):
        lengths.append(tokens.shape[1])
        return forward(tokens, state)

    monkeypatch.setattr(model.runner, "forward", counting)
    assert model.generate_ids(prompt, max_new_tokens=15, temperature=0) == want
    assert max(lengths) == 7 and sum(lengths) == len(model.tokenizer.encode(prompt, add_eos=False).ids)


class _Bigram(torch.nn.Module):
    """A bigram language model (next-symbol logits are a table row of the current symbol, no state): the
    smallest model of the protocol whose greedy continuation is known in advance."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def init_state(self, batch_size: int, device=None):
        return (torch.zeros(batch_size, 1),)

    def forward(self, tokens, state=None):
        return self.table[tokens], state

    def step(self, token, state):
        return self.table[token], state


def test_allow_unk_false_never_completes_a_character_models_spelled_unk():
    """A character model spells <unk> as its five characters; greedily this bigram model writes it over and
    over. With allow_unk=False the spelling is never completed (its '>' is the one symbol masked, and only
    after '<unk'), and everything else is left as it was."""
    from zoo.generation import sample_ids
    from zoo.tokenizer import Tokenizer

    vocab = ["<eos>", "_", "<", "u", "n", "k", ">", "a"]
    tok = Tokenizer(vocab, "ptb-char")
    ix = tok.index
    table = torch.full((len(vocab), len(vocab)), -5.0)
    for a, b in (("<eos>", "<"), ("<", "u"), ("u", "n"), ("n", "k"), ("k", ">"), (">", "<"), ("a", "<")):
        table[ix[a], ix[b]] = 5.0
    table[ix["k"], ix["a"]] = 1.0  # second best after 'k'
    model = ZooModel(_Bigram(table), tok, {"name": "bigram"})
    greedy = {"temperature": 0, "max_new_tokens": 20}
    assert "<unk>" in "".join(tok.vocab[i] for i in sample_ids(model.runner, tok, "", SamplingParams(**greedy)))
    ids = list(sample_ids(model.runner, tok, "", SamplingParams(**greedy, allow_unk=False)))
    assert "".join(tok.vocab[i] for i in ids) == "<unka" * 4
    # the public calls take the same path
    assert "<unk>" not in model.generate("a", temperature=0, max_new_tokens=30, allow_unk=False).replace(" ", "")


def test_a_prompt_of_the_wrong_type_fails_at_the_call():
    from zoo.errors import WrongType

    m = ZooModel(tiny_lm("lstm"), tiny_tokenizer(), {"name": "tiny"})
    for call in (m.stream, m.generate, m.generate_ids):
        with pytest.raises(WrongType, match="prompt must be a str, got int"):
            call(123)  # type: ignore[arg-type]
        # the rest of the schema every front end applies: binary prompts, unknown keywords (a bare TypeError
        # from the dataclass before)
        with pytest.raises(ValueError, match="prompt looks like binary data"):
            call("the\x00cat")
        with pytest.raises(WrongType, match="unknown sampling keyword.s. bogus; known: max_new_tokens"):
            call("the", bogus=1)


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1),
                                dict(max_new_tokens=-1), dict(max_new_tokens=10**6)])
def test_invalid_parameters(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)
