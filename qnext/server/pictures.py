"""A chat's pictures, from the parts the APIs sent to what the engine takes: decoded within the server's limits
(qnext/vision/media.py), preprocessed for the served checkpoint's tower, and the rendered prompt's placeholders
expanded to one pad per merged patch. A checkpoint without a tower answers a picture with a 400 that says so."""
from __future__ import annotations

from qnext.engine.visual_intake import NO_TOWER
from qnext.engine.visual_request import expand_placeholders
from qnext.server.errors import bad_request
from qnext.vision.media import MediaError, MediaLimits, MediaPart, decode_media
from qnext.vision.preprocess import preprocess_image, preprocess_video


class PictureInputs:
    def __init__(self, vision, limits: MediaLimits):
        """vision: the engine's VisionSetup (None: text only)."""
        self.vision, self.limits = vision, limits

    def expand(self, prompt: str, media: list[MediaPart]) -> tuple[str, dict]:
        """(the prompt with its placeholders expanded, multi_modal_data of preprocessed inputs)."""
        if self.vision is None:
            raise bad_request(NO_TOWER, media[0].where)
        try:
            images, videos = decode_media(media, self.limits)
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
