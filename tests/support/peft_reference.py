"""PEFT LoRA adapters on the tiny transformers models (tests/support/hf_reference.py): the oracle for LoRA tests."""
from __future__ import annotations

import copy
from pathlib import Path

# Every linear kind of each family that LoRA can target (the MoE router and routed experts are not nn.Linear).
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
TARGETS = {
    "qwen3_next": ATTENTION + ["in_proj_qkvz", "in_proj_ba", "out_proj", "shared_expert_gate"] + MLP,
    "qwen3_5": ATTENTION + ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"] + MLP,
    "qwen3_5_moe": ATTENTION + ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                                "shared_expert_gate"] + MLP,
}


def make_adapter(hf_model, out_dir: Path, target_modules, r: int = 4, alpha: float = 8.0, seed: int = 0,
                 use_rslora: bool = False, scale: float = 0.3, routed_experts: bool = False, **config):
    """A PeftModel over a copy of hf_model with every LoRA weight random (lora_B too: PEFT starts it at zero),
    saved to out_dir. Returns the PeftModel (eval mode).

    PEFT (0.22) turns a gate_proj / up_proj / down_proj target on a transformers-5 MoE model into LoRA on the
    routed experts' fused parameters too (target_parameters), which this engine refuses; unless routed_experts,
    that conversion is skipped, so the adapter holds exactly the nn.Linear modules named."""
    import contextlib
    from unittest import mock

    import torch
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, use_rslora=use_rslora, lora_dropout=0.0,
                     **config)
    keep_linears = contextlib.nullcontext() if routed_experts else mock.patch(
        "peft.utils.transformers_weight_conversion._convert_peft_config_moe", lambda *a, **k: None)
    with keep_linears:
        peft_model = get_peft_model(copy.deepcopy(hf_model), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    peft_model.save_pretrained(out_dir)
    return peft_model.eval()
