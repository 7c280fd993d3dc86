"""Checkpoints: Hub layout round trip for every architecture; strict loading names every problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.conftest import tiny_lm, tiny_tokenizer
from zoo.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


def test_round_trip_every_architecture(tmp_path, variant):
    lm = tiny_lm(variant).eval()
    out = save_checkpoint(tmp_path / variant, lm, tiny_tokenizer(), {"dataset": "ptb"})
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "vocab.json", "tokenizer.json",
                                               "tokenizer_config.json"}
    lm2, tok, cfg = load_checkpoint(out)
    tokens = torch.randint(0, lm.vocab_size, (2, 6))
    torch.testing.assert_close(lm2(tokens)[0], lm(tokens)[0], rtol=0, atol=0)
    assert cfg["architecture"] == lm.architecture and cfg["dataset"] == "ptb" and tok.vocab == tiny_tokenizer().vocab


def test_tied_weight_stored_once_and_retied(tmp_path):
    lm = tiny_lm("lstm")
    out = save_checkpoint(tmp_path / "m", lm, tiny_tokenizer())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "decoder.weight" not in f.keys() and "embedding.weight" in f.keys()
    lm2, _, _ = load_checkpoint(out)
    assert lm2.decoder.weight is lm2.embedding.weight


def test_float16_on_disk_loads_as_float32(tmp_path):
    lm = tiny_lm("alstm")
    out = save_checkpoint(tmp_path / "m", lm, tiny_tokenizer(), dtype=torch.float16)
    assert load_file(str(out / "model.safetensors"))["embedding.weight"].dtype == torch.float16
    lm2, _, cfg = load_checkpoint(out)
    assert lm2.embedding.weight.dtype == torch.float32 and cfg["torch_dtype"] == "float16"


@pytest.fixture
def ckpt(tmp_path):
    return save_checkpoint(tmp_path / "m", tiny_lm("alstm"), tiny_tokenizer())


def _rewrite(ckpt, fn):
    tensors = load_file(str(ckpt / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


def test_missing_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.pop("rnn.layers.0.weight_ih"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['rnn.layers.0.weight_ih'\]"):
        load_checkpoint(ckpt)


def test_extra_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.update(bogus=torch.zeros(1)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['bogus'\]"):
        load_checkpoint(ckpt)


def test_misshaped_tensor(ckpt):
    _rewrite(ckpt, lambda t: t.update({"decoder.bias": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"'decoder.bias' has shape \(3,\)"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_by_name(ckpt, bad):
    """A NaN/inf weight loaded, then scored "nan" and crashed sampling; now loading names the tensor."""
    def poison(t):
        t["decoder.bias"][3] = bad
    _rewrite(ckpt, poison)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'decoder.bias' has non-finite values"):
        load_checkpoint(ckpt)


def test_truncated_file(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(ckpt)


def test_unknown_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architecture"] = "transformer"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unknown architecture 'transformer'"):
        load_checkpoint(ckpt)


def test_missing_files_and_bad_vocab(ckpt):
    (ckpt / "vocab.json").write_text(json.dumps(["<eos>", "a"]))
    with pytest.raises(CheckpointError, match="2 entries but config says vocab_size"):
        load_checkpoint(ckpt)
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_checkpoint(ckpt)


def _config_edit(edit):
    def apply(cfg):
        edit(cfg)
        return cfg
    return apply


@pytest.mark.parametrize(("change", "message"), [
    (lambda c: "a string", "expected a JSON object"),
    (_config_edit(lambda c: c.update(architecture=["alstm"])), "'architecture' must be a JSON string"),
    (_config_edit(lambda c: c.update(model_args=[1, 2])), "'model_args' must be a JSON object"),
    (_config_edit(lambda c: c.update(tokenizer="ptb")), "'tokenizer' must be a JSON object"),
    (_config_edit(lambda c: c["tokenizer"].pop("normalization")), "tokenizer.normalization must be a string"),
    (_config_edit(lambda c: c["tokenizer"].update(vocab_file="../../etc/passwd")), "must be a file name in the"),
    (_config_edit(lambda c: c["tokenizer"].update(vocab_file="/dev/zero")), "must be a file name in the"),
    (_config_edit(lambda c: c["tokenizer"].update(vocab_file=5)), "must be a file name in the"),
    (_config_edit(lambda c: c["model_args"].pop("vocab_size")), "config says vocab_size None"),
    (_config_edit(lambda c: c["model_args"].update(emb_size=-4)), "model_args do not fit the architecture"),
    (_config_edit(lambda c: c["model_args"].update(emb_size=3)), "the config implies"),  # builds: shapes differ
])
def test_a_malformed_config_is_a_checkpoint_error(ckpt, change, message):
    """Whatever a config.json holds, loading it is a CheckpointError (the CLI's exit 2), never a traceback, and
    never a read outside the checkpoint folder."""
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(change(cfg)))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(ckpt)


def test_a_config_claiming_a_huge_model_is_refused_before_anything_is_allocated(ckpt):
    """Shapes are checked on the meta device against the file's header: 4 x 10^10 weights cost nothing here."""
    import time

    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_args"]["arch_args"]["hidden_size"] = 100_000
    (ckpt / "config.json").write_text(json.dumps(cfg))
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="the config implies"):
        load_checkpoint(ckpt)
    assert time.perf_counter() - start < 10


def test_a_derived_buffer_over_the_limit_is_refused(tmp_path, monkeypatch):
    """A one-hot input allocates vocab_size squared floats that no weight file holds: bounded."""
    import zoo.checkpoint as checkpoint

    lm = tiny_lm("lstm", input_encoding="onehot", tie_weights=False)
    path = save_checkpoint(tmp_path / "m", lm, tiny_tokenizer())
    load_checkpoint(path)
    monkeypatch.setattr(checkpoint, "MAX_DERIVED_BYTES", 100)
    with pytest.raises(CheckpointError, match="beyond its weights"):
        load_checkpoint(path)


def test_config_and_vocab_json_that_cannot_be_parsed_are_checkpoint_errors(ckpt):
    (ckpt / "vocab.json").write_text("[" * 100_000)
    with pytest.raises(CheckpointError, match="vocab.json: not valid JSON"):
        load_checkpoint(ckpt)
    (ckpt / "config.json").write_text('{"architecture": 1' + "0" * 5000 + "}")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        load_checkpoint(ckpt)


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    """zoo.files.write_atomic (checkpoint config/vocab, eval.json, the catalogue, export manifests, tier reports):
    when the swap fails (here: os.replace raises, as on a full disk) the old bytes stay and the
    temporary file is removed, so a half-written config.json is never seen and nothing is left behind."""

    from zoo import files

    target = tmp_path / "config.json"
    files.write_atomic(target, '{"old": 1}\n')
    assert target.read_text() == '{"old": 1}\n'

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", fail)
    with pytest.raises(OSError, match="No space"):
        files.write_atomic(target, '{"new": 2}\n', fsync=True)
    monkeypatch.undo()
    assert target.read_text() == '{"old": 1}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    files.write_atomic(target, b"\xff raw bytes")
    assert target.read_bytes() == b"\xff raw bytes"
