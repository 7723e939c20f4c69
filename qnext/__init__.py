"""qnext: a JAX/XLA inference engine for Qwen3.5 and Qwen3-Next hybrid models."""
from qnext.config import ModelConfig
from qnext.llm import LLM
from qnext.lora.registry import LoRARequest
from qnext.model.scoring import Model, load_model
from qnext.outputs import CompletionOutput, Logprob, RequestOutput
from qnext.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LoRARequest", "CompletionOutput", "Logprob", "Model", "ModelConfig", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "flax", "load_model"]


def __getattr__(name: str):
    """`qnext.flax` after a plain `import qnext` (the README's form), imported on first use: it pulls in Flax,
    which the engine and the server do not need."""
    if name == "flax":
        import importlib

        return importlib.import_module("qnext.flax")
    raise AttributeError(f"module 'qnext' has no attribute {name!r}")
