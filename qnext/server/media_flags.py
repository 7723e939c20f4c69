"""`qnext serve` flags for pictures in requests (qnext/vision/media.py's MediaLimits), vLLM's name where it has one."""
from __future__ import annotations

import argparse

from qnext.server.flag_values import json_object
from qnext.vision.media import MediaLimits

_DEFAULT = MediaLimits()


def add_media_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit-mm-per-prompt", type=json_object, default=None, metavar="JSON",
                   help=f"pictures per request, e.g. '{{\"image\": 4, \"video\": 1}}' (default: "
                        f"{_DEFAULT.max_images} images, {_DEFAULT.max_videos} video)")
    p.add_argument("--max-image-bytes", type=int, default=_DEFAULT.max_image_bytes,
                   help="encoded bytes of one image or video frame; more is a 400")
    p.add_argument("--max-image-pixels", type=int, default=_DEFAULT.max_image_pixels,
                   help="decoded width x height of one image or video frame; more is a 400")
    p.add_argument("--max-request-pixels", type=int, default=_DEFAULT.max_request_pixels,
                   help="decoded width x height of all of a request's images and video frames together, checked "
                        "from their headers before decoding; more is a 400")
    p.add_argument("--media-workers", type=int, default=_DEFAULT.workers,
                   help="threads that fetch, decode and preprocess pictures, a pool of their own (text requests "
                        "never wait on it)")
    p.add_argument("--allow-media-urls", action="store_true",
                   help="fetch http(s) image URLs from public addresses, no redirects (off: only data URLs; a URL "
                        "is a 400 that says so)")
    p.add_argument("--media-fetch-timeout", type=float, default=_DEFAULT.fetch_timeout_s, metavar="SECONDS",
                   help="one deadline for all of a request's URL fetches (resolution, connection, headers, body)")
    p.add_argument("--media-url-allow", action="append", default=[], metavar="HOST_OR_CIDR",
                   help="a host name or network fetched although not public (private, loopback, ...); repeat for "
                        "more (default: none)")


def media_limits(args: argparse.Namespace) -> MediaLimits:
    per_prompt = args.limit_mm_per_prompt or {}
    unknown = sorted(set(per_prompt) - {"image", "video"})
    if unknown:
        raise ValueError(f"--limit-mm-per-prompt has unknown keys {unknown}; it takes 'image' and 'video'")
    return MediaLimits(max_images=int(per_prompt.get("image", _DEFAULT.max_images)),
                       max_videos=int(per_prompt.get("video", _DEFAULT.max_videos)),
                       max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
                       max_request_pixels=args.max_request_pixels, allow_urls=args.allow_media_urls,
                       url_allow=tuple(args.media_url_allow), fetch_timeout_s=args.media_fetch_timeout,
                       workers=args.media_workers)
