"""transformers' ``pipeline("text-generation")`` for zoo models: the prompt and the generated text joined as
words.

transformers 5 decodes only the generated tokens and glues them to the prompt (``prompt_text + new_text``): a
tokenizer whose tokens carry their own leading space (GPT-2's ``Ġ``, SentencePiece's ``▁``) reads right, but the
zoo's tokens are whitespace-separated words, so ``"the stock market"`` + ``"is n't"`` read
``"the stock marketis n't"``. :class:`ZooTextGenerationPipeline` joins them as ``zoo generate`` does
(:func:`zoo.generation.word_gap`, the rule ``zoo generate`` prints by).
It is the ``text-generation`` task's class once ``zoo.hf`` is imported (:func:`use_for_text_generation`) and differs
from transformers' own only for a zoo tokenizer.
"""

from __future__ import annotations

from typing import Any

from transformers.pipelines import SUPPORTED_TASKS
from transformers.pipelines.text_generation import ReturnType, TextGenerationPipeline

from zoo.generation import word_gap
from zoo.hf.tokenization import AlstmZooTokenizer


def join_words(tokenizer: AlstmZooTokenizer, prompt: str, text: str) -> str:
    """``prompt`` followed by generated ``text``, joined by the zoo's one spacing rule
    (:func:`zoo.generation.word_gap`)."""
    return prompt + (word_gap(tokenizer.zoo_tokenizer, prompt, text) if text else "") + text


class ZooTextGenerationPipeline(TextGenerationPipeline):
    """transformers' text-generation pipeline; with a zoo tokenizer its full text is joined as words (module
    docstring)."""

    def postprocess(self, model_outputs: dict[str, Any], return_type: ReturnType = ReturnType.FULL_TEXT,
                    *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        prompt = model_outputs.get("prompt_text")
        if (not isinstance(self.tokenizer, AlstmZooTokenizer) or return_type != ReturnType.FULL_TEXT
                or not isinstance(prompt, str)):
            return super().postprocess(model_outputs, return_type, *args, **kwargs)
        records = super().postprocess(model_outputs, ReturnType.NEW_TEXT, *args, **kwargs)
        return [{**r, "generated_text": join_words(self.tokenizer, prompt, r["generated_text"])} for r in records]


def use_for_text_generation() -> None:
    """Make :class:`ZooTextGenerationPipeline` the ``text-generation`` task's class (idempotent)."""
    SUPPORTED_TASKS["text-generation"]["impl"] = ZooTextGenerationPipeline
