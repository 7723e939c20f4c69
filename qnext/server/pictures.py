"""A chat's pictures, from the parts the APIs sent to what the engine takes: opened within the server's limits
(qnext/vision/media.py), checked to fit max_model_len, decoded, preprocessed for the served checkpoint's tower, and
the rendered prompt's placeholders expanded to one pad per merged patch. A checkpoint without a tower answers a
picture with a 400 that says so.

The fit is checked before any pixel is decoded: each picture's pad tokens follow from its header's size by the
arithmetic preprocessing uses (preprocess.image_grid / video_grid), and the prompt with its placeholders is
tokenized, so a prompt that cannot fit is refused without decoding or preprocessing its pictures."""
from __future__ import annotations

from typing import Callable

from qnext.engine.visual_intake import NO_TOWER
from qnext.engine.visual_request import expand_placeholders
from qnext.server.errors import bad_request
from qnext.vision.media import MediaError, MediaLimits, MediaPart, OpenedMedia, cap_decoder_pixels, open_media
from qnext.vision.preprocess import grid_tokens, image_grid, preprocess_image, preprocess_video, video_grid


class PictureInputs:
    def __init__(self, vision, limits: MediaLimits, count_tokens: Callable[[str], int] | None = None,
                 max_model_len: int | None = None):
        """vision: the engine's VisionSetup (None: text only); count_tokens(text) and max_model_len: for the fit
        check (None: none)."""
        self.vision, self.limits = vision, limits
        self.count_tokens, self.max_model_len = count_tokens, max_model_len
        cap_decoder_pixels(limits.max_image_pixels)

    def expand(self, prompt: str, media: list[MediaPart]) -> tuple[str, dict]:
        """(the prompt with its placeholders expanded, multi_modal_data of preprocessed inputs)."""
        if self.vision is None:
            raise bad_request(NO_TOWER, media[0].where)
        try:
            opened = open_media(media, self.limits)
            self.check_fit(prompt, opened)
            images, videos = opened.decode()
        except MediaError as e:
            raise bad_request(str(e), e.where) from None
        try:
            visual_images = [preprocess_image(im, self.vision.image_preprocess) for im in images]
            visual_videos = [preprocess_video(frames, self.vision.video_preprocess.fps, self.vision.video_preprocess)
                             for frames in videos]
            prompt, _ = expand_placeholders(prompt, visual_images, visual_videos)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        return prompt, {"image": visual_images, "video": visual_videos}

    def check_fit(self, prompt: str, opened: OpenedMedia) -> None:
        """A 400 when the prompt's tokens with each picture's pads leave no room in max_model_len. A lower bound:
        each placeholder (one pad) becomes the picture's pads (a video's frame groups add their timestamps too)."""
        if self.count_tokens is None or self.max_model_len is None:
            return
        image_cfg, video_cfg = self.vision.image_preprocess, self.vision.video_preprocess
        try:
            pads = [grid_tokens(image_grid(im.height, im.width, image_cfg), image_cfg) for im in opened.images]
            pads += [grid_tokens(video_grid(len(frames), frames[0].height, frames[0].width, video_cfg), video_cfg)
                     for frames in opened.videos]
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        at_least = self.count_tokens(prompt) + sum(pads) - len(pads)
        if at_least >= self.max_model_len:
            raise bad_request(f"the prompt has at least {at_least} tokens with its pictures ({sum(pads)} of them "
                              f"for {len(pads)} pictures), which leaves no room for output in max_model_len "
                              f"{self.max_model_len}; send fewer or smaller pictures, or shorter text", "messages")
