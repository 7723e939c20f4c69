"""Pictures in chat requests: the parts each API sends (and LLM.chat takes), decoded within limits.

OpenAI chat: `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` and vLLM's
`{"type": "video_url", "video_url": {"url": "data:video/jpeg;base64,<frame>,<frame>,..."}}` (frames as images, one
base64 each, comma-separated, as vLLM takes them; they are read as sampled at the video preprocessing's fps).
Anthropic's `image` blocks (base64 source) and Responses' `input_image` parts are translated into the first form.
An http(s) URL is fetched only when the server was started with --allow-media-urls.

Each exceeded limit (pictures per request, bytes, pixels) and each undecodable picture is a MediaError (a
ValueError; the server answers it with a 400) that says which part and which limit; the decoded size is checked from
the header, before the pixels are decoded.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import re
import urllib.request
import warnings

from PIL import Image


_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w-]+=[^;,]*)*)(?P<b64>;base64)?,(?P<data>.*)",
                       re.DOTALL)
FETCH_TIMEOUT_SECONDS = 10


class MediaError(ValueError):
    """A picture that is malformed or over a limit; `where` names the request field ("messages.0.content.1")."""

    def __init__(self, message: str, where: str):
        super().__init__(message)
        self.where = where


@dataclasses.dataclass(frozen=True)
class MediaLimits:
    max_images: int = 16                   # images per request
    max_videos: int = 1                    # videos per request
    max_image_bytes: int = 10 << 20        # encoded bytes of one image (or one video frame)
    max_image_pixels: int = 4096 * 4096    # decoded width x height of one image (or frame)
    max_video_frames: int = 128
    allow_urls: bool = False               # fetch http(s) URLs (off: only data URLs)


@dataclasses.dataclass(frozen=True)
class MediaPart:
    """One picture of a request as its API sent it: a URL (data: or http(s)) and where it was."""
    kind: str                 # "image" | "video"
    url: str
    where: str                # the request field, for errors ("messages.0.content.1")


def openai_part_media(part: dict, where: str) -> MediaPart | None:
    """The picture of an OpenAI content part (image_url / video_url), or None for another kind of part."""
    kind = part.get("type")
    if kind not in ("image_url", "video_url"):
        return None
    value = part.get(kind)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise MediaError(f"{where}.{kind}.url must be a URL string (a data: URL, e.g. data:image/png;base64,...)",
                         where)
    return MediaPart("image" if kind == "image_url" else "video", url, where)


def decode_media(parts: list[MediaPart], limits: MediaLimits) -> tuple[list[Image.Image], list[list[Image.Image]]]:
    """(images, videos as frame lists), decoded in order; a MediaError naming the part on any limit or decoding
    error."""
    images = [p for p in parts if p.kind == "image"]
    videos = [p for p in parts if p.kind == "video"]
    if len(images) > limits.max_images:
        raise MediaError(f"the request has {len(images)} images; this server takes at most {limits.max_images} "
                         "per request", images[limits.max_images].where)
    if len(videos) > limits.max_videos:
        raise MediaError(f"the request has {len(videos)} videos; this server takes at most {limits.max_videos} "
                         "per request", videos[limits.max_videos].where)
    return ([_image(_payloads(p, limits)[0], p.where, limits) for p in images],
            [_video(p, limits) for p in videos])


def _video(part: MediaPart, limits: MediaLimits) -> list[Image.Image]:
    frames = _payloads(part, limits)
    if len(frames) > limits.max_video_frames:
        raise MediaError(f"{part.where}: the video has {len(frames)} frames; this server takes at most "
                         f"{limits.max_video_frames}", part.where)
    images = [_image(f, f"{part.where} frame {i}", limits) for i, f in enumerate(frames)]
    if len({im.size for im in images}) != 1:
        raise MediaError(f"{part.where}: the video's frames differ in size; send frames of one size", part.where)
    return images


def _payloads(part: MediaPart, limits: MediaLimits) -> list[bytes]:
    """The encoded picture(s) of a part: one for an image, each frame of a video."""
    url = part.url
    if url.startswith(("http://", "https://")):
        if not limits.allow_urls:
            raise MediaError(f"{part.where}: this server does not fetch {url.split(':')[0]} URLs; send the "
                             f"{part.kind} inline as a data URL (data:image/png;base64,...), or start the server "
                             "with --allow-media-urls", part.where)
        return [_fetch(url, part.where, limits)]
    match = _DATA_URL.fullmatch(url)
    if not url.startswith("data:") or match is None or not match.group("b64"):
        raise MediaError(f"{part.where}: the {part.kind} URL must be a base64 data URL "
                         "(data:image/png;base64,...) or http(s); got "
                         f"{url[:40]!r}{'...' if len(url) > 40 else ''}", part.where)
    chunks = match.group("data").split(",") if part.kind == "video" else [match.group("data")]
    out = []
    for i, chunk in enumerate(chunks):
        if len(chunk) * 3 // 4 > limits.max_image_bytes:
            raise MediaError(f"{part.where}: the {part.kind} is about {len(chunk) * 3 // 4} bytes; this server "
                             f"takes at most {limits.max_image_bytes} bytes per image", part.where)
        try:
            out.append(base64.b64decode(chunk, validate=True))
        except (binascii.Error, ValueError):
            raise MediaError(f"{part.where}: the {part.kind} data is not valid base64", part.where) from None
    return out


def _fetch(url: str, where: str, limits: MediaLimits) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_SECONDS) as response:
            data = response.read(limits.max_image_bytes + 1)
    except (OSError, ValueError) as e:
        raise MediaError(f"{where}: fetching {url!r} failed: {e}", where) from None
    if len(data) > limits.max_image_bytes:
        raise MediaError(f"{where}: {url!r} is more than {limits.max_image_bytes} bytes, this server's limit per "
                         "image", where)
    return data


def _image(data: bytes, where: str, limits: MediaLimits) -> Image.Image:
    if len(data) > limits.max_image_bytes:
        raise MediaError(f"{where}: the image is {len(data)} bytes; this server takes at most "
                         f"{limits.max_image_bytes} bytes per image", where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size            # from the header: nothing decoded yet
            if width * height > limits.max_image_pixels:
                raise MediaError(f"{where}: the image is {width}x{height} = {width * height} pixels; this server "
                                 f"takes at most {limits.max_image_pixels} pixels per image", where)
            image.load()
    except MediaError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"{where}: the image could not be decoded ({e}); send PNG, JPEG, WebP or GIF data",
                         where) from None
    return image
