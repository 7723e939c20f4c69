"""LoRA adapters (docs/lora.md): PEFT's saved format, its modules placed on the engine's fused weights, the stacks
of adapters on device that each step's tokens pick from."""
from qnext.lora.peft_format import AdapterError, PeftAdapter, read_peft_adapter
from qnext.lora.registry import LoRARequest

__all__ = ["AdapterError", "LoRARequest", "PeftAdapter", "read_peft_adapter"]
