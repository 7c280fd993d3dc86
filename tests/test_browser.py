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
from tests.test_app import build_tiny_models  # noqa: E402
from zoo.tools.ports import free_port  # noqa: E402

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


# -- one test per tab: what a person would see ------------------------------------------------------------------
LONG_CHARS = ("the company said it expects to report a loss for the third quarter because of charges "
              "related to the restructuring of its european operations and the sale of two units ") * 3


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=FLAGS)
        try:
            yield b
        finally:
            b.close()


def _page(browser, url: str, tab: str | None = None):
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.set_default_timeout(90_000)
    page.goto(url, wait_until="domcontentloaded")
    if tab:
        page.get_by_role("tab", name=tab).click()
    return page


def _choose(page, elem_id: str, value: str) -> None:
    box = page.locator(f"#{elem_id} input").first
    box.click()
    box.fill(value)
    box.press("Enter")
    page.keyboard.press("Escape")


def _no_horizontal_overflow(page, selector: str = "body") -> None:
    """Nothing runs off to the right: the page is no wider than the window, and every match of ``selector`` and
    every token in it ends inside the window and inside its own box (a clipped overflow counts too)."""
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    boxes = page.locator(selector).evaluate_all(
        """els => els.map(e => {
            const r = e.getBoundingClientRect();
            const right = Math.max(r.right, ...Array.from(e.querySelectorAll('.tok'),
                                                          t => t.getBoundingClientRect().right));
            return [right, r.right, e.scrollWidth, e.clientWidth, window.innerWidth];
        })""")
    assert boxes and all(right <= min(own, win) + 1 and sw <= cw + 1 for right, own, sw, cw, win in boxes), boxes


def _image_loaded(locator) -> bool:
    return locator.evaluate("img => img.complete && img.naturalWidth > 0")


def _char_and_word_models(registry) -> tuple[str, str | None]:
    from zoo.zoo_model import ZooModel  # noqa: F401  (the registry loads them)

    chars = [n for n in registry.names() if registry.get(n).tokenizer.is_char]
    return registry.default, (chars[0] if chars else None)


def test_score_compare_word_and_character_model(served, browser, tmp_path):
    url, registry = served
    word, char = _char_and_word_models(registry)
    if char is None:
        pytest.skip("no character model bundled")
    page = _page(browser, url)
    page.locator("#score-text textarea").fill(LONG_CHARS)
    _choose(page, "score-model", word)
    _choose(page, "score-compare", char)
    page.locator("#score-btn").click()
    page.locator("#score-heatmap .model-b .tok").first.wait_for(state="visible")
    summary = page.locator("#score-summary").inner_text()
    assert "the models tokenise differently, not comparable" in summary and "bits per input character" in summary
    assert "tokenise this text differently" in page.locator("#score-heatmap").inner_text()
    _no_horizontal_overflow(page, "#score-heatmap .zoo-text")
    page.screenshot(path=str(tmp_path / "compare.png"), full_page=True)


def test_score_compare_two_character_models_wraps(served, browser):
    url, registry = served
    chars = [n for n in registry.names() if registry.get(n).tokenizer.is_char]
    if len(chars) < 2:
        pytest.skip("needs two character models")
    page = _page(browser, url)
    page.locator("#score-text textarea").fill(LONG_CHARS)
    _choose(page, "score-model", chars[0])
    _choose(page, "score-compare", chars[1])
    page.locator("#score-btn").click()
    page.locator("#score-heatmap .model-diff .tok").first.wait_for(state="visible")
    _no_horizontal_overflow(page, "#score-heatmap .zoo-text")  # character heatmaps wrap inside their column
    assert "predicts this text" in page.locator("#score-summary").inner_text()


def test_score_a_model_against_itself_is_a_tie(served, browser):
    url, registry = served
    page = _page(browser, url)
    _choose(page, "score-compare", registry.default)
    page.locator("#score-btn").click()
    page.locator("#score-heatmap .model-diff .tok").first.wait_for(state="visible")
    assert "equally well" in page.locator("#score-summary").inner_text()


def test_generate_tab(served, browser):
    url, _ = served
    page = _page(browser, url, "Generate")
    page.locator("#gen-prompt textarea").fill("the company said")
    page.locator("#gen-btn").click()
    out = page.locator("#gen-out textarea")
    page.wait_for_function("el => el.value.length > 20", arg=out.element_handle())
    assert "<unk>" not in out.input_value()  # the demo never samples <unk> by default
    _no_horizontal_overflow(page)


