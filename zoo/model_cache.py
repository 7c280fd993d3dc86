"""A bounded, thread-safe cache of loaded models, least recently used dropped first.

Why: a front end that serves several people (the demo's tabs, each request a thread of its own) asks for the same
few models again and again; loading one reads, checks and (on CUDA) moves its weights each time, so loaded
models are shared. But every model held costs its weights in memory, and a visitor may walk
through the whole catalogue: the cache keeps at most ``capacity`` models and drops the one used longest ago.

A model is keyed by what it was loaded from (a catalogue name or a checkpoint directory) and the device it was
loaded onto, so the same checkpoint on two devices is two entries. One lock covers lookups and loads alike: two
requests for a model not yet loaded load it once (the second waits for the first), at the price of a load holding
up a lookup of another model for that time.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable

from zoo.zoo_model import ZooModel, load

#: Models held at once unless the caller says otherwise.
DEFAULT_CAPACITY = 4


class ModelCache:
    """``capacity`` loaded :class:`~zoo.zoo_model.ZooModel` s keyed by ``(source, device)``; see the module."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self._models: OrderedDict[tuple[str, str], ZooModel] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, source: str | os.PathLike, device: str = "cpu",
            loader: Callable[[], ZooModel] | None = None) -> ZooModel:
        """The model loaded from ``source`` onto ``device``: the cached one, else ``loader()`` (by default
        ``zoo.load(source, device=device)``), kept. An error from the loader propagates and nothing is kept."""
        key = (os.fspath(source), str(device))
        with self._lock:
            if key in self._models:
                self._models.move_to_end(key)
                return self._models[key]
            model = loader() if loader is not None else load(source, device=device)
            self._models[key] = model
            while len(self._models) > self.capacity:
                self._models.popitem(last=False)
            return model

    def keys(self) -> list[tuple[str, str]]:
        """What is held, least recently used first."""
        with self._lock:
            return list(self._models)

    def __len__(self) -> int:
        with self._lock:
            return len(self._models)
