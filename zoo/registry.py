"""Named architectures and pretrained models.

Adding an architecture is one file in ``zoo/models/`` plus one line in ``ARCHITECTURES``. Entries
are import paths so that importing the registry stays cheap and a broken optional module cannot
break unrelated models.
"""

from __future__ import annotations

import importlib

from zoo.models.base import RecurrentStack

#: architecture name -> "module:Class" of its :class:`RecurrentStack`.
ARCHITECTURES: dict[str, str] = {
    "lstm": "zoo.models.lstm:LSTMStack",
    "alstm": "zoo.models.alstm:ALSTMStack",
    "hyperlstm": "zoo.models.hyperlstm:HyperLSTMStack",
    "pnorm_gru": "zoo.models.pnorm_gru:PNormGRUStack",
}


class UnknownArchitectureError(ValueError):
    """A config or command named an architecture that is not registered."""


def architecture_names() -> list[str]:
    return sorted(ARCHITECTURES)


def get_architecture(name: str) -> type[RecurrentStack]:
    """The stack class registered under ``name``."""
    try:
        target = ARCHITECTURES[name]
    except KeyError:
        raise UnknownArchitectureError(
            f"unknown architecture {name!r}; registered: {', '.join(architecture_names())}"
        ) from None
    module_name, _, cls_name = target.partition(":")
    return getattr(importlib.import_module(module_name), cls_name)


def build_stack(name: str, input_size: int, output_size: int, **kwargs) -> RecurrentStack:
    """Instantiate architecture ``name`` with its constructor arguments."""
    return get_architecture(name)(input_size=input_size, output_size=output_size, **kwargs)
