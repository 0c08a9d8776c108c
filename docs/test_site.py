# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""The built docs in headless Chromium: every page renders, every sidebar link opens.

    sphinx-build -b html docs docs/_build/html   # first: the site
    pytest -n 0 docs/test_site.py                # then: this check

Serves ``docs/_build/html`` (``OPTAX_ACCUM_DOCS_HTML`` elsewhere) on
127.0.0.1 and opens it with Playwright (``pytest-playwright``) driving the
system Chromium (``OPTAX_ACCUM_CHROMIUM``, default ``chromium`` on the
``PATH``; Debian: ``apt-get install chromium``), so no browser is
downloaded. Four pages (the index, an API page, a guide, a notebook) get
every check: a title and a heading, enough text, every image loaded (lazy
ones too), no error box (a docutils system message, an ``error``
admonition, a notebook error output or a traceback), no JavaScript
exception, no request the server answered with an error; their screenshots
go to ``docs/_build/smoke/`` and their paths are printed. Every page linked
from the left sidebar must open and pass the same checks but the text
length. The site runs offline here: requests to other hosts (the MathJax CDN,
the Colab badge) are refused and only listed.

Not under ``tests/``: the README's ``pytest`` runs before the site is built.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pytest_playwright")

DOCS = Path(__file__).resolve().parent
HTML = Path(os.environ.get("OPTAX_ACCUM_DOCS_HTML", DOCS / "_build" / "html"))
SHOTS = DOCS / "_build" / "smoke"
SIDEBAR = ".bd-sidebar-primary a.reference.internal"
# Runs in the page once it has loaded: loads lazy images, waits for every
# image (at most 15 s), then reports what the checks need.
INSPECT_JS = r"""
async () => {
  const images = [...document.images];
  for (const img of images) img.loading = "eager";
  const settled = img => img.complete ? null : new Promise(done => {
    img.addEventListener("load", done); img.addEventListener("error", done);
  });
  await Promise.race([
    Promise.all(images.map(settled)),
    new Promise(done => setTimeout(done, 15000)),
  ]);
  const text = document.body ? document.body.innerText : "";
  const main = document.querySelector("main, article, [role=main]") || document.body;
  const h1 = document.querySelector("main h1, article h1, h1");
  return {
    title: document.title,
    heading: h1 ? h1.innerText.trim() : "",
    images: images.length,
    brokenImages: images.filter(i => !(i.complete && i.naturalWidth > 0))
      .map(i => i.currentSrc || i.src).filter(u => u.startsWith(location.origin)),
    localImages: images.filter(i => i.src.startsWith(location.origin)).length,
    errorBoxes: [...document.querySelectorAll(
      ".system-message, .problematic, div.admonition.error, " +
      "div.admonition.danger, .output.error, .output.traceback, " +
      "div.cell_output .traceback"
    )].map(e => (e.className + ": " + e.innerText).slice(0, 300)),
    traceback: /Traceback \(most recent call last\)|CellExecutionError/.test(text),
    textLength: main.innerText.length,
  };
}
"""


def _first(folder: str, preferred: str | None = None) -> str:
    """``preferred`` in ``folder`` of the site, or its first page."""
    pages = sorted((HTML / folder).glob("*.html"))
    if not pages:
        pytest.fail(f"{HTML / folder} has no pages: is the site built?")
    chosen = HTML / folder / (preferred or pages[0].name)
    return (chosen if chosen.exists() else pages[0]).relative_to(HTML).as_posix()


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the site quietly and records every request's status."""

    requests: list[tuple[str, int]]

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        self.requests.append((self.path, int(code) if str(code).isdigit() else 0))

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="session")
def site() -> Iterator[tuple[str, list[tuple[str, int]]]]:
    """The site's address, and the requests it answered (path, status)."""
    if not (HTML / "index.html").exists():
        pytest.fail(f"no site in {HTML}: sphinx-build -b html docs docs/_build/html")
    requests: list[tuple[str, int]] = []
    handler = type("Handler", (_Handler,), {"requests": requests})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(HTML))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", requests
    server.shutdown()


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict) -> dict:
    """pytest-playwright's launch options, on the system Chromium."""
    chromium = os.environ.get("OPTAX_ACCUM_CHROMIUM") or shutil.which("chromium")
    if chromium is None:
        pytest.fail("no chromium on PATH (Debian: apt-get install chromium)")
    args = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]  # root, CI
    return {**browser_type_launch_args, "executable_path": chromium, "args": args}


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args: dict) -> dict:
    return {**browser_context_args, "viewport": {"width": 1280, "height": 900}}


