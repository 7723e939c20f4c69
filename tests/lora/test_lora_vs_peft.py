"""Logits with a LoRA adapter equal transformers + PEFT on every family, with adapters on every linear kind."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("peft")

import qnext  # noqa: E402
from qnext.lora import AdapterError, read_peft_adapter  # noqa: E402
from qnext.lora.scoring import with_adapter  # noqa: E402
from tests.support.hf_reference import FAMILIES, build_hf_model, hf_logits, save_hf_model  # noqa: E402
from tests.support.peft_reference import TARGETS, make_adapter  # noqa: E402

TOLERANCE = 1e-4
IDS = np.random.default_rng(0).integers(0, 512, 37)


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = build_hf_model(request.param, seed=3)
    save_hf_model(hf, root / "base")
    peft_model = make_adapter(hf, root / "adapter", TARGETS[request.param], r=4, alpha=8.0, scale=0.1)
    return dict(family=request.param, hf=hf, root=root, model=qnext.load_model(root / "base"),
                reference=hf_logits(peft_model, IDS), base=hf_logits(hf, IDS))


def test_logits_with_adapter_equal_peft(family_case):
    ours = with_adapter(family_case["model"], family_case["root"] / "adapter").logits(IDS)
    ref = family_case["reference"]
    assert np.abs(ref - family_case["base"]).max() > 0.5, "the adapter barely changes the logits"
    assert np.abs(ours - ref).max() < TOLERANCE, np.abs(ours - ref).max()


def test_every_target_kind_matters(family_case):
    """Dropping the adapter of any one module kind (the DeltaNet b / a gates included) moves the logits past the
    tolerance: the test above would fail if the engine dropped it."""
    adapter = read_peft_adapter(family_case["root"] / "adapter")
    kinds = {name.rsplit(".", 1)[-1] if "shared_expert." not in name else "shared_expert." + name.rsplit(".", 1)[-1]
             for name in adapter.modules}
    assert {k.split(".")[-1] for k in kinds} >= set(TARGETS[family_case["family"]])
    for kind in sorted(kinds):
        kept = {n: m for n, m in adapter.modules.items()
                if not (n.endswith("." + kind) and ("shared_expert." in kind or "shared_expert." not in n))}
        assert len(kept) < len(adapter.modules)
        dropped = with_adapter(family_case["model"], dataclasses.replace(adapter, modules=kept), adapter.max_rank)
        diff = np.abs(dropped.logits(IDS) - family_case["reference"]).max()
        assert diff > 10 * TOLERANCE, f"dropping {kind} changes the logits by only {diff}"


def test_rslora_patterns_and_vlm_prefix(tmp_path):
    """use_rslora, rank_pattern / alpha_pattern and the VLM wrapper's `model.language_model.` module names."""
    import transformers as tf

    from tests.support.hf_reference import ROPE, SHARED

    text = dict(SHARED, intermediate_size=96, rope_parameters=dict(ROPE, mrope_section=[2, 1, 1],
                                                                   mrope_interleaved=True))
    cfg = tf.Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                                num_heads=2, out_hidden_size=64))
    import torch
    torch.manual_seed(0)
    hf = tf.Qwen3_5ForConditionalGeneration(cfg).eval()
    save_hf_model(hf, tmp_path / "base")
    peft_model = make_adapter(hf, tmp_path / "adapter", r".*language_model.*\.(in_proj_b|in_proj_a|q_proj|down_proj)",
                              r=4, alpha=6.0, scale=0.1, use_rslora=True, rank_pattern={"in_proj_a": 2},
                              alpha_pattern={"q_proj": 3.0})
    adapter = read_peft_adapter(tmp_path / "adapter")
    assert adapter.modules["model.layers.0.linear_attn.in_proj_a"].rank == 2
    ours = with_adapter(qnext.load_model(tmp_path / "base"), adapter).logits(IDS)
    ref = hf_logits(peft_model, IDS)
    assert np.abs(ref - hf_logits(hf, IDS)).max() > 0.05
    assert np.abs(ours - ref).max() < TOLERANCE, np.abs(ours - ref).max()


# ---- bad input -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_case(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_bad")
    hf = build_hf_model("qwen3_5_moe", seed=3)
    save_hf_model(hf, root / "base")
    return hf, root, qnext.load_model(root / "base")


def test_routed_expert_adapters_are_refused(moe_case):
    hf, root, model = moe_case
    make_adapter(hf, root / "experts", ["q_proj"], target_parameters=["mlp.experts.gate_up_proj"],
                 routed_experts=True)
    with pytest.raises(AdapterError, match="target_parameters.*routed experts"):
        with_adapter(model, root / "experts")


def test_rank_above_max_lora_rank_is_refused(moe_case):
    hf, root, model = moe_case
    make_adapter(hf, root / "r8", ["q_proj"], r=8)
    with pytest.raises(AdapterError, match=r"q_proj' has rank 8, above max_lora_rank 4"):
        with_adapter(model, root / "r8", max_lora_rank=4)


def test_target_module_the_model_lacks_is_refused(moe_case):
    hf, root, model = moe_case
    make_adapter(hf, root / "ok", ["q_proj"])
    config = json.loads((root / "ok" / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "w_pack"]
    (root / "ok" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="target module 'w_pack' is not a linear layer of this model"):
        with_adapter(model, root / "ok")
    config["target_modules"], config["modules_to_save"] = ["q_proj"], ["lm_head"]
    (root / "ok" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=r"modules_to_save \['lm_head'\] is not supported"):
        with_adapter(model, root / "ok")


def test_adapter_of_another_base_is_refused(moe_case, tmp_path):
    _, _, model = moe_case
    other = build_hf_model("qwen3_5_moe", seed=3, hidden_size=32)
    make_adapter(other, tmp_path / "other", ["o_proj"])
    with pytest.raises(AdapterError, match=r"o_proj' has lora_A \(4, 128\) and lora_B \(32, 4\); this model needs "
                                           r"\(4, 128\) and \(64, 4\)"):
        with_adapter(model, tmp_path / "other")
