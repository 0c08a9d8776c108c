# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Opens the built docs in headless Chromium and checks that they render.

    python docs/smoke_check.py [--html docs/_build/html] [--out DIR]

Serves the built site on 127.0.0.1 (a free port), opens three pages, the
index, an API page and a notebook page, and checks each: a title and a
heading, every image loaded (lazy ones too), no error box (a docutils system
message, an ``error`` admonition, a notebook error output or a traceback), no
JavaScript exception, and no request the server answered with an error. It
saves a screenshot of each page and prints their paths; the exit status is 1
if any check failed.

Standard library only. Chromium is driven over the DevTools protocol on a
pipe (``--remote-debugging-pipe``), so no driver and no download are needed;
it must be installed (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
VIEWPORT = {"width": 1280, "height": 900, "deviceScaleFactor": 1, "mobile": False}
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
]
# Runs in the page once it has loaded: loads lazy images, waits for every
# image (at most 15 s), then reports what the checks need.
INSPECT_JS = r"""
(async () => {
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
  const errorBoxes = [...document.querySelectorAll(
    ".system-message, .problematic, div.admonition.error, " +
    "div.admonition.danger, .output.error, .output.traceback, " +
    "div.cell_output .traceback"
  )].map(e => (e.className + ": " + e.innerText).slice(0, 300));
  const h1 = document.querySelector("main h1, article h1, h1");
  const main = document.querySelector("main, article, [role=main]") || document.body;
  return {
    title: document.title,
    heading: h1 ? h1.innerText.trim() : "",
    images: images.length,
    brokenImages: images.filter(i => !(i.complete && i.naturalWidth > 0))
      .map(i => i.currentSrc || i.src),
    localImages: images.filter(i => i.src.startsWith(location.origin)).length,
    errorBoxes,
    traceback: /Traceback \(most recent call last\)|CellExecutionError/.test(text),
    textLength: main.innerText.length,
  };
})()
"""


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the site quietly and records every request's status."""

    requests: list[tuple[str, int]]

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        self.requests.append((self.path, int(code) if str(code).isdigit() else 0))

    def log_message(self, format: str, *args: Any) -> None:
        pass


class DevTools:
    """The DevTools protocol over Chromium's pipe: commands and their events."""

    def __init__(self, write_fd: int, read_fd: int, timeout: float):
        self._write, self._read, self._timeout = write_fd, read_fd, timeout
        self._buffer, self._next_id = b"", 0
        self.events: list[dict[str, Any]] = []

    def _messages(self, deadline: float):
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                yield json.loads(raw)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise ConnectionError("Chromium closed the DevTools pipe")
            self._buffer += chunk

    def send(self, method: str, session: str | None = None, **params: Any) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        for reply in self._messages(time.monotonic() + self._timeout):
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)
        raise AssertionError("unreachable")

    def wait_for(self, method: str, session: str) -> dict:
        for i, event in enumerate(self.events):
            if event.get("method") == method and event.get("sessionId") == session:
                return self.events.pop(i)
        for event in self._messages(time.monotonic() + self._timeout):
            if event.get("method") == method and event.get("sessionId") == session:
                return event
            self.events.append(event)
        raise AssertionError("unreachable")


def _find_chromium(given: str | None) -> str:
    for name in [given] if given else ["chromium", "chromium-browser", "chrome"]:
        path = shutil.which(name)
        if path:
            return path
    sys.exit("smoke check: no Chromium found (Debian: apt-get install -y chromium)")


def _pages(html: Path) -> list[tuple[str, str]]:
    """(label, path) of the index, an API page, a guide and a notebook page."""
    api = sorted((html / "api" / "generated").glob("*.html"))
    preferred = html / "api" / "generated" / "optax_accum.accumulate.html"
    guides = sorted((html / "guides").glob("*.html"))
    preferred_guide = html / "guides" / "accumulate.html"
    notebooks = sorted((html / "notebooks").glob("*.html"))
    # A notebook page with a plot (an image of the site), where one has any.
    with_plot = [p for p in notebooks if "_images/" in p.read_text(errors="replace")]
    missing = [
        what
        for what, found in [("API", api), ("guide", guides), ("notebook", notebooks)]
        if not found
    ]
    if missing or not (html / "index.html").exists():
        sys.exit(f"smoke check: {html} lacks pages: index, {', '.join(missing)}")
    api_page = preferred if preferred.exists() else api[0]
    guide = preferred_guide if preferred_guide.exists() else guides[0]
    notebook = (with_plot or notebooks)[0]
    return [
        ("index", "index.html"),
        ("api", api_page.relative_to(html).as_posix()),
        ("guide", guide.relative_to(html).as_posix()),
        ("notebook", notebook.relative_to(html).as_posix()),
    ]


def _external(url: str, base: str) -> bool:
    return url.startswith(("http://", "https://")) and not url.startswith(base)


