"""Prompt types accepted by `LLM.generate` and the input processors."""

from __future__ import annotations

from typing import Any, TypedDict

# A chat message: {"role": "user", "content": "text" | [{"type": "text"|"image"|"video", ...}]}.
ChatMessage = dict[str, Any]


class _TextPromptRequired(TypedDict):
    prompt: str | list[ChatMessage]


class TextPrompt(_TextPromptRequired, total=False):
    """A prompt given as text (or chat messages) with optional media.

    prompt: a string (may already hold `<|image_pad|>` / `<|video_pad|>` placeholders, one per
      item) or a list of chat messages rendered through the tokenizer's chat template.
    multi_modal_data: {"image": item | [items], "video": video | [videos]}; see
      `tensorrt_llm.inputs.utils.load_image` / `load_video` for the accepted item forms.
    mm_processor_kwargs: per-request processor overrides (min_pixels, max_pixels, fps, ...).
    chat_template_kwargs: extra variables for the chat template of a message-list prompt
      (e.g. {"enable_thinking": False} for Qwen3 / Qwen3.5 / Qwen3.6).
    cache_salt: (vLLM's field) requests share cached KV blocks only with requests of the same
      salt, so one tenant cannot probe another's prompts through prefix-cache timing.
    """

    multi_modal_data: dict[str, Any] | None
    mm_processor_kwargs: dict[str, Any] | None
    chat_template_kwargs: dict[str, Any] | None
    cache_salt: str | None


class _TokensPromptRequired(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokensPromptRequired, total=False):
    """A prompt given as token ids (placeholders, if any, already in id form)."""

    multi_modal_data: dict[str, Any] | None
    mm_processor_kwargs: dict[str, Any] | None
    cache_salt: str | None


PromptInputs = str | TextPrompt | TokensPrompt


def as_prompt_dict(inputs: PromptInputs | list[ChatMessage]) -> dict[str, Any]:
    """Normalise a bare string or message list into a TextPrompt-shaped dict."""
    if isinstance(inputs, str | list):
        return {"prompt": inputs}
    if not isinstance(inputs, dict):
        raise ValueError(
            f"a prompt must be a str, a list of chat messages, a TextPrompt or a TokensPrompt; "
            f"got {type(inputs).__name__}"
        )
    if "prompt" not in inputs and "prompt_token_ids" not in inputs:
        raise ValueError("a prompt dict needs a 'prompt' or a 'prompt_token_ids' key")
    # A misspelt key (say "multimodal_data") would otherwise drop its media without a word.
    unknown = sorted(str(k) for k in inputs if k not in _PROMPT_KEYS)
    if unknown:
        raise ValueError(f"unknown prompt key(s) {unknown}; supported: {sorted(_PROMPT_KEYS)}")
    if "prompt" in inputs and not isinstance(inputs["prompt"], str | list):
        kind = type(inputs["prompt"]).__name__
        raise TypeError(f"prompt must be a str or a list of chat messages, got {kind}")
    for key in ("multi_modal_data", "mm_processor_kwargs", "chat_template_kwargs"):
        value = inputs.get(key)
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"{key} must be a dict, got {type(value).__name__}")
    check_chat_template_kwargs(inputs.get("chat_template_kwargs"), inputs.get("prompt"))
    return dict(inputs)


_PROMPT_KEYS = frozenset(
    {
        "prompt",
        "prompt_token_ids",
        "multi_modal_data",
        "mm_processor_kwargs",
        "chat_template_kwargs",
        "cache_salt",
    }
)
# Arguments of `apply_chat_template` itself, which the kwargs must not override.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "add_generation_prompt",
        "return_dict",
        "chat_template",
    }
)


def check_chat_template_kwargs(kwargs: dict[str, Any] | None, prompt: Any) -> None:
    """A ValueError unless `kwargs` are template variables for a chat-message prompt (a text
    or token-id prompt has no template to give them to: they would be ignored)."""
    if not kwargs:
        return
    if not isinstance(prompt, list):
        raise ValueError(
            "chat_template_kwargs apply to a prompt given as chat messages; this prompt is "
            "text or token ids and is not rendered by the chat template"
        )
    bad = sorted(str(k) for k in kwargs if not isinstance(k, str) or k in _RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise ValueError(
            f"chat_template_kwargs may not set {bad}: they are arguments of the template call"
        )
