"""Debian's Chromium, headless, driven through Playwright's Python API, for the dashboard tests.

Playwright's own browser builds are never used (`playwright install` is never run): the system
`chromium` is launched directly, with a fresh profile and no background networking. Tests skip
only when no chromium binary exists, and fail instead where STRATA_REQUIRE names chromium.
Every request the page makes is watched: one to a host other than the loopback is recorded and
refused.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from playwright.sync_api import BrowserContext, ConsoleMessage, Page, Route, sync_playwright
from required import require

CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync")
INSTALL_HINT = ("no chromium binary on PATH; install Debian's with `apt-get install -y "
                "--no-install-recommends chromium` (.ci/run does so when it runs as root)")
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found is not None:
            return found
    return None


def require_chromium() -> str:
    """The binary; without one, a skip (or a failure where STRATA_REQUIRE names chromium)."""
    require("chromium")
    binary = chromium_binary()
    assert binary is not None, "invariant chromium_found: require() returned"
    return binary


@contextmanager
def chromium(profile_dir: Path) -> Iterator[BrowserContext]:
    """A headless Chromium with a fresh profile in `profile_dir` (closed on exit)."""
    binary = require_chromium()
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile_dir), executable_path=binary, headless=True, args=list(CHROMIUM_FLAGS),
            viewport={"width": 1400, "height": 1000})
        try:
            yield context
        finally:
            context.close()


@dataclass
class WatchedPage:
    """A page and what it did: console errors, uncaught exceptions and every request."""

    page: Page
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # to a host off the loopback

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.console_errors.append(message.text)

    def _route(self, route: Route) -> None:
        url = route.request.url
        self.requests.append(url)
        if urlsplit(url).hostname not in LOOPBACK:
            self.refused.append(url)
            route.abort()
        else:
            route.continue_()


def watched_page(context: BrowserContext) -> WatchedPage:
    page = context.new_page()
    watched = WatchedPage(page)
    page.on("console", watched._console)
    page.on("pageerror", lambda error: watched.page_errors.append(str(error)))
    page.route("**/*", watched._route)
    page.on("dialog", lambda dialog: dialog.accept())  # the buttons' confirmations
    return watched


__all__ = ["CHROMIUM_FLAGS", "INSTALL_HINT", "WatchedPage", "chromium", "chromium_binary",
           "require_chromium", "watched_page"]
