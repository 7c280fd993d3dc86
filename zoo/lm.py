"""The one language model of the zoo: embedding -> recurrent stack -> (tied) decoder.

Every architecture plugs in as a :class:`~zoo.models.base.RecurrentStack`; this wrapper owns what
is common to all of them and what the references place outside the cell: word-type embedding
dropout (``dropoute``), locked dropout on the embedding output (``dropouti``) and on the last
layer's output (``dropouto``), weight tying (Press & Wolf 2017; Inan et al. 2017), and the
activation regularisers AR/TAR of AWD-LSTM (computed by the trainer from ``forward_hidden``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.models._fused_loss import (
    EVAL_BLOCK,
    EVAL_MIN_LOGITS,
    linear_cross_entropy,
    linear_target_logprobs,
    logits_target_logprobs,
)
from zoo.models.base import State, locked_mask
from zoo.registry import build_stack


class LanguageModel(nn.Module):
    """A recurrent LM with a registered architecture.

    Args:
        vocab_size: output vocabulary size.
        architecture: registered architecture name (``zoo list --architectures``).
        arch_args: constructor arguments of the architecture (``hidden_size``, ``num_layers``, ...).
        emb_size: embedding size; also the stack's output size when weights are tied.
        tie_weights: share the embedding matrix with the decoder.
        input_encoding: ``"embedding"`` (learned) or ``"onehot"`` (fixed identity, as in the
            HyperNetworks character-level models; then ``emb_size`` is the vocabulary size).
        output_size: the stack's output size when untied (default: ``arch_args["hidden_size"]``).
        dropoute: embedding dropout rate (whole words dropped from the embedding matrix).
        dropouti: dropout rate on the stack's input (locked: one mask per sequence).
        dropouto: dropout rate on the stack's output (locked).
        init_range: ``U(-r, r)`` init of the embedding (and untied decoder weight); decoder bias 0.
    """

    def __init__(self, vocab_size: int, architecture: str, arch_args: dict[str, Any] | None = None,
                 emb_size: int = 400, tie_weights: bool = True, input_encoding: str = "embedding",
                 output_size: int | None = None, dropoute: float = 0.0, dropouti: float = 0.0,
                 dropouto: float = 0.0, init_range: float = 0.1):
        super().__init__()
        arch_args = dict(arch_args or {})
        if input_encoding not in ("embedding", "onehot"):
            raise ValueError(f"input_encoding must be 'embedding' or 'onehot', got {input_encoding!r}")
        if input_encoding == "onehot":
            if tie_weights:
                raise ValueError("a one-hot input has no embedding matrix to tie")
            emb_size = vocab_size
        self._config = dict(vocab_size=vocab_size, architecture=architecture, arch_args=arch_args,
                            emb_size=emb_size, tie_weights=tie_weights, input_encoding=input_encoding,
                            output_size=output_size, dropoute=dropoute, dropouti=dropouti,
                            dropouto=dropouto, init_range=init_range)
        self.vocab_size = vocab_size
        self.architecture = architecture
        self.tie_weights = tie_weights
        self.input_encoding = input_encoding
        self.dropoute, self.dropouti, self.dropouto = dropoute, dropouti, dropouto
        if tie_weights:
            out_size = emb_size
        else:
            out_size = output_size if output_size is not None else int(arch_args.get("hidden_size", emb_size))
        if input_encoding == "embedding":
            self.embedding = nn.Embedding(vocab_size, emb_size)
            nn.init.uniform_(self.embedding.weight, -init_range, init_range)
        else:
            self.register_buffer("onehot", torch.eye(vocab_size), persistent=False)
        self.rnn = build_stack(architecture, input_size=emb_size, output_size=out_size, **arch_args)
        self.decoder = nn.Linear(out_size, vocab_size)
        nn.init.zeros_(self.decoder.bias)
        if tie_weights:
            self.decoder.weight = self.embedding.weight
        else:
            nn.init.uniform_(self.decoder.weight, -init_range, init_range)

    # -- configuration ----------------------------------------------------------------------------------
    @property
    def config(self) -> dict[str, Any]:
        """The constructor arguments (what ``config.json`` stores under ``model_args``)."""
        return dict(self._config, arch_args=dict(self._config["arch_args"]))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LanguageModel:
        return cls(**config)

    def num_parameters(self) -> int:
        """Distinct trainable parameters (a tied matrix counted once)."""
        return sum(p.numel() for p in self.parameters())

    def tied_keys(self) -> dict[str, str]:
        """State-dict keys that alias another key: ``{alias: canonical}``."""
        return {"decoder.weight": "embedding.weight"} if self.tie_weights else {}

    # -- computation --------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where the weights are (what scoring and generation put their token tensors on)."""
        return self.decoder.weight.device

    def init_state(self, batch_size: int, device: torch.device | None = None) -> State:
        return self.rnn.init_state(batch_size, device=device or self.decoder.weight.device,
                                   dtype=self.decoder.weight.dtype)

    def state_names(self) -> list[str]:
        return self.rnn.state_names()

    def embed(self, tokens: Tensor) -> Tensor:
        if self.input_encoding == "onehot":
            return F.embedding(tokens, self.onehot.to(self.decoder.weight.dtype))
        weight = self.embedding.weight
        if self.training and self.dropoute > 0:
            keep = weight.new_empty(weight.shape[0], 1).bernoulli_(1 - self.dropoute) / (1 - self.dropoute)
            weight = weight * keep
        return F.embedding(tokens, weight)

    def forward_hidden(self, tokens: Tensor, state: State | None = None,
                       decode: bool = True) -> tuple[Tensor | None, Tensor, Tensor, State]:
        """Training forward: ``(logits [B,T,V], raw_out, dropped_out, state)``.

        ``raw_out`` (undropped last-layer output) feeds TAR and ``dropped_out`` feeds AR, as in AWD-LSTM.
        ``decode=False`` skips the decoder (logits ``None``): :meth:`training_loss` decodes fused with the loss.
        """
        emb = self.embed(tokens)
        if self.training:
            mask = locked_mask(emb.shape[0], emb.shape[-1], self.dropouti, emb.device, emb.dtype)
            if mask is not None:
                emb = emb * mask.unsqueeze(1)
        out, state = self.rnn(emb, state)
        dropped = out
        if self.training:
            mask = locked_mask(out.shape[0], out.shape[-1], self.dropouto, out.device, out.dtype)
            if mask is not None:
                dropped = out * mask.unsqueeze(1)
        return (self.decoder(dropped) if decode else None), out, dropped, state

    def training_loss(self, tokens: Tensor, targets: Tensor, state: State | None = None,
                      ignore_index: int = -100) -> tuple[Tensor, Tensor, Tensor, State]:
        """Training forward and mean cross-entropy over the targets (those equal to ``ignore_index`` left out):
        ``(loss, raw_out, dropped_out, state)``. On the CPU the decoder runs fused with the loss, a block of rows at a
        time (:mod:`zoo.models._fused_loss`: the same numbers as decoding then ``cross_entropy``, without the float32
        logits);
        on CUDA it decodes, then takes a float32 ``cross_entropy`` (see the comment below)."""
        _, out, dropped, state = self.forward_hidden(tokens, state, decode=False)
        h = dropped.reshape(-1, dropped.shape[-1])
        if h.is_cuda:
            # On a GPU the logits are no memory burden and the blocked loss (a CPU cache optimisation) would
            # synchronise on the target count, which a CUDA graph cannot capture: decode, then float32 loss.
            loss = F.cross_entropy(self.decoder(h).float(), targets.reshape(-1), ignore_index=ignore_index)
        else:
            loss = linear_cross_entropy(h, self.decoder.weight, self.decoder.bias, targets.reshape(-1), ignore_index)
        return loss, out, dropped, state

    def forward(self, tokens: Tensor, state: State | None = None) -> tuple[Tensor, State]:
        """``tokens [B, T]`` (and a state, zeros if ``None``) -> ``(logits [B, T, V], state)``."""
        logits, _, _, state = self.forward_hidden(tokens, state)
        return logits, state

    def target_logprobs(self, tokens: Tensor, targets: Tensor, state: State | None = None) -> tuple[Tensor, State]:
        """``tokens, targets [B, T]`` -> ``(log p(targets) [B, T] float32, state)``: what scoring and validation
        need, without the caller holding the logits. Without autograd on a CPU in float32 the decoder runs fused
        with the log-softmax, ``EVAL_BLOCK`` words of the vocabulary at a time, when the logits would pass
        ``EVAL_MIN_LOGITS`` floats (:func:`zoo.models._fused_loss.linear_target_logprobs`: the same numbers up to
        float summation order; WikiText-2's validation in 0.57-0.67x the time); otherwise it decodes, then takes
        the float32 log-softmax. Targets outside the vocabulary (padding) give values the caller masks."""
        _, _, out, state = self.forward_hidden(tokens, state, decode=False)  # (dropped, as forward() decodes)
        w, b = self.decoder.weight, self.decoder.bias
        if (torch.is_grad_enabled() or out.is_cuda or out.dtype != torch.float32 or w.dtype != torch.float32
                or out.shape[0] * out.shape[1] * self.vocab_size < EVAL_MIN_LOGITS):  # (logits in cache: no gain)
            # exactly the operations of forward() then a log-softmax, so these scores are bit-identical to them
            return logits_target_logprobs(self.decoder(out), targets), state
        h = out.reshape(-1, out.shape[-1])
        return linear_target_logprobs(h, w, b, targets.reshape(-1), block=EVAL_BLOCK).view(targets.shape), state

    def step(self, token: Tensor, state: State) -> tuple[Tensor, State]:
        """One generation step: ``token [B]`` -> ``(logits [B, V], state)``; never applies dropout."""
        out, state = self.rnn.step(self.embed(token), state)
        return self.decoder(out), state
