"""Requests with pictures, at intake: the checkpoint's tower (loaded once with the engine) and the translation of a
prompt dict with `multi_modal_data` into token ids plus the Sequence's visuals (qnext/engine/visual_request.py).

    engine.add_request("r1", {"prompt": "<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>What is "
                              "this?<|im_end|>\\n<|im_start|>assistant\\n",
                              "multi_modal_data": {"image": [PIL.Image.open("cat.png")]}})

Images are PIL images or preprocessed VisualInputs; videos are VisualInputs or (frames, fps) pairs. A text prompt
names each picture once (the chat template's placeholder) and is expanded here; a `prompt_token_ids` prompt must
already hold one pad per merged patch.
"""
from __future__ import annotations

import json
from pathlib import Path

from qnext.engine.visual_encoder import VisionSetup
from qnext.engine.visual_request import SequenceVisuals, expand_placeholders, sequence_visuals
from qnext.vision.config import vision_configs
from qnext.vision.preprocess import VisualInput, preprocess_image, preprocess_video
from qnext.vision.preprocess_config import load_preprocess_configs

NO_TOWER = ("this model reads text only: its checkpoint has no vision tower (no vision_config or no model.visual.* "
            "tensors); send text, or serve a Qwen3.5 vision-language checkpoint")


def vision_setup(model: Path, params, *, preprocess_only: bool = False) -> VisionSetup | None:
    """The checkpoint's tower: its configs and preprocessing with `params`, the tower's weights as
    load_checkpoint(..., with_vision=True) placed them (None, and None back, for a text-only checkpoint).
    preprocess_only: the configs and preprocessing without weights (params None), for a process that prepares
    requests for a tower that runs in another (a data parallel replica's); None without a vision_config."""
    configs = vision_configs(json.loads((Path(model) / "config.json").read_text()))
    if configs is None or (params is None and not preprocess_only):
        return None
    image, video = load_preprocess_configs(model)
    return VisionSetup(configs[0], configs[1], image, video, params)


def visual_prompt(prompt: dict, tokenizer, setup: VisionSetup | None
                  ) -> tuple[str | None, list[int], SequenceVisuals | None]:
    """(text, token ids, visuals) of a prompt dict with `multi_modal_data`; ValueError naming what is wrong."""
    data = prompt.get("multi_modal_data") or {}
    unknown = sorted(set(data) - {"image", "video"})
    if unknown:
        raise ValueError(f"multi_modal_data has unknown keys {unknown}; it takes 'image' and 'video'")
    images, videos = _as_list(data.get("image")), _as_list(data.get("video"))
    if not images and not videos:
        return prompt.get("prompt"), list(prompt["prompt_token_ids"]), None
    if setup is None:
        raise ValueError(NO_TOWER)
    images = [v if isinstance(v, VisualInput) else preprocess_image(v, setup.image_preprocess) for v in images]
    videos = [v if isinstance(v, VisualInput) else preprocess_video(*v, setup.video_preprocess) for v in videos]
    text = prompt.get("prompt")
    if "prompt_token_ids" in prompt:
        token_ids = [int(t) for t in prompt["prompt_token_ids"]]
        ordered = _in_prompt_order(token_ids, images, videos, setup)
    else:
        if not isinstance(text, str) or tokenizer is None:
            raise ValueError("a prompt with multi_modal_data needs 'prompt' (text, with a tokenizer) or "
                             "'prompt_token_ids'")
        text, ordered = expand_placeholders(text, images, videos)
        token_ids = tokenizer.encode(text)
    visuals = sequence_visuals(token_ids, ordered, setup.token_ids, setup.config.spatial_merge_size)
    return text, token_ids, visuals


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) and not _is_frames_pair(value) else [value]


def _is_frames_pair(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], (int, float))


def _in_prompt_order(token_ids: list[int], images: list, videos: list, setup: VisionSetup) -> list[VisualInput]:
    """Images and videos interleaved as their pad runs come in the token ids (each list keeps its own order; a
    video fills one run per frame group)."""
    ids, out, images, videos = setup.token_ids, [], list(images), list(videos)
    frames_left, previous = 0, None
    for t in token_ids:
        if t != previous and t in (ids.image_token_id, ids.video_token_id):
            source = images if t == ids.image_token_id else videos
            if t == ids.image_token_id or frames_left == 0:
                if not source:
                    raise ValueError("the prompt has more image / video pad runs than multi_modal_data gives")
                out.append(source.pop(0))
                frames_left = out[-1].grid_thw[0] if t == ids.video_token_id else 0
            if t == ids.video_token_id:
                frames_left -= 1
        previous = t
    if images or videos:
        raise ValueError(f"multi_modal_data gives {len(images) + len(videos)} more images / videos than the prompt "
                         "has pad runs for")
    return out