def _check(info: dict[str, Any], js_errors: list[str]) -> list[str]:
    problems = []
    if not info["title"].strip() or not info["heading"]:
        problems.append(f"no title or heading (title {info['title']!r})")
    if info["textLength"] < 200:
        problems.append(f"almost no text ({info['textLength']} characters)")
    if info["brokenImages"]:
        problems.append(f"images not loaded: {info['brokenImages']}")
    if info["errorBoxes"]:
        problems.append(f"error boxes: {info['errorBoxes']}")
    if info["traceback"]:
        problems.append("a traceback in the page text")
    if js_errors:
        problems.append(f"JavaScript errors: {js_errors}")
    return problems


def run(html: Path, out: Path, chromium: str, timeout: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    pages = _pages(html)
    requests: list[tuple[str, int]] = []
    handler = functools.partial(
        type("Handler", (_Handler,), {"requests": requests}), directory=str(html)
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"

    to_chrome_r, to_chrome_w = os.pipe()
    from_chrome_r, from_chrome_w = os.pipe()
    profile = tempfile.mkdtemp(prefix="optax_accum_smoke_")
    # The shell puts the pipe on fds 3 and 4, where Chromium expects it.
    command = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}'
    browser = subprocess.Popen(
        ["sh", "-c", command, chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}"],
        pass_fds=(to_chrome_r, from_chrome_w),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(to_chrome_r)
    os.close(from_chrome_w)
    failures = 0
    try:
        tools = DevTools(to_chrome_w, from_chrome_r, timeout)
        target = tools.send("Target.createTarget", url="about:blank")["targetId"]
        session = tools.send("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Log"):
            tools.send(f"{domain}.enable", session)
        tools.send("Emulation.setDeviceMetricsOverride", session, **VIEWPORT)
        for label, path in pages:
            url = base + path
            tools.events.clear()
            del requests[:]
            tools.send("Page.navigate", session, url=url)
            tools.wait_for("Page.loadEventFired", session)
            info = tools.send(
                "Runtime.evaluate",
                session,
                expression=INSPECT_JS,
                awaitPromise=True,
                returnByValue=True,
            )["result"]["value"]
            # The site runs offline here: what it loads from other hosts (the
            # MathJax CDN, the Colab badge) cannot load, and is only listed.
            external = {u for u in info["brokenImages"] if _external(u, base)}
            info["brokenImages"] = [
                u for u in info["brokenImages"] if u not in external
            ]
            js_errors = []
            for event in tools.events:
                if event.get("method") == "Runtime.exceptionThrown":
                    details = event["params"]["exceptionDetails"]
                    js_errors.append(details.get("text", "exception"))
                elif event.get("method") == "Log.entryAdded":
                    entry = event["params"]["entry"]
                    if entry["level"] != "error":
                        continue
                    if _external(entry.get("url", ""), base):
                        external.add(entry["url"])
                    else:
                        js_errors.append(f"{entry['text']} {entry.get('url', '')}")
            problems = _check(info, js_errors)
            failed = [f"{p} ({s})" for p, s in requests if s >= 400]
            if failed:
                problems.append(f"requests that failed: {failed}")
            if label == "notebook" and info["localImages"]:
                # Show the first plot, not only the top of the page.
                tools.send(
                    "Runtime.evaluate",
                    session,
                    expression="[...document.images].find(i => i.src.startsWith("
                    "location.origin)).scrollIntoView({block: 'center'})",
                )
                time.sleep(0.5)
            shot = tools.send("Page.captureScreenshot", session, format="png")
            png = out / f"smoke_{label}.png"
            png.write_bytes(base64.b64decode(shot["data"]))
            status = "FAIL" if problems else "ok"
            print(
                f"{status}: {label} page {path}: title {info['title']!r}, "
                f"{info['localImages']} of {info['images']} image(s) from the "
                f"site, {len(requests)} request(s) served"
            )
            if external:
                print(f"    not loaded offline (other hosts): {sorted(external)}")
            for problem in problems:
                print(f"    {problem}")
            print(f"screenshot: {png}")
            failures += bool(problems)
        tools.send("Browser.close")
    finally:
        try:
            browser.wait(timeout=10)
        except subprocess.TimeoutExpired:
            browser.kill()
            browser.wait()
        os.close(to_chrome_w)
        os.close(from_chrome_r)
        server.shutdown()
        shutil.rmtree(profile, ignore_errors=True)
    verdict = f"{failures} of {len(pages)} pages failed" if failures else "all render"
    print(f"smoke check: {verdict} ({', '.join(label for label, _ in pages)})")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--html", type=Path, default=DOCS / "_build" / "html")
    parser.add_argument("--out", type=Path, default=DOCS / "_build" / "smoke")
    parser.add_argument("--chromium", help="the browser (default: chromium on PATH)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per step")
    args = parser.parse_args(argv)
    return run(
        args.html.resolve(),
        args.out.resolve(),
        _find_chromium(args.chromium),
        args.timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
