"""End to end in a real browser: Debian's headless Chromium driven by Playwright (no browser download).

Types text into the Score tab, clicks Score, waits for the highlighted text and checks that one coloured
span per scored token is visible; the screenshot is saved under the test's tmp dir, and copied to
``model_cards/demo-screenshot.png`` for the README only when ``ZOO_SAVE_SCREENSHOT=1`` (a test run never
changes the checkout otherwise).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import app  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.test_app import build_tiny_models, free_port  # noqa: E402

sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
TEXT = "the company said it expects to report a loss for the third quarter\nmr. smith declined to comment"

pytestmark = [pytest.mark.skipif(not CHROMIUM.is_file(), reason="needs Debian's chromium (make system-deps)"),
              pytest.mark.filterwarnings("ignore:.*no_silent_downcasting", "ignore:The copy keyword is deprecated")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, registry) of the app over the bundled models plus tiny checkpoints."""
    root = build_tiny_models(tmp_path_factory.mktemp("browser-models"))
    demo = app.build_demo([root])
    _, url, _ = app.launch(demo, port=free_port(), block=False)
    try:
        yield url, app.ModelRegistry([root])
    finally:
        demo.close()


def test_score_in_headless_chromium(served, tmp_path):
    url, registry = served
    model = registry.get(registry.default)  # the catalogue default once bundled, else the tiny aLSTM
    expected = model.score(TEXT)[0]["num_tokens"]
    shot = tmp_path / "demo-screenshot.png"
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(url, wait_until="domcontentloaded")
            box = page.locator("#score-text textarea")
            box.fill("")
            box.type(TEXT, delay=2)
            page.locator("#score-btn").click()
            spans = page.locator("#score-heatmap .zoo-text .tok")
            spans.first.wait_for(state="visible")
            assert spans.count() == expected
            assert page.locator("#score-summary").inner_text().count("perplexity") >= 1
            colours = spans.evaluate_all("els => els.map(e => getComputedStyle(e).backgroundColor)")
            # the inline colours survive rendering (an untrained tiny model may colour every token alike)
            assert len(colours) == expected and not {"rgba(0, 0, 0, 0)", "transparent"} & set(colours)
            assert page.locator("#score-heatmap .zoo-legend").first.is_visible()
            assert spans.nth(expected // 2).is_visible()
            page.locator("#score-heatmap").scroll_into_view_if_needed()
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    if os.environ.get("ZOO_SAVE_SCREENSHOT") == "1":
        shutil.copyfile(shot, REPO / "model_cards" / "demo-screenshot.png")
