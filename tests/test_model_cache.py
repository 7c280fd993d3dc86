"""The library's cache of loaded models (zoo.model_cache): bounded, least recently used dropped first, keyed by
source and device, one load for concurrent first requests, nothing kept when a load fails."""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import tiny_lm, tiny_tokenizer
from zoo.checkpoint import save_checkpoint
from zoo.model_cache import ModelCache
from zoo.zoo_model import ZooModel


def test_default_loader_reads_the_checkpoint_once_per_source_and_device(tmp_path):
    folder = save_checkpoint(tmp_path / "m", tiny_lm("lstm").eval(), tiny_tokenizer(), {"dataset": "ptb"})
    cache = ModelCache(2)
    model = cache.get(folder)
    assert isinstance(model, ZooModel) and model.score("the cat")[0]["num_tokens"] == 3
    assert cache.get(str(folder)) is model and cache.get(folder, "cpu") is model  # a path or its text: one key
    assert cache.keys() == [(str(folder), "cpu")]


def test_least_recently_used_is_dropped_beyond_capacity():
    loads: list[str] = []

    def loader(name: str):
        def load() -> ZooModel:
            loads.append(name)
            return ZooModel(tiny_lm("lstm").eval(), tiny_tokenizer(), {})
        return load

    cache = ModelCache(2)
    a = cache.get("a", "cpu", loader("a"))
    cache.get("b", "cpu", loader("b"))
    assert cache.get("a", "cpu", loader("a")) is a  # a is now the most recently used
    cache.get("c", "cpu", loader("c"))  # drops b, not a
    assert cache.keys() == [("a", "cpu"), ("c", "cpu")] and len(cache) == 2
    cache.get("b", "cpu", loader("b"))
    assert loads == ["a", "b", "c", "b"]
    cache.get("a", "meta", loader("a on meta"))  # another device is another entry
    assert loads[-1] == "a on meta" and ("a", "meta") in cache.keys()


def test_concurrent_first_requests_load_once_and_a_failed_load_keeps_nothing():
    calls = []

    def slow() -> ZooModel:
        calls.append(1)
        time.sleep(0.2)
        return ZooModel(tiny_lm("lstm").eval(), tiny_tokenizer(), {})

    cache = ModelCache()
    got: list[ZooModel] = []
    threads = [threading.Thread(target=lambda: got.append(cache.get("m", "cpu", slow))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 4 and all(m is got[0] for m in got)

    def broken() -> ZooModel:
        raise ValueError("bad weights")

    with pytest.raises(ValueError, match="bad weights"):
        cache.get("x", "cpu", broken)
    assert ("x", "cpu") not in cache.keys()
    with pytest.raises(ValueError, match="capacity must be a positive integer"):
        ModelCache(0)
