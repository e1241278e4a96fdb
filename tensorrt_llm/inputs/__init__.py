"""Prompt types and multimodal input helpers, under TensorRT-LLM's names."""

from .data import PromptInputs, TextPrompt, TokensPrompt
from .multimodal_loader import default_multimodal_input_loader
from .registry import create_input_processor

__all__ = [
    "PromptInputs",
    "TextPrompt",
    "TokensPrompt",
    "create_input_processor",
    "default_multimodal_input_loader",
]
