"""The architecture registry: every fact about an architecture, written once.

An :class:`ArchitectureSpec` names the :class:`~zoo.models.base.RecurrentStack` class, the title a card and the
demo show, the paper(s) to cite (BibTeX in :data:`CITATIONS`) and whether the architecture adapts its weights to
the input (what the demo's adaptation view needs). Checkpoint loading, training, the CLI, the cards, the app,
exports and serving all read this registry: adding an architecture is one file in ``zoo/models/`` (or anywhere
importable) plus one :func:`register_architecture` call, and nothing else.

Classes are named by import path (``"module:Class"``) so that importing the registry stays cheap and a broken
optional module cannot break unrelated models; a class object is accepted too (a test or a plugin).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from zoo.errors import ConfigError, UnknownArchitectureError  # noqa: F401 (UnknownArchitectureError re-exported)
from zoo.models.base import RecurrentStack


@dataclass(frozen=True)
class ArchitectureSpec:
    """One architecture: ``target`` is ``"module:Class"`` or the class itself."""

    name: str
    target: str | type[RecurrentStack]
    title: str
    #: Keys of :data:`CITATIONS`, the architecture's source papers, in citation order.
    citations: tuple[str, ...]
    #: Whether the weights adapt to the input step by step (aLSTM, HyperLSTM): the demo shows the adaptation.
    adapts: bool = False
    #: Cited as well when a recipe trains it the AWD-LSTM way (NT-ASGD, AR/TAR, weight drop): the LSTM baseline's
    #: training method is its own paper (Merity et al.); the other architectures' papers describe theirs.
    awd_citation: str | None = None

    def cls(self) -> type[RecurrentStack]:
        if not isinstance(self.target, str):
            return self.target
        module_name, _, cls_name = self.target.partition(":")
        return getattr(importlib.import_module(module_name), cls_name)


#: BibTeX of every citation key an architecture (or a training recipe, ``merity2018``) may cite.
CITATIONS: dict[str, str] = {
    "flennerhag2018": """@inproceedings{flennerhag2018breaking,
  title     = {Breaking the Activation Function Bottleneck through Adaptive Parameterization},
  author    = {Flennerhag, Sebastian and Yin, Hujun and Keane, John and Elliot, Mark},
  booktitle = {Advances in Neural Information Processing Systems (NeurIPS)},
  volume    = {31},
  year      = {2018}
}""",
    "ha2017": """@inproceedings{ha2017hypernetworks,
  title     = {HyperNetworks},
  author    = {Ha, David and Dai, Andrew M. and Le, Quoc V.},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year      = {2017}
}""",
    "pham2016": """@inproceedings{pham2016faster,
  title     = {Faster Training of Very Deep Networks Via p-Norm Gates},
  author    = {Pham, Trang and Tran, Truyen and Phung, Dinh and Venkatesh, Svetha},
  booktitle = {International Conference on Pattern Recognition (ICPR)},
  year      = {2016},
  eprint    = {1608.03639},
  archivePrefix = {arXiv}
}""",
    "zaremba2014": """@article{zaremba2014recurrent,
  title   = {Recurrent Neural Network Regularization},
  author  = {Zaremba, Wojciech and Sutskever, Ilya and Vinyals, Oriol},
  journal = {arXiv preprint arXiv:1409.2329},
  year    = {2014}
}""",
    "merity2018": """@inproceedings{merity2018regularizing,
  title     = {Regularizing and Optimizing {LSTM} Language Models},
  author    = {Merity, Stephen and Keskar, Nitish Shirish and Socher, Richard},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year      = {2018}
}""",
}


ARCHITECTURES: dict[str, ArchitectureSpec] = {}


def register_architecture(spec: ArchitectureSpec, citations: dict[str, str] | None = None) -> ArchitectureSpec:
    """Register an architecture (and the BibTeX of any citation key it brings); a name registered twice is
    replaced, so a test or a plugin can redefine one."""
    CITATIONS.update(citations or {})
    missing = [k for k in (*spec.citations, spec.awd_citation) if k and k not in CITATIONS]
    if missing:
        raise ConfigError(f"architecture {spec.name!r} cites {', '.join(missing)}: give their BibTeX (citations=)")
    ARCHITECTURES[spec.name] = spec
    return spec


def unregister_architecture(name: str) -> None:
    ARCHITECTURES.pop(name, None)


def architecture_names() -> list[str]:
    return sorted(ARCHITECTURES)


def get_spec(name: str) -> ArchitectureSpec:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise UnknownArchitectureError(
            f"unknown architecture {name!r}; registered: {', '.join(architecture_names())}"
        ) from None


def get_architecture(name: str) -> type[RecurrentStack]:
    """The stack class registered under ``name``."""
    return get_spec(name).cls()


def build_stack(name: str, input_size: int, output_size: int, **kwargs) -> RecurrentStack:
    """Instantiate architecture ``name`` with its constructor arguments."""
    return get_architecture(name)(input_size=input_size, output_size=output_size, **kwargs)


register_architecture(ArchitectureSpec("lstm", "zoo.models.lstm:LSTMStack", "LSTM", ("zaremba2014",),
                                       awd_citation="merity2018"))
register_architecture(ArchitectureSpec("alstm", "zoo.models.alstm:ALSTMStack", "adaptive LSTM (aLSTM)",
                                       ("flennerhag2018",), adapts=True))
register_architecture(ArchitectureSpec("hyperlstm", "zoo.models.hyperlstm:HyperLSTMStack", "HyperLSTM", ("ha2017",),
                                       adapts=True))
register_architecture(ArchitectureSpec("pnorm_gru", "zoo.models.pnorm_gru:PNormGRUStack", "p-norm gated GRU",
                                       ("pham2016",)))
