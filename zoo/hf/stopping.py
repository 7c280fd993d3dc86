"""``model.generate(stop_strings=[...])`` for zoo models: stop once the generated text holds a stop string.

transformers' ``StopStringCriteria`` learns each token's text by decoding it after a probe prefix (``"abcdef"``)
and looking for the prefix in the result; the zoo's tokenizer normalises that probe away (to ``<unk>`` for PTB),
so it failed with ``ValueError: substring not found``. :class:`ZooStopStrings` reads the generated tokens as
``zoo generate`` prints them (:class:`zoo.generation.Detokenizer`: words separated by spaces, ``<eos>`` a line
break) and stops a row at the token that completes a stop string, as lm-eval's ``until`` and the server's
``stop`` do; like transformers, the tokens are kept (the text is not cut).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import StoppingCriteria

from zoo.errors import ConfigError
from zoo.generation import Detokenizer
from zoo.tokenizer import Tokenizer


class ZooStopStrings(StoppingCriteria):
    """Stop each row whose generated text (since the prompt) contains one of ``stops``."""

    def __init__(self, stops: str | Sequence[str], tokenizer: Tokenizer):
        self.stops = [stops] if isinstance(stops, str) else list(stops)
        if not self.stops or not all(isinstance(s, str) and s for s in self.stops):
            raise ConfigError(f"stop_strings must be non-empty strings, got {stops!r}")
        self.tokenizer = tokenizer
        self.window = max(len(s) for s in self.stops) + 1  # tokens: each reads as at least one character
        self.start: int | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        if self.start is None:  # (first called once the first token is appended)
            self.start = input_ids.shape[1] - 1
        begin = max(self.start, input_ids.shape[1] - self.window)
        done = []
        for row in input_ids.tolist():
            before = self.tokenizer.token_text(row[begin - 1]) if begin else ""
            pieces = Detokenizer(self.tokenizer, before=before)
            text = "".join(pieces.piece(i) for i in row[begin:])
            done.append(any(s in text for s in self.stops))
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)
