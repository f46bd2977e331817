"""The playground in a real browser: Playwright drives Debian's Chromium (by path: Playwright's
own browsers are never downloaded) against a real server on the embedded SmolLM2 with n-gram
speculation. Skipped, saying why, where /usr/bin/chromium or playwright is missing (.ci/run
installs Chromium; playwright is in the test extra).

SPECSERVE_SCREENSHOT=docs/playground.png saves the finished page there (the README's image)."""

import os
import re
from pathlib import Path

import httpx
import pytest

from specserve.llm import LLM
from tests.server_helpers import RunningServer, hold_after_one_step

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:
    sync_playwright = None

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed (pip install -e '.[test]')"),
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium: apt-get install chromium (.ci/run does)"),
]
# The network here is closed: no first-run fetches, component updates, sync or QUIC probes.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "playground-key"
# An answer that copies most of its prompt and changes some words: the n-gram proposer finds
# drafts in the prompt, and the target rejects some of them.
PROMPT = ("Correct the spelling in this paragraph and write it out again:\n\nSpeculative decodng drafts a few tokns "
          "cheaply and lets the large model chek them all in one pass. Every acepted draft saves a pass of the large "
          "model, and the answer stays exactly the same.")
WAIT = 120_000  # ms; generous, for a slow or busy machine (nothing here asserts a speed)


@pytest.fixture(scope="module")
def server():
    # The embedded model as `specserve serve` loads it (native kernels on its quantized blocks),
    # so that the figures on the page (and in the README's screenshot) are what users see.
    from specserve.model.loader import load_model

    llm = LLM(loaded=load_model("default"), speculative_config={"method": "ngram", "num_speculative_tokens": 4},
              max_num_seqs=4, max_model_len=1024)
    with RunningServer(llm, name="smollm", api_key=KEY) as s:
        s.llm = llm
        yield s


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, server):
    page = browser.new_page(viewport={"width": 1360, "height": 760})
    failures: list[str] = []
    page.on("pageerror", lambda e: failures.append(str(e)))
    page.goto(f"{server.url}/")
    yield page
    page.close()
    assert not failures, f"the page raised: {failures}"


def enter_key(page) -> None:
    page.fill("#api-key", KEY)
    page.locator("#api-key").dispatch_event("change")
    expect(page.locator("#model option")).to_have_text(["smollm"])


def test_a_chat_streams_coloured_tokens_figures_and_the_comparison(page, tmp_path):
    expect(page.locator("#error")).to_contain_text("needs an API key")  # /v1/models without the key
    enter_key(page)
    expect(page.locator("#error")).to_be_hidden()
    page.fill("#max-tokens", "80")
    page.fill("#prompt", PROMPT)
    page.press("#prompt", "Enter")

    on, off = page.locator(".answer").nth(0), page.locator(".answer").nth(1)
    expect(off).to_have_attribute("data-status", "done", timeout=WAIT)
    expect(on).to_have_attribute("data-status", "done")
    assert on.locator(".tok.draft").count() > 0 and on.locator(".tok.corrected").count() > 0
    assert on.locator(".tok").count() == on.locator(".tok.draft, .tok.corrected, .tok.bonus, .tok.plain").count()
    assert off.locator(".tok").count() == off.locator(".tok.plain").count() > 0
    assert on.locator(".tok.draft").first.get_attribute("title").startswith("draft")
    text = on.locator(".answer-text").text_content()
    assert text and text == off.locator(".answer-text").text_content()
    expect(page.locator("#verdict")).to_contain_text("Identical text")

    assert float(page.text_content("#fig-tpp")) > 1.0  # greedy and deterministic: drafts were accepted
    for figure in ("#fig-tps", "#fig-tps-off"):
        assert float(page.text_content(figure)) > 0
    expect(page.locator("#fig-acc")).to_have_text(re.compile(r"^\d+%$"))
    expect(page.locator("#fig-speedup")).to_have_text(re.compile(r"^\d+\.\d\d×$"))
    assert page.locator("#by-position rect.bar").count() >= 1

    # /metrics, polled every 2 s: every sparkline has a line, and generation tokens/s (the rate
    # of the counter of generated tokens) has risen above zero.
    page.wait_for_function("""() => {
        const lines = [...document.querySelectorAll('#sparklines polyline')];
        const ys = (l) => l.getAttribute('points').split(' ').map((p) => Number(p.split(',')[1]));
        return lines.length === 5 && lines.every((l) => ys(l).length >= 2) && ys(lines[0]).some((y) => y < 22);
    }""", timeout=WAIT)
    page.locator("#transcript").evaluate("t => t.scrollTop = 0")
    page.screenshot(path=os.environ.get("SPECSERVE_SCREENSHOT") or str(tmp_path / "playground.png"), full_page=True)


