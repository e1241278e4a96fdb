"""Pydantic models of a chat request's messages and tools: the content parts (text, image_url,
video_url), the tool calls of earlier assistant turns, the tool definitions and a named
`tool_choice`. The request itself (`ChatCompletionRequest`) is in `openai_protocol.py`; nested
objects reject unknown keys (`StrictRequestModel`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from .protocol_base import StrictRequestModel


class TextPart(StrictRequestModel):
    type: Literal["text"]
    text: str


class ImageURL(StrictRequestModel):
    url: str
    # "auto" / "high" (or none): the processor's full resolution (its max_pixels). "low":
    # OpenAI's low-resolution pass, the image first fitted into 512 x 512
    # (`media.LOW_DETAIL_MAX_SIDE`), so it costs a fraction of the vision tokens.
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(StrictRequestModel):
    type: Literal["image_url"]
    image_url: ImageURL | str

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url

    @property
    def detail(self) -> str | None:
        return None if isinstance(self.image_url, str) else self.image_url.detail


class VideoURL(StrictRequestModel):
    url: str
    # Extension: the frame rate of the given frames, for sources that do not carry one.
    fps: Annotated[float | None, Field(gt=0.0, le=240.0)] = None


class VideoURLPart(StrictRequestModel):
    type: Literal["video_url"]
    video_url: VideoURL | str

    @property
    def url(self) -> str:
        return self.video_url if isinstance(self.video_url, str) else self.video_url.url

    @property
    def fps(self) -> float | None:
        return None if isinstance(self.video_url, str) else self.video_url.fps


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart, Field(discriminator="type")]
PART_TYPES = ("text", "image_url", "video_url")
# OpenAI part types a client may well send, each with why it is refused.
_REFUSED_PART_TYPES = {
    "input_audio": "audio input is not supported by these models",
    "file": "file inputs are not supported; send images as image_url parts",
    "refusal": "send an earlier assistant refusal as a text part",
}


class FunctionCallIn(StrictRequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCallIn(StrictRequestModel):
    """A call an earlier assistant turn made (rendered by the chat template)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(StrictRequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call they answer

    @model_validator(mode="before")
    @classmethod
    def _check_part_types(cls, data: Any) -> Any:
        # NOTE: checked before the union is tried, whose error for an unknown type lists every
        # union member's complaint instead of saying which types exist.
        content = data.get("content") if isinstance(data, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in PART_TYPES:
                why = _REFUSED_PART_TYPES.get(kind, "not an OpenAI chat content part")
                raise ValueError(
                    f"content part type {kind[:32]!r} is not supported ({why}); this server "
                    f"takes {', '.join(PART_TYPES)} parts"
                )
        return data

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role!r} ones")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id belongs to role 'tool' messages")
        return self

    def parts(self) -> list[TextPart | ImageURLPart | VideoURLPart]:
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [TextPart(type="text", text=self.content)]
        return list(self.content)


class FunctionDefinition(StrictRequestModel):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments
    strict: bool | None = None


class ChatTool(StrictRequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictRequestModel):
    name: str


class NamedToolChoice(StrictRequestModel):
    type: Literal["function"]
    function: NamedFunction
