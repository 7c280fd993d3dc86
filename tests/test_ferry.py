"""zoo/tools/gpu/ferry.py: a run packed into the device tool's return and unpacked here resumes and trains on."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_train import kill_data, write_recipe, zoo  # noqa: F401 (kill_data is a fixture: a small corpus)
from zoo.tools.gpu import ferry
from zoo.tools.release.cards import epoch_devices, pieces_line
from zoo.training import Recipe, Trainer


def test_log8_code_keeps_each_value_within_half_a_step_and_zero_exact():
    v = torch.cat([torch.zeros(3), torch.logspace(-40, 0, 5000, base=2.0), torch.rand(1000) * 1e-6])
    q, lo, hi = ferry.encode_log8(v)
    back = ferry.decode_log8(q, lo, hi)
    assert q.dtype == torch.uint8 and torch.equal(back[:3], torch.zeros(3))
    step = (hi - lo) / ferry.LEVELS
    ratio = (back[3:] / v[3:]).log2().abs()
    assert float(ratio.max()) <= step / 2 + 1e-5
    assert float(ratio.max()) > step / 4  # the code is 8-bit: it does round (a test of the test)


def test_log8_code_edge_cases():
    for v in (torch.tensor([3e-7]), torch.full((5,), 2.5e-3), torch.zeros(4)):  # one value, hi == lo, all zeros
        q, lo, hi = ferry.encode_log8(v)
        torch.testing.assert_close(ferry.decode_log8(q, lo, hi), v, rtol=1e-6, atol=0)


def _train(tmp_path: Path, data: Path, run: str, epochs: int) -> dict:
    recipe = Recipe.load(write_recipe(tmp_path / f"{run}-{epochs}.toml", epochs=epochs))
    return Trainer(recipe, tmp_path / run, data_dir=str(data), progress=False).run(resume=True)


def test_packed_run_fits_the_return_unpacks_and_resumes_close_to_the_original(tmp_path, kill_data,  # noqa: F811
                                                                               monkeypatch):
    _train(tmp_path, kill_data, "a", epochs=1)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    monkeypatch.setattr(ferry, "TOTAL_LIMIT", 4096)
    with pytest.raises(ferry.FerryError, match="over the"):
        ferry.pack(tmp_path / "a", tmp_path / "big")
    monkeypatch.setattr(ferry, "TOTAL_LIMIT", 53 * ferry.MiB)
    monkeypatch.setattr(ferry, "PART_BYTES", 20_000)  # several parts, joined back in order
    manifest = ferry.pack(tmp_path / "a", tmp_path / "out")
    assert manifest["epoch"] == 2 and manifest["pos"] == 0 and manifest["best_is_checkpoint"]
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == [ferry.MANIFEST] + [p["name"] for p in manifest["parts"]] and len(manifest["parts"]) > 2
    assert all((tmp_path / "out" / p["name"]).stat().st_size <= 20_000 for p in manifest["parts"])

    ferry.unpack(tmp_path / "out", tmp_path / "c")
    orig = load_file(str(tmp_path / "a" / "checkpoint" / "state.safetensors"))
    back = load_file(str(tmp_path / "c" / "checkpoint" / "state.safetensors"))
    assert orig.keys() == back.keys()
    for k, v in orig.items():
        if k.startswith("model."):
            torch.testing.assert_close(back[k], v.half().float(), rtol=0, atol=0)
        elif k.endswith(".exp_avg"):
            assert not back[k].any()
        elif k.endswith(".exp_avg_sq"):
            pos = v > 0
            assert torch.equal(back[k] > 0, pos)
            assert float((back[k][pos] / v[pos]).log2().abs().max()) < 0.2
        else:
            assert torch.equal(back[k], v), k  # step counters, RNG states, carried state: exact
    best = load_file(str(tmp_path / "c" / "best" / "model.safetensors"))
    assert best.keys() == {k[6:] for k in back if k.startswith("model.")}
    before = json.loads((tmp_path / "a" / "checkpoint" / "meta.json").read_text())
    after = json.loads((tmp_path / "c" / "checkpoint" / "meta.json").read_text())
    assert after["log_bytes"] == before["log_bytes"]  # a resume still trims what the log holds past the checkpoint
    log = [json.loads(x) for x in (tmp_path / "c" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["event"] == "ferried" and "best_reset" not in log[-1]

    plain = _train(tmp_path, kill_data, "b", epochs=2)
    carried = _train(tmp_path, kill_data, "c", epochs=2)
    assert carried["epochs_trained"] == 2
    assert carried["valid"]["ppl"] == pytest.approx(plain["valid"]["ppl"], rel=0.01)
    log = [json.loads(x) for x in (tmp_path / "c" / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log if "valid_ppl" in r] == [1, 2]
    assert any(r.get("event") == "ferried" for r in log)

    with pytest.raises(ferry.FerryError, match="already holds"):  # never back over a later checkpoint
        ferry.unpack(tmp_path / "out", tmp_path / "c")


def test_finished_run_carried_without_its_best_chooses_again_and_finishes_here(tmp_path, kill_data):  # noqa: F811
    """A run that finished where it trained carries no eval.json or release/ (a finish here redoes them), and when
    best/ was not its last epoch, the choice starts again at that epoch: best_epoch never names thrown-away weights."""
    _train(tmp_path, kill_data, "a", epochs=2)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "eval.json").write_text("{}")  # stale results where it lands: removed
    best = tmp_path / "a" / "best" / "model.safetensors"
    w = load_file(str(best))
    first = next(iter(w))
    w[first] = w[first] + 1.0  # best/ no longer the checkpoint's weights (as after an epoch that got worse)
    save_file(w, str(best), metadata={"format": "pt", "tied": "[]"})
    log_path = tmp_path / "a" / "log.jsonl"
    lines = [json.loads(x) for x in log_path.read_text().splitlines()]
    lines[0]["valid_loss"] = 0.1  # epoch 1 "best" by far: its weights are the ones that do not travel
    size = log_path.stat().st_size
    log_path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    meta_path = tmp_path / "a" / "checkpoint" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["log_bytes"] += log_path.stat().st_size - size  # (the edit changed the line's length)
    meta_path.write_text(json.dumps(meta))
    manifest = ferry.pack(tmp_path / "a", tmp_path / "out")
    assert not manifest["best_is_checkpoint"] and manifest["epoch"] == 3
    result = ferry.unpack(tmp_path / "out", tmp_path / "c")
    assert result["event"]["best_reset"] == {"from": meta["best_val"], "to": meta["history"][-1]}
    assert json.loads((tmp_path / "c" / "checkpoint" / "meta.json").read_text())["best_val"] == meta["history"][-1]
    assert not (tmp_path / "c" / "eval.json").exists() and not (tmp_path / "c" / "release").exists()
    ckpt = load_file(str(tmp_path / "c" / "checkpoint" / "state.safetensors"))
    assert torch.equal(load_file(str(tmp_path / "c" / "best" / "model.safetensors"))[first], ckpt[f"model.{first}"])
    done = _train(tmp_path, kill_data, "c", epochs=2)  # finished: --resume finishes it here
    assert done["epochs_trained"] == 2 and done["best_epoch"] == 2
    assert (tmp_path / "c" / "release" / "model.safetensors").is_file()


def test_refusals_are_one_line_errors(tmp_path, kill_data, capsys):  # noqa: F811
    _train(tmp_path, kill_data, "a", epochs=1)
    ferry.pack(tmp_path / "a", tmp_path / "out")
    part = tmp_path / "out" / "ferry.part00"
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    assert ferry.main(["unpack", str(tmp_path / "out"), str(tmp_path / "c")]) == 2
    assert "SHA-256" in capsys.readouterr().err
    meta_path = tmp_path / "a" / "checkpoint" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["optimizer"] = "sgd"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ferry.FerryError, match="only Adam can be carried"):
        ferry.pack(tmp_path / "a", tmp_path / "out3")
    meta["optimizer"] = "adam"
    meta_path.write_text(json.dumps(meta))
    state_path = tmp_path / "a" / "checkpoint" / "state.safetensors"
    good = load_file(str(state_path))
    for key, value, refusal in (("exp_avg_sq", math.nan, "is not finite: the run has diverged"),
                                ("model.", 1e6, "does not fit float16")):
        tensors = dict(good)
        name = next(k for k in tensors if (k.endswith(key) if key == "exp_avg_sq" else k.startswith(key))
                    and tensors[k].is_floating_point())
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = value
        save_file(tensors, str(state_path))
        with pytest.raises(ferry.FerryError, match=refusal):
            ferry.pack(tmp_path / "a", tmp_path / "out4")
    save_file(good, str(state_path))
    assert ferry.pack(tmp_path / "a", tmp_path / "out5")["epoch"] == 2  # the run itself is carried as before


def test_a_piece_paused_at_an_epoch_end_carries_and_one_stopped_mid_epoch_carries_without_best(tmp_path, kill_data):  # noqa: F811,E501
    """--pause-after-minutes stops at the first epoch end past it, unfinished (no eval.json), and --resume goes on;
    a mid-epoch checkpoint (a SIGTERM) travels without best/, which the next epoch end writes."""
    recipe = Recipe.load(write_recipe(tmp_path / "r.toml", epochs=3))
    paused = Trainer(recipe, tmp_path / "a", data_dir=str(kill_data), progress=False,
                     pause_after_minutes=1e-6).run()
    assert paused == {"paused": True, "epochs_trained": 1, "epochs": 3, "valid_ppl": pytest.approx(
        json.loads((tmp_path / "a" / "log.jsonl").read_text().splitlines()[0])["valid_ppl"])}
    assert not (tmp_path / "a" / "eval.json").exists()
    log = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["event"] == "paused" and log[-1]["epoch"] == 1

    shutil.copytree(tmp_path / "a", tmp_path / "c")  # where it lands: at the end of epoch 1, with best/
    meta_path = tmp_path / "a" / "checkpoint" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["pos"] = 5  # as if stopped by a signal five rows into epoch 2
    meta_path.write_text(json.dumps(meta))
    manifest = ferry.pack(tmp_path / "a", tmp_path / "out")
    assert manifest["mid_epoch"] and not manifest["best_is_checkpoint"] and manifest["pos"] == 5
    result = ferry.unpack(tmp_path / "out", tmp_path / "c")  # (2, pos 5) is ahead of (2, pos 0)
    assert result["event"]["best_reset"]["to"] == float("inf")
    assert not (tmp_path / "c" / "best").exists()
    done = Trainer(recipe, tmp_path / "c", data_dir=str(kill_data), progress=False).run(resume=True)
    assert done["epochs_trained"] == 3 and (tmp_path / "c" / "best" / "model.safetensors").is_file()
    assert done["best_epoch"] >= 2  # epoch 1's weights did not travel
    log = [json.loads(x) for x in (tmp_path / "c" / "log.jsonl").read_text().splitlines()]
    assert pieces_line(log) == (
        "- Trained in pieces: 2 (paused 1 time at an epoch end); carried between machines 1 time (from "
        f"{manifest['from']}), each trip rounding the weights to float16 once and Adam's second moment to an 8-bit "
        "code (`zoo/tools/gpu/ferry.py`); best/ chosen again from epoch 2 on (its earlier weights did not travel)")
    assert pieces_line([r for r in log if r.get("event") not in ("paused", "ferried")]) is None


def test_cli_pause_prints_where_it_stopped_and_jobs_say_paused_then_resume_finishes(tmp_path, kill_data):  # noqa: F811
    recipes = [str(write_recipe(tmp_path / f"{arch}.toml", arch=arch, epochs=2)) for arch in ("alstm", "lstm")]
    base = ["train", *recipes, "--jobs", "2", "--data-dir", str(kill_data), "--run-dir", str(tmp_path / "runs")]
    out = zoo(*base, "--pause-after-minutes", "0.000001")
    assert out.returncode == 0, out.stdout[-2000:]
    assert out.stdout.count("paused (--pause-after-minutes; continue with --resume) tiny-") == 2
    child = (tmp_path / "runs" / "tiny-alstm" / "stdout.log").read_text()  # what a single `zoo train` printed
    assert '"paused_after_epoch": 1' in child and "continue with --resume" in child
    assert not (tmp_path / "runs" / "tiny-alstm" / "eval.json").exists()
    done = zoo(*base, "--resume")
    assert done.returncode == 0 and done.stdout.count("finished tiny-") == 2, done.stdout[-2000:]
    assert json.loads((tmp_path / "runs" / "tiny-lstm" / "eval.json").read_text())["epochs_trained"] == 2


def test_the_card_says_which_machine_trained_which_epochs():
    """Epochs logged before zoo train recorded a device take the machine of the trip that carried them; a card
    names the spans only when more than one machine trained the run."""
    h100, cpu = "NVIDIA H100 80GB HBM3", "CPU (2 cores, 1 threads)"
    log = [{"epoch": 1, "valid_ppl": 9.0}, {"epoch": 2, "valid_ppl": 8.0}, {"event": "paused", "epoch": 2},
           {"event": "ferried", "from": h100, "epoch": 2, "pos": 0, "best_reset": {"from": 2.1, "to": 2.2}},
           {"epoch": 3, "valid_ppl": 7.0, "device": cpu}, {"epoch": 4, "valid_ppl": 6.0, "device": cpu}]
    assert epoch_devices(log) == [(1, 2, h100), (3, 4, cpu)]
    assert pieces_line(log, cpu).endswith(
        "; epochs 1-2 on H100 GPU, epochs 3-4 on CPU, 1 thread; best/ chosen again from epoch 2 on (its earlier "
        "weights did not travel)")
    unrecorded = [r for r in log if r.get("event") != "ferried"]
    assert epoch_devices(unrecorded) == [(1, 2, "an unrecorded machine"), (3, 4, cpu)]
    assert epoch_devices(unrecorded, cpu) == [(1, 4, cpu)]
    assert "epochs 1-" not in pieces_line(unrecorded, cpu)  # one machine: the hardware line says it
