"""The dataset registry: every fact about a benchmark corpus, written once.

Everything that differs between corpora lives in its :class:`DatasetSpec`: the folder name under the data dir,
the tokenizer normalisation that maps raw text onto the corpus's conventions, the metric its papers report
(bits per character for character-level data, else perplexity), what a model card says about it (Hub id,
licence, where the text comes from) and the example texts written in its own normalisation. Data loading, the
trainer, the CLI's choices, the cards, the demo and the lm-eval tasks all read this registry; adding a corpus is
one :func:`register_dataset` call (and its three split files in the data dir).
"""

from __future__ import annotations

from dataclasses import dataclass

from zoo.errors import UnknownDatasetError


@dataclass(frozen=True)
class DatasetSpec:
    """One benchmark corpus. ``name`` is also its folder under the data dir (``train.txt``, ``valid.txt``,
    ``test.txt`` inside)."""

    name: str
    title: str
    #: The tokenizer normalisation (:data:`zoo.tokenizer.NORMALIZATIONS`) that maps raw text to this corpus.
    normalization: str
    #: Character level: the papers report bits per character, and every symbol is one token.
    char_level: bool
    #: Where the text comes from (a card's limitations: "Trained only on TITLE: TEXT_SOURCE with ...").
    text_source: str
    #: The corpus on the Hugging Face Hub (``datasets`` id and config) for a card's metadata.
    hub_id: str
    hub_config: str | None
    licence: str
    #: A card's usage example, written in the corpus's own normalisation so that it scores as the data does.
    example_text: str = "the stock market fell sharply on monday"
    example_prompt: str = "the company said"

    @property
    def metric(self) -> str:
        """The headline metric of this corpus's papers: ``bits_per_char`` or ``perplexity``."""
        return "bits_per_char" if self.char_level else "perplexity"


DATASETS: dict[str, DatasetSpec] = {}


def register_dataset(spec: DatasetSpec) -> DatasetSpec:
    """Add a corpus (a name already registered is replaced: a test or a plugin may redefine one)."""
    DATASETS[spec.name] = spec
    return spec


def get_dataset(name: str) -> DatasetSpec:
    try:
        return DATASETS[name]
    except KeyError:
        raise UnknownDatasetError(f"unknown dataset {name!r}; registered: {', '.join(dataset_names())}") from None


def dataset_names() -> list[str]:
    return list(DATASETS)


register_dataset(DatasetSpec(
    "ptb", "Penn Treebank (word level, Mikolov et al. 2010 preprocessing)", "ptb", False,
    "1989 Wall Street Journal text", "ptb-text-only/ptb_text_only", "penn_treebank",
    "LDC Treebank-3 (LDC99T42) text; the Mikolov preprocessing is redistributed for research use"))
register_dataset(DatasetSpec(
    "ptb-char", "Penn Treebank (character level, Mikolov)", "ptb-char", True,
    "1989 Wall Street Journal text", "ptb-text-only/ptb_text_only", "penn_treebank",
    "LDC Treebank-3 (LDC99T42) text; research use"))
register_dataset(DatasetSpec(
    "wikitext-2", "WikiText-2 (wikitext-2-v1, tokenised)", "wikitext", False,
    "Wikipedia", "Salesforce/wikitext", "wikitext-2-v1",
    "CC BY-SA 3.0 (Wikipedia)", "The album was released in 2010 and received positive reviews from critics.",
    "The game was"))
