"""The playground's server side: `/` serves the page and /static/ its script and style, outside
the API key and the OpenAPI document; `--no-ui` (ServerConfig.ui) turns it off; the page's files
reach nothing but their own server; and they ship in the package."""

import glob
import re
import tomllib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from specserve.cli import build_parser
from specserve.llm import LLM
from specserve.server.launcher import build_app_for, server_config
from specserve.server.playground import STATIC_DIR
from specserve.server.serving import ServerConfig

ROOT = Path(__file__).resolve().parents[1]
FILES = ("index.html", "playground.js", "playground.css")


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(loaded=tiny["loaded"], max_num_seqs=2, max_model_len=128)


def client_for(llm, **config) -> TestClient:
    """A client of the app without its lifespan: the engine thread never starts, and none of
    these routes needs it."""
    app, _ = build_app_for(llm, ServerConfig(served_model_names=("tiny",), max_model_len=128, **config), None)
    return TestClient(app)


def test_the_page_and_its_files_are_served(llm):
    client = client_for(llm)
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/static/playground.js"' in page.text and 'href="/static/playground.css"' in page.text
    js, css = client.get("/static/playground.js"), client.get("/static/playground.css")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert js.text == (STATIC_DIR / "playground.js").read_text()
    for r in (page, js, css, client.get("/static/index.html")):  # a file opened directly is a page too
        assert r.headers["content-security-policy"] == page.headers["content-security-policy"]
        assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"
    assert client.get("/static/nothing.js").status_code == 404


def test_the_page_is_public_and_outside_the_api_document(llm):
    client = client_for(llm, api_key="k")
    assert client.get("/").status_code == 200 and client.get("/static/playground.js").status_code == 200
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if not p.startswith("/v1") and p not in ("/health", "/metrics", "/tokenize", "/detokenize")]


def test_no_ui_turns_it_off(llm):
    client = client_for(llm, ui=False)
    assert client.get("/").status_code == 404 and client.get("/static/playground.js").status_code == 404
    assert client.get("/v1/models").status_code == 200
    parse = build_parser().parse_args
    assert server_config(parse(["serve"]), "m", 128).ui
    off = server_config(parse(["serve", "--no-ui", "--served-model-name", "a"]), "m", 128)
    assert not off.ui and off.served_model_names == ("a",)


def test_the_files_reach_only_their_own_server():
    for name in FILES:
        text = (STATIC_DIR / name).read_text()
        # The one absolute URL allowed is SVG's namespace name, an identifier never fetched.
        urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"')]*", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, f"{name} refers to {urls}"
        assert "@import" not in text and "url(" not in text


def test_the_package_data_includes_the_files():
    """The patterns pyproject gives setuptools, globbed from the package as setuptools does, so
    a non-editable install carries the page."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["specserve"]
    shipped = {f for p in patterns for f in glob.glob(p, root_dir=ROOT / "specserve", recursive=True)}
    assert {f"server/static/{name}" for name in FILES} <= shipped
    assert sorted(p.name for p in STATIC_DIR.iterdir()) == sorted(FILES)


def test_the_page_formats_answers_safely_and_fits_a_phone(llm):
    """Answers render as markdown through DOM nodes only (the model's text never becomes HTML),
    links keep safe schemes only, and the layout has a narrow-window rule (test_browser.py
    renders both in a browser)."""
    client = client_for(llm)
    js, css = client.get("/static/playground.js").text, client.get("/static/playground.css").text
    assert "function renderMarkdown(" in js and 'new Set(["http:", "https:", "mailto:"])' in js
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(|new Function", js)
    assert '<input id="markdown" type="checkbox" checked>' in client.get("/").text
    assert "@media (max-width: 30rem)" in css and "body[data-view=formatted]" in css