def _open(page: Any, site: tuple, path: str) -> tuple[dict, list[str]]:
    """Opens ``path``; what the page reports, and the problems found."""
    base, requests = site
    del requests[:]
    errors: list[str] = []  # uncaught exceptions, unanswered requests
    external: set[str] = set()

    def route(r: Any) -> None:  # offline: other hosts are refused
        if r.request.url.startswith(base):
            r.continue_()
        else:
            external.add(r.request.url)
            r.abort()

    def exception(e: Any) -> None:
        errors.append(f"exception: {e}")

    def failed(r: Any) -> None:  # local requests that got no answer at all
        if r.url.startswith(base):
            errors.append(f"request failed: {r.url} ({r.failure})")

    page.route("**/*", route)
    page.on("pageerror", exception)
    page.on("requestfailed", failed)
    try:
        response = page.goto(base + path, wait_until="load")
        info = page.evaluate(INSPECT_JS)
    finally:
        page.unroute("**/*", route)
        page.remove_listener("pageerror", exception)
        page.remove_listener("requestfailed", failed)
    problems = (
        [] if response and response.ok else [f"HTTP {response and response.status}"]
    )
    if not info["title"].strip() or not info["heading"]:
        problems.append(f"no title or heading (title {info['title']!r})")
    if info["brokenImages"]:
        problems.append(f"images not loaded: {info['brokenImages']}")
    if info["errorBoxes"]:
        problems.append(f"error boxes: {info['errorBoxes']}")
    if info["traceback"]:
        problems.append("a traceback in the page text")
    problems += errors
    # Chromium asks for /favicon.ico by itself, at times, when a page names no
    # icon: not a request of the page's.
    problems += [
        f"request failed: {p} ({s})"
        for p, s in requests
        if s >= 400 and p != "/favicon.ico"
    ]
    if external:
        print(f"{path}: not loaded offline (other hosts): {sorted(external)}")
    return info, problems


PAGES = {
    "index": lambda: "index.html",
    "api": lambda: _first("api/generated", "optax_accum.accumulate.html"),
    "guide": lambda: _first("guides", "accumulate.html"),
    "notebook": lambda: _first("notebooks"),
}


@pytest.mark.parametrize("label", PAGES)
def test_page_renders(page: Any, site: tuple, label: str) -> None:
    path = PAGES[label]()
    info, problems = _open(page, site, path)
    if info["textLength"] < 200:
        problems.append(f"almost no text ({info['textLength']} characters)")
    if label == "notebook" and info["localImages"]:  # the first plot, not the top
        page.evaluate(
            "[...document.images].find(i => i.src.startsWith(location.origin))"
            ".scrollIntoView({block: 'center'})"
        )
        page.wait_for_timeout(500)
    SHOTS.mkdir(parents=True, exist_ok=True)
    shot = page.screenshot(path=SHOTS / f"smoke_{label}.png")
    print(f"screenshot: {SHOTS / f'smoke_{label}.png'} ({len(shot)} bytes)")
    assert not problems, f"{path}: {problems}"


def test_every_sidebar_page_opens(page: Any, site: tuple) -> None:
    base, _ = site
    page.goto(base + "index.html")
    links = page.eval_on_selector_all(SIDEBAR, "as => as.map(a => a.href)")
    paths = sorted({link.split("#")[0].removeprefix(base) for link in links})
    assert len(paths) >= 5, f"the left sidebar ({SIDEBAR}) has {paths}"
    failed = {}
    for path in paths:
        _, problems = _open(page, site, path or "index.html")
        if problems:
            failed[path] = problems
    assert not failed, failed
    print(f"sidebar: {len(paths)} pages open")
