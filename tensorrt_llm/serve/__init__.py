"""OpenAI-compatible HTTP serving (`trtllm-serve`) over the LLM API."""

from __future__ import annotations

from .app import build_app

__all__ = ["build_app"]
