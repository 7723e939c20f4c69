"""Pictures in chat requests: the parts each API sends (and LLM.chat takes), decoded within limits.

OpenAI chat: `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` and vLLM's
`{"type": "video_url", "video_url": {"url": "data:video/jpeg;base64,<frame>,<frame>,..."}}` (frames as images, one
base64 each, comma-separated, as vLLM takes them; they are read as sampled at the video preprocessing's fps).
Anthropic's `image` blocks (base64 source) and Responses' `input_image` parts are translated into the first form.
An http(s) URL is fetched only when the server was started with --allow-media-urls, within the address policy,
deadline and byte bound of qnext/vision/media_fetch.py.

Each exceeded limit (pictures per request, bytes, pixels per picture, pixels per request) and each undecodable
picture is a MediaError (a ValueError; the server answers it with a 400) that says which part and which limit.
`open_media` reads every picture's size from its header and checks the pixel limits before anything is decoded;
`OpenedMedia.decode` decodes them. Only PNG, JPEG, WebP and GIF are opened (no other PIL decoder runs).
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import re
import warnings

from PIL import Image

from qnext.vision.media_fetch import Deadline, FetchError, UrlAllowList, fetch


_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w-]+=[^;,]*)*)(?P<b64>;base64)?,(?P<data>.*)",
                       re.DOTALL)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


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
    max_request_pixels: int = 1 << 26      # decoded width x height of all of a request's images and frames
    max_video_frames: int = 128
    allow_urls: bool = False               # fetch http(s) URLs (off: only data URLs)
    url_allow: tuple[str, ...] = ()        # hosts and networks (CIDRs) fetched although not public
    fetch_timeout_s: float = 10.0          # all of a request's URL fetches together
    workers: int = 4                       # server threads that fetch, decode and preprocess pictures (their own)

    def __post_init__(self):
        for name, flag in (("max_request_pixels", "--max-request-pixels"), ("fetch_timeout_s", "--media-fetch-timeout"),
                           ("workers", "--media-workers")):
            if not getattr(self, name) > 0:
                raise ValueError(f"{flag} must be positive, got {getattr(self, name)}")
        object.__setattr__(self, "_allow", UrlAllowList(tuple(self.url_allow)))   # ValueError naming a bad entry

    @property
    def url_allow_list(self) -> UrlAllowList:
        return self._allow


@dataclasses.dataclass(frozen=True)
class MediaPart:
    """One picture of a request as its API sent it: a URL (data: or http(s)) and where it was."""
    kind: str                 # "image" | "video"
    url: str
    where: str                # the request field, for errors ("messages.0.content.1")


def has_media(messages: list) -> bool:
    """Whether any message's content list holds a picture part (image_url / video_url), without reading it."""
    return any(isinstance(part, dict) and part.get("type") in ("image_url", "video_url")
               for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
               for part in m["content"])


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


@dataclasses.dataclass
class OpenedMedia:
    """A request's pictures, opened: sizes read from the headers and checked, no pixel decoded yet."""
    images: list[Image.Image]
    videos: list[list[Image.Image]]            # frames, one size per video
    sources: list[tuple[Image.Image, str]]     # every image and frame with where it came from, for errors

    def decode(self) -> tuple[list[Image.Image], list[list[Image.Image]]]:
        """(images, videos as frame lists), decoded; a MediaError naming the part that cannot be."""
        for image, where in self.sources:
            try:
                image.load()
            except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
                raise MediaError(f"{where}: the image could not be decoded ({e}); send PNG, JPEG, WebP or GIF "
                                 "data", where) from None
        return self.images, self.videos


def decode_media(parts: list[MediaPart], limits: MediaLimits) -> tuple[list[Image.Image], list[list[Image.Image]]]:
    """(images, videos as frame lists), decoded in order; a MediaError naming the part on any limit or decoding
    error."""
    return open_media(parts, limits).decode()


