"""The vision serving benchmark (scripts/bench_vision.py): a chat of several turns with pictures in every turn on a
preset's text model plus a tiny tower, through the engine, measuring the last turn's time to first token with and
without the prefix cache, the encoder cache's hits and the tower's time per picture.

Each configuration runs the whole chat twice on one engine, with other pictures and other text the second time:
the first run compiles every step shape and tower grid; the second is measured, and its prefix-cache hits come only
from its own earlier turns.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
from PIL import Image

from qnext.bench.presets import PRESETS
from qnext.sampling_params import SamplingParams
from qnext.vision.config import VisionTokenIds

# The tiny tower's preprocessing: 8-pixel merged patches; a side x side picture is (side / 8)^2 tokens
TINY_TOWER_PREPROCESSOR = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 64,
                           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


@dataclasses.dataclass(frozen=True)
class ChatShape:
    turns: int = 4
    images_per_turn: int = 2
    image_side: int = 128             # pixels: 256 tokens an image with the tiny tower
    text_tokens: int = 64             # user text a turn
    reply_tokens: int = 8


def vision_checkpoint(preset: str, root: str | Path, image_side: int) -> Path:
    """The preset's text model with the tiny vision tower (written once under `root`)."""
    from qnext.testing.tiny_checkpoint import write_tiny_checkpoint

    path = Path(root) / f"{preset}-vl-v1"
    if not (path / "config.json").is_file():
        overrides = dict(PRESETS[preset].overrides)
        write_tiny_checkpoint(path, PRESETS[preset].family, seed=0, vlm=True, **overrides)
    config = dict(TINY_TOWER_PREPROCESSOR, max_pixels=image_side * image_side)
    (path / "preprocessor_config.json").write_text(json.dumps(config))
    return path


def chat_prompts(shape: ChatShape, ids: VisionTokenIds, seed: int, vocab: int):
    """Per turn: (the user turn's new token ids, its pictures). The pictures of run `seed` are all new."""
    rng = np.random.default_rng(seed)
    n_pad = (shape.image_side // 8) ** 2
    turns = []
    for _ in range(shape.turns):
        tokens, images = rng.integers(10, min(vocab, 400), shape.text_tokens).tolist(), []
        for _ in range(shape.images_per_turn):
            images.append(Image.fromarray(rng.integers(0, 256, (shape.image_side, shape.image_side, 3), np.uint8)))
            tokens += [ids.vision_start_token_id] + [ids.image_token_id] * n_pad + [ids.vision_end_token_id]
        turns.append((tokens, images))
    return turns


def chat_turns(engine, shape: ChatShape, seed: int):
    """Runs the chat one turn per next() (each prompt: every earlier turn and reply, then the new turn), yielding
    per turn the prompt length, the cached tokens and the time to first token (seconds, from add_request)."""
    history, images = [], []
    turns = chat_prompts(shape, engine.vision.token_ids, seed, engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=shape.reply_tokens, ignore_eos=True)
    for turn, (tokens, pictures) in enumerate(turns):
        history, images = history + tokens, images + pictures
        t0 = time.perf_counter()
        engine.add_request(f"s{seed}t{turn}", {"prompt_token_ids": history, "multi_modal_data": {"image": images}},
                           params)
        ttft = final = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if ttft is None and o.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
                if o.finished:
                    final = o
        history = history + list(final.outputs[0].token_ids)
        yield {"turn": turn + 1, "prompt_tokens": len(final.prompt_token_ids),
               "cached_tokens": final.num_cached_tokens, "ttft_s": ttft}


def run_interleaved(engines: dict, shape: ChatShape, seed: int) -> dict[str, list[dict]]:
    """The same chat on every engine, turn by turn in turns (turn 1 on each, then turn 2 on each, ...), so that a
    shared machine's load changes hit every configuration alike."""
    chats = {name: chat_turns(engine, shape, seed) for name, engine in engines.items()}
    out = {name: [] for name in engines}
    for _ in range(shape.turns):
        for name, chat in chats.items():
            out[name].append(next(chat))
    return out
