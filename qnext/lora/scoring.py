"""`with_adapter(load_model(path), adapter_path).logits(ids)`: scoring through the engine's step with one adapter."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from qnext.lora.adapter_stacks import AdapterStacks
from qnext.lora.peft_format import PeftAdapter, read_peft_adapter
from qnext.model.scoring import Model


def with_adapter(model: Model, adapter: str | Path | PeftAdapter, max_lora_rank: int | None = None) -> Model:
    """A Model whose every token uses the PEFT adapter (its directory, or as read) in slot 1 of a one-slot stack."""
    if not isinstance(adapter, PeftAdapter):
        adapter = read_peft_adapter(adapter)
    stacks = AdapterStacks(model.config, model.dtype, max_loras=1, max_lora_rank=max_lora_rank or adapter.max_rank)
    stacks.write(1, adapter)
    return dataclasses.replace(model, params=stacks.attach(model.params), lora_slot=1)
