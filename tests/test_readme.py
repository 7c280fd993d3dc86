"""The READMEs' generated sections equal what the catalogue and benchmark results produce now."""

import json

import pytest

from zoo.tools import readme
from zoo.tools.readme import main, render, render_file


def test_readme_is_up_to_date():
    assert main(["--check"]) == 0, "run `python -m zoo.tools.readme` to regenerate the READMEs"


def test_render_names_the_section_without_markers():
    with pytest.raises(ValueError, match="backends-table"):
        render("# title\n<!-- quantization:start -->\nx\n<!-- quantization:end -->\n",
               {"quantization": "q", "backends-table": "b"})


def test_results_markdown_reaches_its_readme(tmp_path, monkeypatch, capsys):
    exports = tmp_path / "exports" / "README.md"
    exports.parent.mkdir()
    exports.write_text("# Exports\n<!-- quantization:start -->\nold\n<!-- quantization:end -->\n"
                       "text\n<!-- backends-table:start -->\n<!-- backends-table:end -->\n")
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "backends.md").write_text("| model | backend |\n|---|---|\n| m | onnx |\n")

    _, new = render_file("exports/README.md", tmp_path)
    table = "| model | backend |\n|---|---|\n| m | onnx |\n"
    assert f"<!-- backends-table:start -->\n{table}<!-- backends-table:end -->" in new
    assert "Not measured yet: run `python benchmarks/quantization.py`" in new
    assert "old" not in new and new.startswith("# Exports\n") and "\ntext\n" in new

    monkeypatch.setattr(readme, "READMES", {"exports/README.md": readme.READMES["exports/README.md"]})
    assert main(["--check"], repo=tmp_path) == 1
    assert "exports/README.md" in capsys.readouterr().err
    assert main([], repo=tmp_path) == 0
    assert exports.read_text() == new
    assert main(["--check"], repo=tmp_path) == 0


def test_write_result_writes_json_and_markdown_then_regenerates(tmp_path, monkeypatch):
    from zoo.tools import readme

    calls = []
    monkeypatch.setattr(readme, "main", lambda argv=None, repo=None: calls.append(argv) or 0)
    out = readme.write_result(tmp_path / "results" / "x.json", {"a": 1}, "| t |\n")
    assert json.loads(out.read_text()) == {"a": 1} and out.with_suffix(".md").read_text() == "| t |\n"
    assert calls == [[]]
