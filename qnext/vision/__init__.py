"""Qwen3.5's vision side, model half: the tower's config and weights layout, preprocessing without torch, the
tower as pure-functional JAX, and the 3-D MRoPE positions of image and video tokens (docs/vision.md)."""
