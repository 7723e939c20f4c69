"""qnext: a JAX/XLA inference engine for Qwen3.5 and Qwen3-Next hybrid models."""
from qnext.config import ModelConfig
from qnext.llm import LLM
from qnext.model.scoring import Model, load_model
from qnext.outputs import CompletionOutput, Logprob, RequestOutput
from qnext.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "Model", "ModelConfig", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "load_model"]
