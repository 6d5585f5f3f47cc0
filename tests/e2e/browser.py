"""A real headless Chromium, driven over the Chrome DevTools Protocol (CDP) by a small client on
aiohttp's websocket client: enough to open a page, read its DOM and take a screenshot.

:meth:`Browser.start` runs ``chromium --headless --remote-debugging-port=0`` with its own profile
directory, in its own process group, and reads the DevTools address from its stderr ("DevTools
listening on ws://..."), polling with a timeout. Every host name but 127.0.0.1 resolves to nothing
(``--host-resolver-rules``), and the background services that would call out are off.
:meth:`Browser.close` asks it to quit, then kills its process group by the PID it started.

The e2e tests are plain functions that block (they poll processes and files), so the client is
synchronous on the outside: it runs its own event loop, only while a command is on its way. CDP
commands are JSON messages with an ``id``; the answer carries the same ``id``, and events (which
carry none) are skipped. A page is one target, attached with ``flatten``: its commands carry the
session id.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

__all__ = ["Browser", "Page", "chromium_binary"]

_DEVTOOLS = re.compile(r"DevTools listening on (ws://\S+)")


def chromium_binary() -> str:
    """The ``chromium`` command; fail the test, saying what to install, if there is none."""
    found = shutil.which("chromium")
    if found is None:
        pytest.fail(
            "the status page tests need a real browser: install the Debian package `chromium` "
            "(apt-get install chromium; `make setup` does)",
            pytrace=False,
        )
    return found


class Browser:
    """One headless Chromium (see the module's docstring)."""

    def __init__(self, process: subprocess.Popen[bytes], profile: Path, stderr_path: Path) -> None:
        self.process = process
        self.profile = profile
        self.stderr_path = stderr_path
        self._loop = asyncio.new_event_loop()
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)

    @classmethod
    def start(cls, workdir: Path, *, timeout: float = 30.0) -> Browser:
        """Start Chromium (its profile and its output in ``workdir``) and connect to it."""
        binary = chromium_binary()
        profile = Path(tempfile.mkdtemp(prefix="chromium-profile-", dir=workdir))
        stderr_path = workdir / "chromium.err"
        argv = [
            binary, "--headless", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
            f"--user-data-dir={profile}", "--no-first-run", "--no-default-browser-check", "--disable-gpu",
            "--disable-extensions", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--disable-domain-reliability", "--disable-client-side-phishing-detection",
            "--no-pings", "--mute-audio", "--hide-scrollbars", "--disable-dev-shm-usage",
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "about:blank",
        ]  # fmt: skip
        if os.geteuid() == 0:
            argv.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        with stderr_path.open("wb") as stderr:
            process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
            )
        browser = cls(process, profile, stderr_path)
        try:
            url = browser._devtools_url(timeout)
            browser._run(browser._connect(url))
        except BaseException:
            browser.close()
            raise
        return browser

    def _devtools_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.stderr_path.read_text(errors="replace")
            found = _DEVTOOLS.search(text)
            if found:
                return found.group(1)
            if self.process.poll() is not None:
                pytest.fail(
                    f"chromium exited ({self.process.returncode}) before it listened:\n{text[-2000:]}", pytrace=False
                )
            if time.monotonic() >= deadline:
                pytest.fail(
                    f"chromium did not say where DevTools listen within {timeout:g}s:\n{text[-2000:]}", pytrace=False
                )
            time.sleep(0.05)

    def _run(self, coroutine: Any) -> Any:
        return self._loop.run_until_complete(coroutine)

    async def _connect(self, url: str) -> None:
        self._session = aiohttp.ClientSession()
        # Screenshots arrive as one base64 message of a few MB.
        self._ws = await self._session.ws_connect(url, max_msg_size=64 * 1024 * 1024)

    async def _call(self, method: str, params: dict[str, Any], session: str | None, timeout: float) -> Any:
        ws = self._ws
        assert ws is not None, "the browser is not connected"
        message_id = next(self._ids)
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        await ws.send_json(message)
        async with asyncio.timeout(timeout):
            while True:
                answer = await ws.receive()
                if answer.type is not aiohttp.WSMsgType.TEXT:
                    raise RuntimeError(f"the DevTools connection ended ({answer.type.name}) during {method}")
                data = answer.json()
                if data.get("id") != message_id:
                    continue  # an event, or the answer to a command that timed out before
                if "error" in data:
                    raise RuntimeError(f"{method} failed: {data['error']}")
                return data.get("result", {})

    def call(
        self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None, timeout: float = 30.0
    ) -> Any:
        """Send one CDP command (to the browser, or to a page's ``session``) and return its result."""
        return self._run(self._call(method, params or {}, session, timeout))

    def open(self, url: str, *, width: int = 1200, height: int = 900) -> Page:
        """A new tab of ``width`` x ``height`` CSS pixels showing ``url``."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        page.resize(width, height)
        page.navigate(url)
        return page

    def close(self) -> None:
        """Quit Chromium, kill whatever of its process group is left (by the PID started), and
        remove its profile."""
        try:
            if self._ws is not None and not self._ws.closed:
                with contextlib.suppress(RuntimeError, TimeoutError, aiohttp.ClientError):
                    self.call("Browser.close", timeout=5)
                self._run(self._ws.close())
            if self._session is not None:
                self._run(self._session.close())
        finally:
            self._loop.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)  # its group: the renderer, GPU, zygote
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    """One tab of a :class:`Browser`."""

    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session

    def call(self, method: str, params: dict[str, Any] | None = None, *, timeout: float = 30.0) -> Any:
        return self.browser.call(method, params, session=self.session, timeout=timeout)

    def resize(self, width: int, height: int, *, mobile: bool = False, scale: float = 1.0) -> None:
        """Emulate a screen of ``width`` x ``height`` CSS pixels (``mobile``: a phone's viewport)."""
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": scale, "mobile": mobile},
        )

    def navigate(self, url: str) -> None:
        """Load ``url``; returns once its document is there (the test then polls the DOM)."""
        answer = self.call("Page.navigate", {"url": url})
        if answer.get("errorText"):
            raise RuntimeError(f"loading {url} failed: {answer['errorText']}")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-like values come back as such)."""
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError(f"{expression[:80]!r} threw: {details.get('exception', {}).get('description', details)}")
        return result["result"].get("value")

    def screenshot(self) -> bytes:
        """A PNG of what the page's viewport shows (RGB, 8 bits per channel)."""
        data: bytes = base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"})["data"])
        return data
