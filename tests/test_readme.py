"""The README's generated sections equal what the catalogue and benchmark results produce now."""

from zoo.readme import main


def test_readme_is_up_to_date():
    assert main(["--check"]) == 0, "run `python -m zoo.readme` to regenerate README.md"