def test_adaptation_tab(served, browser, tmp_path):
    url, registry = served
    page = _page(browser, url, "Adaptation")
    assert page.locator("#adapt-model input").first.input_value() == registry.default  # the same default
    legend = page.locator("#adapt-legend")
    assert legend.is_visible() and "pi_x" in legend.inner_text() and "beta_" in legend.inner_text()
    page.locator("#adapt-btn").click()
    img = page.locator("#adapt-plot img").first
    img.wait_for(state="visible")
    assert _image_loaded(img)
    assert page.locator("#adapt-html .tok").count() > 5
    _no_horizontal_overflow(page)
    page.screenshot(path=str(tmp_path / "adaptation.png"), full_page=True)


def test_models_tab(served, browser, tmp_path):
    url, registry = served
    page = _page(browser, url, "Models")
    img = page.locator("#models-curve img").first
    img.wait_for(state="visible")
    assert _image_loaded(img)  # the training curve is a real, loaded image (it used to be broken)
    page.locator("#models-card table").first.wait_for(state="visible")
    broken = page.locator("img").evaluate_all("imgs => imgs.filter(i => !(i.complete && i.naturalWidth > 0))"
                                              ".map(i => i.alt || i.src)")
    assert broken == []  # no broken image anywhere (the card's own curve link used to be one)
    assert registry.default in page.locator("#models-table").inner_text()
    assert page.locator("#models-card").inner_text().strip()
    _no_horizontal_overflow(page)
    page.screenshot(path=str(tmp_path / "models.png"), full_page=True)
    if os.environ.get("ZOO_SAVE_SCREENSHOT") == "1":
        shutil.copyfile(tmp_path / "models.png", REPO / "model_cards" / "demo-models.png")


# -- issue 54: what a newcomer sees ------------------------------------------------------------------------------
def test_generate_tab_shows_the_drawn_seed_and_the_prompts_unknown_words(served, browser):
    url, registry = served
    page = _page(browser, url, "Generate")
    _choose(page, "gen-model", registry.default)
    page.locator("#gen-prompt textarea").fill("the influencers said !")
    seed = page.get_by_label("seed (-1 = random)")
    seed.fill("-1")
    seed.press("Tab")
    page.locator("#gen-btn").click()
    note = page.locator("#gen-note")
    note.get_by_text("drawn for seed -1").wait_for(state="visible")
    text = note.inner_text()
    assert "influencers" in text and "<unk>" in text and "Dropped from the prompt" in text
    drawn = int(text.split("Seed ", 1)[1].split(" ", 1)[0])
    out = page.locator("#gen-out textarea")
    page.wait_for_function("el => el.value.length > 20", arg=out.element_handle())
    model = registry.get(registry.default)
    expected = model.generate("the influencers said !", max_new_tokens=50, seed=drawn, top_p=0.95, allow_unk=False)
    page.wait_for_function("([el, n]) => el.value.length >= n", arg=[out.element_handle(), len(expected)])
    assert out.input_value() == expected  # the seed shown is the seed used


def test_user_errors_and_the_comparable_row_in_the_page(served, browser):
    url, registry = served
    page = _page(browser, url)
    page.locator("#score-text textarea").fill("")
    page.locator("#score-btn").click()
    page.get_by_text("text is empty: give some text.").first.wait_for(state="visible")  # the page says it
    word, char = _char_and_word_models(registry)
    if char is None:
        return
    page.locator("#score-text textarea").fill("influencers posted selfies about cryptocurrency on tiktok")
    _choose(page, "score-model", word)
    _choose(page, "score-compare", char)
    page.locator("#score-btn").click()
    page.locator("#score-heatmap .model-b .tok").first.wait_for(state="visible")
    summary = page.locator("#score-summary").inner_text()
    assert "bits per input character (comparable)" in summary and "charged 8 bits each" in summary


def test_adaptation_and_models_tabs_state_their_scales(served, browser):
    url, registry = served
    page = _page(browser, url, "Adaptation")
    page.locator("#adapt-btn").click()
    legend = page.locator("#adapt-html .zoo-legend")
    legend.first.wait_for(state="visible")
    assert "colour scale per text" in legend.first.inner_text()
    page = _page(browser, url, "Models")
    page.locator("#models-card table").first.wait_for(state="visible")  # the page has loaded (as test_models_tab)
    shown = page.locator("#models-table").inner_text()
    chars = [r for r in registry.table() if r[6] == "bits_per_char"]
    if chars:
        assert chars[0][5] in shown and len(chars[0][5].split(".")[1]) == 3
