"""Block-quantised FP8 weights as Qwen releases them (`quantization_config.quant_method: fp8`).

A quantised weight W [..., rows, cols] is stored as e4m3 values Q with a float32 `<name>_scale_inv` S of shape
[..., ceil(rows / b0), ceil(cols / b1)] (`weight_block_size` [b0, b1], [128, 128] in the releases): one scale per
block, the last block of a dim partial when the dim is not a multiple of b. The weight is W = Q * S, block by block,
computed in float32 (the same arithmetic on every path, so a dequantised copy equals the loader's result bit for
bit). Modules the release left unquantised are named in `modules_to_not_convert` (module paths, under either the
text-only `model.` or the VLM `model.language_model.` layout); they must be stored in a float dtype.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value
SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"; fused experts "x.gate_up_proj" -> "..._scale_inv"
_VLM_PREFIX = "model.language_model."


def e4m3() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.float8_e4m3fn)


_E4M3_TO_F32 = np.arange(256, dtype=np.uint8).view(e4m3()).astype(np.float32)  # every e4m3 bit pattern's value


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def text_only_name(name: str) -> str:
    """`model.language_model.x` -> `model.x`: one spelling for matching names under both layouts."""
    return "model." + name[len(_VLM_PREFIX):] if name.startswith(_VLM_PREFIX) else name


@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
    """The checkpoint's `quantization_config`, validated."""

    block_size: tuple[int, int]
    not_converted: tuple[str, ...]  # module paths left in bf16, normalised to the text-only layout

    @staticmethod
    def from_hf_config(config: dict[str, Any]) -> "Fp8Scheme | None":
        """None when config.json has no `quantization_config`; an error for any scheme other than block fp8."""
        q = config.get("quantization_config")
        if q is None:
            return None
        if q.get("quant_method") != "fp8":
            raise ValueError(f"quantization_config.quant_method {q.get('quant_method')!r} is not supported; "
                             "qnext loads block-quantised 'fp8' checkpoints (or unquantised ones)")
        if q.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config.fmt {q.get('fmt')!r} is not supported; only e4m3 weights are")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme {q.get('activation_scheme')!r} is not "
                             "supported; only 'dynamic' (no stored activation scales) is")
        block = q.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                             for b in block)):
            raise ValueError(f"quantization_config.weight_block_size {block!r} must be two positive ints "
                             "([128, 128] in the releases); per-tensor fp8 is not supported")
        ignored = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
        return Fp8Scheme(tuple(block), tuple(text_only_name(m) for m in ignored))

    def is_not_converted(self, tensor_name: str) -> bool:
        """True when the tensor belongs to a module the release left unquantised (prefix match on module paths)."""
        name = text_only_name(tensor_name)
        return any(name == m or name.startswith(m + ".") for m in self.not_converted)

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(weight_shape) < 2:
            raise ValueError(f"a block-quantised weight needs at least 2 dims; got shape {weight_shape}")
        *lead, rows, cols = weight_shape
        b0, b1 = self.block_size
        return (*lead, -(-rows // b0), -(-cols // b1))


def quantization_problem(scheme: Fp8Scheme | None, name: str, shape: tuple[int, ...], dtype: str, is_fp8: bool,
                         scale_shape: tuple[int, ...] | None) -> str | None:
    """What is wrong with a checkpoint tensor (completing "tensor X in file ..."), or None. An fp8 tensor needs the
    config's fp8 scheme and a block scale `scale_name(name)` of the shape its blocks give; a module the scheme leaves
    unquantised must not be fp8."""
    if scheme is None or scheme.is_not_converted(name):
        if not is_fp8:
            return None
        why = ("config.json has no quantization_config with quant_method 'fp8'" if scheme is None else
               "quantization_config.modules_to_not_convert lists its module, so it must be stored unquantised")
        return f"is {dtype}, but {why}"
    if not is_fp8:
        return None
    if scale_shape is None:
        return (f"is fp8 but has no block scale {scale_name(name)!r}; every fp8 weight needs its weight_scale_inv "
                "(re-export the checkpoint)")
    want = scheme.scale_shape(shape)
    if scale_shape != want:
        return (f"has shape {shape}; in blocks of {list(scheme.block_size)} its block scale {scale_name(name)!r} "
                f"needs shape {want}, got {scale_shape}")
    return None


def bad_scales(scale_inv: np.ndarray) -> str | None:
    """What is wrong with block scales (completing "its block scale X ..."), or None: each must be finite and
    positive, or the weight it multiplies is NaN, zero, negated or infinite."""
    bad = ~(np.isfinite(scale_inv) & (scale_inv > 0))
    if not bad.any():
        return None
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    return (f"has {int(bad.sum())} of {bad.size} values that are not finite and positive (e.g. "
            f"{float(scale_inv[where])} at block {list(where)}); re-export the checkpoint")


def expand_scales(scale_inv: np.ndarray, shape: tuple[int, ...], block_size: tuple[int, int]) -> np.ndarray:
    """[..., rb, cb] block scales -> [..., rows, cols], each block's scale repeated over it (edge blocks cut)."""
    rows, cols = shape[-2:]
    b0, b1 = block_size
    full = np.repeat(np.repeat(scale_inv.astype(np.float32), b0, axis=-2), b1, axis=-1)
    return full[..., :rows, :cols]


def dequantize(q: np.ndarray, scale_inv: np.ndarray, block_size: tuple[int, int]) -> np.ndarray:
    """e4m3 [..., rows, cols] with block scales -> float32 W = Q * S (the same products as
    q.astype(float32) * expand_scales(...), computed block-wise without materialising the expanded scales)."""
    *lead, rows, cols = q.shape
    b0, b1 = block_size
    rb, cb = scale_inv.shape[-2:]
    x = _E4M3_TO_F32[np.ascontiguousarray(q).view(np.uint8)]  # a table lookup: ml_dtypes' cast is ~10x slower
    if (rb * b0, cb * b1) != (rows, cols):
        x = np.pad(x, [(0, 0)] * len(lead) + [(0, rb * b0 - rows), (0, cb * b1 - cols)])
    x = x.reshape(*lead, rb, b0, cb, b1) * scale_inv.astype(np.float32)[..., :, None, :, None]
    return np.ascontiguousarray(x.reshape(*lead, rb * b0, cb * b1)[..., :rows, :cols])


def quantize(w: np.ndarray, block_size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """float W [..., rows, cols] -> (e4m3 Q, float32 scale_inv) with each block's absolute maximum mapped to 448
    (round to nearest even; an all-zero block gets scale 1)."""
    w = np.asarray(w, dtype=np.float32)
    *lead, rows, cols = w.shape
    b0, b1 = block_size
    rb, cb = -(-rows // b0), -(-cols // b1)
    padded = np.zeros((*lead, rb * b0, cb * b1), np.float32)
    padded[..., :rows, :cols] = w
    blocks = padded.reshape(*lead, rb, b0, cb, b1)
    amax = np.abs(blocks).max(axis=(-3, -1))  # [..., rb, cb]
    scale_inv = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    q = (w / expand_scales(scale_inv, w.shape, block_size)).clip(-E4M3_MAX, E4M3_MAX).astype(e4m3())
    return q, scale_inv
