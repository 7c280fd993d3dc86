"""What a newcomer reads first holds (issue 54, point 3): the Data page names every registered corpus with its
licence and layout and is linked from the README; the Scoring guide's sections start with a sentence; the docs
config names the site and the repository."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from zoo.datasets import DATASETS

REPO = Path(__file__).resolve().parent.parent
DATA_PAGE = REPO / "docs" / "guides" / "data.md"


def test_data_page_names_every_corpus_its_licence_and_layout():
    page = DATA_PAGE.read_text(encoding="utf-8")
    for name, spec in DATASETS.items():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{name}` |"))
        assert spec.licence in row, (name, spec.licence)
        assert f"{name}/" in page  # its folder in the layout
    assert "ZOO_DATA_DIR" in page and "train.txt  valid.txt  test.txt" in page
    assert "(docs/guides/data.md)" in (REPO / "README.md").read_text(encoding="utf-8")


def test_every_scoring_section_opens_with_a_sentence():
    text = (REPO / "docs" / "guides" / "scoring.md").read_text(encoding="utf-8")
    for m in re.finditer(r"^## (.+)\n\n(\S)", text, re.M):
        assert not m[2].islower(), f"section {m[1]!r} starts mid-sentence"


def test_docs_config_names_the_site_and_the_repository():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:")[0].replace("!!", ""))
    assert config["site_url"].startswith("https://") and config["repo_url"].startswith("https://github.com/")


#: The example texts of the pages a newcomer copies from: a command's --text / --prompt, a request's "texts", a
#: Python call's text. Those that show what happens to unknown words on purpose start with "Hello".
EXAMPLE = re.compile(r'--(?:text|prompt) "([^"]+)"|"texts": \["([^"]+)"|\.score\(\[?"([^"]+)"|'
                     r'(?:generate|stream)\("([^"]+)"')
PAGES = ["README.md", "serving/README.md", "exports/README.md", *sorted(
    p.relative_to(REPO).as_posix() for p in (REPO / "docs" / "guides").glob("*.md"))]


def test_example_sentences_are_in_the_default_models_vocabulary():
    """An example that scores a word as <unk> shows the model at its worst (the server guide's `mat`)."""
    import zoo

    tokenizer = zoo.load("default", source="bundled").tokenizer
    seen = []
    for page in PAGES:
        for m in EXAMPLE.finditer((REPO / page).read_text(encoding="utf-8")):
            text = next(g for g in m.groups() if g)
            if text.startswith("Hello") or "\\n" in text or "_" in text:  # on purpose; escaped lines; char models
                continue
            seen.append(text)
            assert tokenizer.encode(text).oov_items == [], (page, text)
    assert len(seen) >= 8 and "the stock market fell sharply on monday" in seen
