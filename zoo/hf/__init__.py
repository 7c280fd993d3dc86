"""The Hugging Face door: zoo checkpoints through transformers' ``AutoConfig``, ``AutoModelForCausalLM``,
``AutoTokenizer``, ``model.generate``, ``pipeline("text-generation")`` and lm-eval's ``hf`` model, without remote code.

``import zoo.hf`` registers the classes (:func:`register`); ``import zoo`` never imports transformers (it is the
optional extra ``alstm-zoo[hf]``). Then::

    import zoo.hf  # noqa: F401 (registers the zoo with transformers)
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    model = AutoModelForCausalLM.from_pretrained("zoo/pretrained/alstm-ptb-5m")   # a checkpoint folder
    tok = AutoTokenizer.from_pretrained("zoo/pretrained/alstm-ptb-5m")
    ids = tok("<eos>the stock market", return_tensors="pt").input_ids              # <eos>: the zoo's text start
    model.generate(ids, max_new_tokens=20, do_sample=False)

The conventions (``<eos>`` as the start of a text and a line break; the loss; loading and its pins) are in
:mod:`zoo.hf.modeling` and :mod:`zoo.hf.tokenization`. lm-eval's stock ``lm_eval --model hf`` finds the
registration through the start-up hook that also gives it ``--model zoo`` (``zoo/tools/lm_eval_hook``): when the
harness imports its ``hf`` backend, the hook imports this module.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from zoo.checkpoint import HF_MODEL_TYPE
from zoo.hf.configuration import AlstmZooConfig, recognise_zoo_configs
from zoo.hf.modeling import AlstmZooCache, AlstmZooForCausalLM
from zoo.hf.pipeline import use_for_text_generation
from zoo.hf.tokenization import AlstmZooTokenizer

__all__ = ["AlstmZooCache", "AlstmZooConfig", "AlstmZooForCausalLM", "AlstmZooTokenizer", "register"]


def register() -> None:
    """Register the zoo's classes with transformers' Auto classes (idempotent; run on import)."""
    AutoConfig.register(HF_MODEL_TYPE, AlstmZooConfig, exist_ok=True)
    AutoModelForCausalLM.register(AlstmZooConfig, AlstmZooForCausalLM, exist_ok=True)
    AutoTokenizer.register(AlstmZooConfig, fast_tokenizer_class=AlstmZooTokenizer, exist_ok=True)
    recognise_zoo_configs()
    use_for_text_generation()


register()
