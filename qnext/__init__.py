"""qnext: a JAX/XLA inference engine for Qwen3.5 and Qwen3-Next hybrid models."""
from qnext.config import ModelConfig
from qnext.model.scoring import Model, load_model

__all__ = ["Model", "ModelConfig", "load_model"]
