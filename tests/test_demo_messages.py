"""What the demo says (issue 54, point 5), tested on its handlers without a server where that is enough, and on
``app.py`` itself for what its terminal shows:

* a user's mistake is shown in the page (a ``gr.Error``) and logged as one line, never Gradio's traceback;
* the Generate tab's note names the seed drawn for seed -1 and the prompt's ``<unk>`` and dropped words;
* the Adaptation tab's legend says its colour scale is per text; percentages never read "-0.0%"; the catalogue
  gives bits per character to 3 decimals.
"""

from __future__ import annotations

import html
import logging
import os
import subprocess
import sys
import time
import urllib.request

import gradio as gr
import pytest

from tests.conftest import REPO
from zoo.tools.demo import handlers
from zoo.tools.demo.registry import ModelRegistry, user_error
from zoo.tools.ports import free_port

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    reg = ModelRegistry([])
    if not reg.default:
        pytest.skip("needs the bundled models")
    return reg


def test_a_user_error_is_a_page_message_and_one_log_line(registry, caplog):
    with caplog.at_level(logging.WARNING, logger="zoo.demo"), pytest.raises(gr.Error) as err:
        handlers.score(registry, None, "", registry.default)
    assert err.value.message == "text is empty: give some text." and err.value.print_exception is False
    assert [r.getMessage() for r in caplog.records] == ["app.py: user error: text is empty: give some text."]
    assert user_error("x").print_exception is False


def test_the_seed_drawn_for_minus_one_is_shown_and_reproduces_the_text(registry):
    note, seed = handlers.generate_note(registry, "the company said", registry.default, -1)
    assert f"Seed **{seed}**" in note and 0 <= seed < 2**31
    *_, again = handlers.generate(registry, "the company said", registry.default, 8, seed=seed)
    model = registry.get(registry.default)
    assert again == model.generate("the company said", max_new_tokens=8, seed=seed, top_p=1.0, allow_unk=False)
    assert handlers.generate_note(registry, "the company said", registry.default, 7) == ("", 7)  # nothing to say


def test_unknown_and_dropped_prompt_words_are_named(registry):
    note, _ = handlers.generate_note(registry, "the influencers posted selfies !", registry.default, 0)
    assert "read as `<unk>`: `influencers`, `selfies`." in note
    assert "Dropped from the prompt" in note and "`!`" in note


def test_the_adaptation_legend_says_the_scale_is_per_text(registry):
    adaptive = [n for n in registry.names() if registry.has_adaptation(n)]
    _, heat, _, _ = handlers.adaptation(registry, "the company said", adaptive[0])
    assert "colour scale per text" in heat and html.escape(handlers.ADAPTATION_SCALE_NOTE) in heat


@pytest.mark.parametrize(("change", "shown"), [(-0.0001, "0.0%"), (0.00049, "0.0%"), (-0.0123, "-1.2%"),
                                               (0.25, "+25.0%")])
def test_a_change_that_rounds_to_zero_has_no_sign(change, shown):
    assert handlers.signed_percent(change) == shown


def test_the_catalogue_gives_bits_per_character_to_three_decimals(registry):
    rows = {row[0].removesuffix(" (default)"): row for row in registry.table()}
    for name, row in rows.items():
        decimals = len(row[5].split(".")[1]) if "." in row[5] else 0
        assert decimals == (3 if row[6] == "bits_per_char" else 2), (name, row)


def test_app_logs_a_user_error_as_one_line_without_a_traceback(tmp_path):
    """The real ``app.py``: an empty box over the API, then the terminal's lines."""
    from gradio_client import Client

    port = free_port()
    log = tmp_path / "app.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 240
        while not _answers(f"http://127.0.0.1:{port}/") and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.5)
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        for _ in range(2):
            with pytest.raises(Exception, match="text is empty"):
                client.predict("", ModelRegistry([]).default, "(none)", api_name="/score")
        time.sleep(1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = log.read_text().splitlines()
    assert "Traceback" not in log.read_text(), lines
    assert lines.count("app.py: user error: text is empty: give some text.") == 2, lines


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except OSError:
        return False


def test_make_demo_prints_only_its_announced_steps():
    """`make demo` / `make venv`: no recipe line is echoed (each step is announced by its own `zoo: ...` line), and
    the editable install filters out setuptools' banner, which the filter as written does silence."""
    import re

    text = (REPO / "Makefile").read_text(encoding="utf-8")
    recipes = {}
    for m in re.finditer(r"^(\S[^\n:]*):[^\n=]*\n((?:\t[^\n]*\n?)+)", text, re.M):
        recipes[m[1]] = [line for line in m[2].splitlines() if line.strip()]
    for target in ("$(STAMP)", "$(CHECKOUT_STAMP)", "demo"):
        lines = recipes[target]
        starts = [line for i, line in enumerate(lines) if i == 0 or not lines[i - 1].endswith("\\")]
        assert starts and all(line.startswith("\t@") for line in starts), (target, starts)
    announced = [line for line in recipes["$(STAMP)"] if 'echo "zoo: [' in line]
    assert "two of them" in announced[3], announced
    (install,) = [line for line in recipes["$(STAMP)"] if "-e '.[all]'" in line]
    flt = re.search(r'PYTHONWARNINGS="([^"]+)"', install)[1]
    emit = ("from setuptools.warnings import SetuptoolsWarning\n"
            "SetuptoolsWarning.emit('Editable installation.', 'Please be careful with folders in your working "
            "directory with the same name as your package')")
    loud = subprocess.run([sys.executable, "-c", emit], capture_output=True, text=True, timeout=60)
    quiet = subprocess.run([sys.executable, "-c", emit], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONWARNINGS=flt))
    assert "Editable installation" in loud.stderr and quiet.stderr == "", (loud.stderr, quiet.stderr)