def test_errors_show_the_servers_message_and_stop_aborts(page, server, monkeypatch):
    expect(page.locator("#error")).to_contain_text("missing API key")
    page.fill("#prompt", "Hello")
    page.press("#prompt", "Shift+Enter")  # a new line, not a send
    expect(page.locator("#prompt")).to_have_value("Hello\n")
    page.fill("#prompt", "Hello")
    with page.expect_response("**/v1/chat/completions") as refused:
        page.click("#send")  # still no key: 401, and the message goes back into the box
    assert refused.value.status == 401
    expect(page.locator("#error")).to_contain_text("type it in the “API key” field")
    expect(page.locator("#prompt")).to_have_value("Hello")
    expect(page.locator(".turn")).to_have_count(0)

    enter_key(page)
    page.fill("#max-tokens", "0")
    page.click("#send")
    refused = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                         json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 0})
    assert refused.status_code == 400
    expect(page.locator("#error")).to_contain_text(refused.json()["error"]["message"])

    page.fill("#max-tokens", "400")
    page.uncheck("#compare")
    # The engine's step after the first waits, so the answer cannot end before Stop is pressed.
    release = hold_after_one_step(server.llm.engine, monkeypatch)
    page.click("#send")
    expect(page.locator(".answer .tok").first).to_be_visible(timeout=WAIT)
    page.click("#stop")
    expect(page.locator(".answer")).to_have_attribute("data-status", "stopped")
    release.set()
    expect(page.locator("#error")).to_be_hidden()
    expect(page.locator("#send")).to_be_enabled()


MARKDOWN = ("# Plan\n\nSome **bold**, *italic* and `code`; a [site](https://example.org/a) and "
            "[trap](javascript:alert(1)) <img src=x onerror=alert(1)><script>alert(2)</script>\n\n"
            "```python\nprint('" + "x" * 300 + "')\n```\n\n- one\n- two\n\n3. three\n4. four\n\n> quoted")


def test_answers_render_as_safe_markdown_in_a_phone_sized_window(browser, server):
    page = browser.new_page(viewport={"width": 360, "height": 740})
    failures: list[str] = []
    page.on("pageerror", lambda e: failures.append(str(e)))
    page.goto(f"{server.url}/")
    rendered = page.evaluate("""(text) => {
        const box = document.createElement("div");
        box.append(renderMarkdown(text));
        return {tags: [...box.querySelectorAll("*")].map((e) => e.tagName.toLowerCase()),
                links: [...box.querySelectorAll("a")].map((a) => a.getAttribute("href")),
                code: box.querySelector("pre code").textContent, ol: box.querySelector("ol").start,
                text: box.textContent};
    }""", MARKDOWN)
    assert set(rendered["tags"]) == {"h3", "p", "strong", "em", "code", "a", "pre", "ul", "ol", "li", "blockquote"}
    assert rendered["links"] == ["https://example.org/a"]  # the javascript: link stays text
    assert "<img src=x onerror=alert(1)><script>alert(2)</script>" in rendered["text"]
    assert rendered["code"] == "print('" + "x" * 300 + "')" and rendered["ol"] == 3

    enter_key(page)
    page.uncheck("#compare")
    page.fill("#max-tokens", "24")
    page.fill("#prompt", "Write a short list of three fruits in markdown.")
    page.press("#prompt", "Enter")
    answer = page.locator(".answer")
    expect(answer).to_have_attribute("data-status", "done", timeout=WAIT)
    expect(answer.locator(".answer-md")).to_be_visible()
    expect(answer.locator(".answer-text")).to_be_hidden()
    page.uncheck("#markdown")  # the coloured tokens again
    expect(answer.locator(".answer-text")).to_be_visible()
    expect(answer.locator(".answer-md")).to_be_hidden()
    # A long unbreakable line in an answer scrolls inside its code block, not the page.
    page.evaluate("(text) => { const c = answerColumn(document.querySelector('.turn.assistant'), 'x');"
                  " c.text.textContent = text; finishColumn(c, 'done'); }", MARKDOWN)
    page.check("#markdown")
    assert page.evaluate("document.documentElement.scrollWidth") <= 360
    page.close()
    assert not failures, f"the page raised: {failures}"
