"""Take the status page's screenshot for the README (docs/status-page.png), from a real deployment.

    PATH=.venv/bin:$PATH .venv/bin/python -m tests.e2e.status_page_screenshot docs/status-page.png

Three real Envoys take version 2b, then version 3, which breaks the clusters (``connect_timeout:
0s``, served with ``--validate off``): each Envoy NACKs CDS and takes the rest. A headless
Chromium (:mod:`.browser`) opens the page, waits until it shows the NACKs, and captures it. Every
process runs in a temp dir and is killed by PID at the end (the test machinery's own).

Chromium's PNG is true colour (~230 KB); :func:`palette_png` re-encodes it with the 256 colours
it uses most (each other one, a few pixels of anti-aliased text, becomes the nearest of them), which
the eye cannot tell apart and which takes a third of the bytes.
"""

from __future__ import annotations

import functools
import struct
import sys
import tempfile
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from .browser import Browser
from .event_log import CDS, EDS, RDS, is_event
from .processes import ProcessGroup, wait_until
from .test_admin_status import V2, V2B, V3
from .testbed import Testbed, wait_for_acks

NODES = ("edge-eu-1", "edge-eu-2", "edge-us-1")
WIDTH = 1000
"""CSS pixels (and PNG pixels: scale 1)."""


def _chunks(png: bytes) -> Iterator[tuple[bytes, bytes]]:
    pos = 8
    while pos < len(png):
        size, kind = struct.unpack(">I4s", png[pos : pos + 8])
        yield kind, png[pos + 8 : pos + 8 + size]
        pos += 12 + size


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _rows(png: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and the unfiltered rows (RGB) of an 8-bit RGB PNG, not interlaced."""
    header = next(body for kind, body in _chunks(png) if kind == b"IHDR")
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    if (depth, colour, interlace) != (8, 2, 0):
        raise ValueError(f"expected an 8-bit RGB PNG, not interlaced; got depth {depth}, colour type {colour}")
    raw = zlib.decompress(b"".join(body for kind, body in _chunks(png) if kind == b"IDAT"))
    stride, pos, rows = width * 3, 0, []
    above = bytearray(stride)
    for _ in range(height):  # the five filters of the PNG spec, section 9
        kind, line = raw[pos], bytearray(raw[pos + 1 : pos + 1 + stride])
        pos += 1 + stride
        if kind == 1:
            for i in range(3, stride):
                line[i] = (line[i] + line[i - 3]) & 255
        elif kind == 2:
            line = bytearray((x + b) & 255 for x, b in zip(line, above, strict=True))
        elif kind == 3:
            for i in range(stride):
                line[i] = (line[i] + ((line[i - 3] if i >= 3 else 0) + above[i]) // 2) & 255
        elif kind == 4:
            for i in range(stride):
                a, b, c = (line[i - 3], above[i], above[i - 3]) if i >= 3 else (0, above[i], 0)
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        above = line
    return width, height, rows


def palette_png(png: bytes, colours: int = 256) -> bytes:
    """``png`` (8-bit RGB) as a palette PNG of its ``colours`` most used colours."""
    width, height, rows = _rows(png)
    counts = Counter(row[i : i + 3] for row in rows for i in range(0, len(row), 3))
    palette = [colour for colour, _ in counts.most_common(colours)]
    index = {colour: n for n, colour in enumerate(palette)}

    def distance(colour: bytes, n: int) -> int:
        return sum((x - y) ** 2 for x, y in zip(colour, palette[n], strict=True))

    for colour in counts:
        if colour not in index:
            index[colour] = min(range(len(palette)), key=functools.partial(distance, colour))
    pixels = b"".join(b"\0" + bytes(index[row[i : i + 3]] for i in range(0, len(row), 3)) for row in rows)
    header = struct.pack(">IIBBBBB", width, height, 8, 3, 0, 0, 0)
    return (
        png[:8]
        + _chunk(b"IHDR", header)
        + _chunk(b"PLTE", b"".join(palette))
        + _chunk(b"IDAT", zlib.compress(pixels, 9))
        + _chunk(b"IEND", b"")
    )


def main(out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="status-page-") as workdir:
        group = ProcessGroup(Path(workdir))
        browser = None
        try:
            testbed = Testbed.create(group)
            testbed.control_plane.options = ("--validate", "off")
            testbed.write_snapshot(**V2)
            testbed.control_plane.start()
            for n, node in enumerate(NODES):
                testbed.start_envoy(name=f"envoy-{n}", node_id=node, cluster=node.rsplit("-", 1)[0])
                wait_for_acks(testbed.events, node=node, what=f"{node}'s configuration")
            mark = testbed.events.mark()
            testbed.write_snapshot(**V2B)
            for node in NODES:
                wait_for_acks(  # the types 2b changed (versions are per type)
                    testbed.events, node=node, types=(EDS, RDS), version="2b", after=mark, what=f"{node} at 2b"
                )
            testbed.write_snapshot(**V3)
            for node in NODES:
                testbed.events.wait_for(is_event("nack", node=node, type=CDS), after=mark, what=f"{node}'s NACK")

            browser = Browser.start(Path(workdir))
            page = browser.open(f"http://{testbed.control_plane.admin}/", width=WIDTH, height=1500)
            wait_until(
                lambda: page.evaluate("document.querySelectorAll('#nacks tr.nack').length") == len(NODES),
                timeout=20,
                what="the page to show every NACK",
            )
            # Down to the sixth recent event: the rest is more of the same, and the PNG stays small.
            height = page.evaluate(
                "Math.ceil(document.querySelectorAll('#events li')[5].getBoundingClientRect().bottom) + 12"
            )
            page.resize(WIDTH, int(height))
            wait_until(
                lambda: page.evaluate("document.querySelectorAll('#nacks tr.nack').length") == len(NODES),
                timeout=10,
                what="the page to draw again",
            )
            shot = page.screenshot()
            out.write_bytes(palette_png(shot))
            print(f"wrote {out} ({out.stat().st_size:,} bytes; {len(shot):,} as Chromium made it)")
        finally:
            if browser is not None:
                browser.close()
            group.close()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/status-page.png"))
