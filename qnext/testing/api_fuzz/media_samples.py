"""The picture URLs the fuzz cases send: a few good data URLs and many bad ones. No URL names another host: the
http(s) and ftp ones point at loopback's discard port, and the server refuses them anyway unless it was started
with --allow-media-urls, which the fuzz never does."""
from __future__ import annotations

import base64
import io

from PIL import Image


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(out, format="PNG")
    return out.getvalue()


def _jpeg(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 120, 200)).save(out, format="JPEG")
    return out.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _tall_png_header() -> bytes:
    """A valid PNG header announcing 100000 x 100000 pixels (a decompression bomb's shape), and nothing after it."""
    png = bytearray(_png(1, 1))
    png[16:24] = (100000).to_bytes(4, "big") * 2          # IHDR width, height (the CRC no longer matches)
    return bytes(png[:33])


# One size for every good picture: each new size compiles the vision tower again.
GOOD_IMAGES = {"image/png": _b64(_png(32, 32)), "image/jpeg": _b64(_jpeg(32, 32))}
BAD_BASE64 = {
    "not base64": "!!!not-base64!!!",
    "text": _b64(b"hello, I am not an image"),
    "truncated png": _b64(_png(8, 8)[:30]),
    "bomb header": _b64(_tall_png_header()),
    "empty": "",
    "padding": "QQ=",
    "nul bytes": _b64(bytes(64)),
}
BASE64_DATA = [*GOOD_IMAGES.values(), *BAD_BASE64.values()]
IMAGE_MEDIA_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif", "text/plain", "", "image/svg+xml"]

GOOD_IMAGE_URLS = [f"data:{kind};base64,{data}" for kind, data in GOOD_IMAGES.items()]
BAD_IMAGE_URLS = [
    *(f"data:image/png;base64,{data}" for data in BAD_BASE64.values()),
    "data:text/plain;base64," + _b64(b"plain text"),
    "data:image/png,not-base64-at-all",
    "data:;base64,",
    "data:",
    "",
    "http://127.0.0.1:9/none.png",
    "https://127.0.0.1:9/none.png",
    "file:///etc/passwd",
    "ftp://127.0.0.1:9/none.png",
]
IMAGE_URLS = GOOD_IMAGE_URLS + BAD_IMAGE_URLS
# A video as a data URL of comma-separated base64 frames (qnext/vision/media.py).
VIDEO_URLS = [
    "data:video/jpeg;base64," + ",".join([GOOD_IMAGES["image/jpeg"]] * 2),
    "data:video/jpeg;base64," + ",".join([GOOD_IMAGES["image/jpeg"], _b64(_png(16, 16))]),     # sizes differ
    "data:video/jpeg;base64,,,",
    "data:video/mp4;base64," + _b64(b"\x00\x00\x00\x18ftypmp42"),
    "http://127.0.0.1:9/none.mp4",
]