def open_media(parts: list[MediaPart], limits: MediaLimits) -> OpenedMedia:
    """The parts' pictures opened in order (URLs fetched under one deadline), every limit checked from the headers
    before any pixel is decoded; a MediaError naming the part."""
    images = [p for p in parts if p.kind == "image"]
    videos = [p for p in parts if p.kind == "video"]
    if len(images) > limits.max_images:
        raise MediaError(f"the request has {len(images)} images; this server takes at most {limits.max_images} "
                         "per request", images[limits.max_images].where)
    if len(videos) > limits.max_videos:
        raise MediaError(f"the request has {len(videos)} videos; this server takes at most {limits.max_videos} "
                         "per request", videos[limits.max_videos].where)
    deadline = Deadline(limits.fetch_timeout_s)
    budget = _PixelBudget(limits)
    opened = OpenedMedia([], [], [])
    for part in parts:
        payloads = _payloads(part, limits, deadline)
        if part.kind == "video" and len(payloads) > limits.max_video_frames:
            raise MediaError(f"{part.where}: the video has {len(payloads)} frames; this server takes at most "
                             f"{limits.max_video_frames}", part.where)
        frames = []
        for i, data in enumerate(payloads):
            where = part.where if part.kind == "image" else f"{part.where} frame {i}"
            frames.append(_open(data, where, limits))
            budget.take(frames[-1], where, part.where)
            opened.sources.append((frames[-1], where))
        if part.kind == "image":
            opened.images.append(frames[0])
        elif len({im.size for im in frames}) != 1:
            raise MediaError(f"{part.where}: the video's frames differ in size; send frames of one size", part.where)
        else:
            opened.videos.append(frames)
    return opened


class _PixelBudget:
    """The decoded pixels of a request's pictures so far, against max_request_pixels."""

    def __init__(self, limits: MediaLimits):
        self.limit, self.used = limits.max_request_pixels, 0

    def take(self, image: Image.Image, what: str, where: str) -> None:
        self.used += image.width * image.height
        if self.used > self.limit:
            raise MediaError(f"{what}: the request's pictures decode to more than {self.limit} pixels (width x "
                             f"height summed over its images and video frames: {self.used} so far); this server "
                             "takes at most that many per request (--max-request-pixels); send fewer or smaller "
                             "pictures", where)


def _payloads(part: MediaPart, limits: MediaLimits, deadline: Deadline) -> list[bytes]:
    """The encoded picture(s) of a part: one for an image, each frame of a video."""
    url = part.url
    if url.startswith(("http://", "https://")):
        if not limits.allow_urls:
            raise MediaError(f"{part.where}: this server does not fetch {url.split(':')[0]} URLs; send the "
                             f"{part.kind} inline as a data URL (data:image/png;base64,...), or start the server "
                             "with --allow-media-urls", part.where)
        try:
            return [fetch(url, limits.max_image_bytes, limits.url_allow_list, deadline)]
        except FetchError as e:
            raise MediaError(f"{part.where}: {e}", part.where) from None
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


def _open(data: bytes, where: str, limits: MediaLimits) -> Image.Image:
    """The picture opened (its header read, its size checked), not decoded."""
    if len(data) > limits.max_image_bytes:
        raise MediaError(f"{where}: the image is {len(data)} bytes; this server takes at most "
                         f"{limits.max_image_bytes} bytes per image", where)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"{where}: the image could not be decoded ({e}); send PNG, JPEG, WebP or GIF data",
                         where) from None
    width, height = image.size                # from the header: nothing decoded yet
    if width * height > limits.max_image_pixels:
        raise MediaError(f"{where}: the image is {width}x{height} = {width * height} pixels; this server takes at "
                         f"most {limits.max_image_pixels} pixels per image (--max-image-pixels)", where)
    return image


def cap_decoder_pixels(max_image_pixels: int) -> None:
    """Lowers PIL's own decompression-bomb bound (Image.MAX_IMAGE_PIXELS, process-wide) to the server's per-picture
    limit, so that a picture past it is refused by the decoder too (PIL errors at twice the bound). Never raises it."""
    if Image.MAX_IMAGE_PIXELS is None or Image.MAX_IMAGE_PIXELS > max_image_pixels:
        Image.MAX_IMAGE_PIXELS = max_image_pixels
