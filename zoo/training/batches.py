"""What each training step trains on: this rank's columns of the carried stream with a (variable) BPTT length, or
sentence mode's shuffled batches of independent lines.

Why the position is the caller's: the trainer checkpoints ``pos`` (a row of the stream, or a batch of the epoch) and
the BPTT generator, and nothing else is needed to draw the same batches again after a resume: the sentence order is
a permutation drawn from (seed, epoch), so it is never stored.
"""

from __future__ import annotations

import numpy as np
import torch

from zoo.data import Corpus, batchify, pad_batch, sentences
from zoo.errors import ConfigError
from zoo.training.recipe import TrainConfig

#: A step's batch: ``(x, y, seq_len, next pos)``, ``x`` and ``y`` ``[B, T]`` on the device.
Batch = tuple[torch.Tensor, torch.Tensor, int, int]


class TrainBatches:
    """The training split of one rank, cut into the batches of the recipe's mode (see the module docstring)."""

    def __init__(self, corpus: Corpus, cfg: TrainConfig, seed: int, eos_id: int, rank: int, world: int,
                 device: torch.device, bptt_rng: np.random.Generator) -> None:
        self.cfg, self.seed, self.eos_id, self.device, self.bptt_rng = cfg, seed, eos_id, device, bptt_rng
        self.sentence_mode = cfg.mode == "sentences"
        self.sentences: dict[str, list[torch.Tensor]] | None = None
        if self.sentence_mode:
            if world > 1:
                raise ConfigError("mode = 'sentences' trains in one process (no torchrun)")
            self.sentences = {"train": sentences(corpus.train, eos_id, cfg.max_len, cfg.train_sentences),
                              "valid": sentences(corpus.valid, eos_id, cfg.max_len),
                              "test": sentences(corpus.test, eos_id, cfg.max_len)}
            self.train_data = corpus.train[:0]
        else:
            global_train = batchify(corpus.train, cfg.batch_size)
            per = cfg.batch_size // world
            self.train_data = global_train[:, rank * per:(rank + 1) * per].contiguous().to(device)

    def epoch_order(self, epoch: int) -> list[list[int]] | None:
        """Sentence mode: this epoch's batches of training-sentence indices; the stream: ``None``."""
        if self.sentences is None:
            return None
        n, bsz = len(self.sentences["train"]), self.cfg.batch_size
        perm = np.random.default_rng([self.seed, epoch]).permutation(n).tolist()
        return [perm[i:i + bsz] for i in range(0, n, bsz)]

    def total(self, order: list[list[int]] | None) -> int:
        """Where an epoch's ``pos`` ends."""
        return len(order) if order is not None else self.train_data.shape[0] - 1

    def seq_len(self) -> int:
        """The next BPTT length: ``bptt``, or with ``variable_bptt`` AWD-LSTM's draw from N(bptt, 5) (N(bptt/2, 5)
        one time in twenty), at least 5."""
        bptt = self.cfg.bptt
        if not self.cfg.variable_bptt:
            return bptt
        base = bptt if self.bptt_rng.random() < 0.95 else bptt / 2
        return max(5, int(self.bptt_rng.normal(base, 5)))

    def next(self, pos: int, order: list[list[int]] | None) -> Batch | None:
        """The epoch's next training batch from ``pos``: ``(x, y, seq_len, next pos)``, or ``None`` at its end.

        Stream mode: ``pos`` is a row of the batchified stream and ``seq_len`` the (variable) BPTT length drawn here.
        Sentence mode: ``pos`` indexes this epoch's batches (``order``); ``seq_len`` is ``bptt`` (no lr scaling).
        """
        if order is not None:
            if pos >= len(order):
                return None
            x, y = pad_batch([self.sentences["train"][i] for i in order[pos]], self.eos_id)
            return x.to(self.device), y.to(self.device), self.cfg.bptt, pos + 1
        n_rows = self.train_data.shape[0]
        if pos >= n_rows - 1:
            return None
        seq_len = min(self.seq_len(), n_rows - 1 - pos)
        x = self.train_data[pos:pos + seq_len].t()
        y = self.train_data[pos + 1:pos + 1 + seq_len].t()
        return x, y, seq_len, pos + seq_len
