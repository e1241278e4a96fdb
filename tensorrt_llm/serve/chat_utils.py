"""OpenAI requests -> LLM API inputs: chat messages with resolved media, and SamplingParams."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import httpx

from ..guided_decoding_params import GuidedDecodingParams
from ..sampling_params import SamplingParams
from .forced_tools import forced_tool_guide
from .media import (
    LOW_DETAIL_MAX_SIDE,
    MediaConfig,
    MediaError,
    fetch_media_url,
    load_image_url,
    load_video_url,
)
from .openai_protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ImageURLPart,
    TextPart,
    VideoURLPart,
)
from .strict_tools import has_strict_tools, strict_tool_guide
from .tool_parsers import ToolParser

_PART_MODALITY = {"image_url": "image", "video_url": "video"}


def count_media(messages: list[ChatMessage]) -> dict[str, int]:
    counts = {"image": 0, "video": 0}
    for message in messages:
        for part in message.parts():
            modality = _PART_MODALITY.get(part.type)
            if modality is not None:
                counts[modality] += 1
    return counts


def check_mm_limits(messages: list[ChatMessage], limits: dict[str, int] | None) -> None:
    """Reject (before any fetch or decode) prompts with more items than --limit_mm_per_prompt."""
    if not limits:
        return
    for modality, count in count_media(messages).items():
        limit = limits.get(modality)
        if limit is not None and count > limit:
            raise APIError(
                400,
                f"this prompt has {count} {modality}(s) but the server allows at most {limit} "
                f"{modality}(s) per prompt (--limit_mm_per_prompt)",
                code="mm_limit_exceeded",
                param="messages",
            )


async def _resolve_part(
    part: TextPart | ImageURLPart | VideoURLPart,
    param: str,
    config: MediaConfig,
    client: httpx.AsyncClient,
    decode: bool,
) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    # detail "low": the image fitted into LOW_DETAIL_MAX_SIDE square first (OpenAI's pass).
    low = isinstance(part, ImageURLPart) and part.detail == "low"
    max_side = LOW_DETAIL_MAX_SIDE if low else None
    if not decode:
        kind = "image" if isinstance(part, ImageURLPart) else "video"
        fps = part.fps if isinstance(part, VideoURLPart) else None
        where = f"{param}.{kind}_url"
        pending = await fetch_media_url(part.url, kind, config, client, fps=fps, param=where)
        return {"type": kind, kind: replace(pending, max_side=max_side)}
    if isinstance(part, ImageURLPart):
        where = f"{param}.image_url"
        image = await load_image_url(part.url, config, client, param=where, max_side=max_side)
        return {"type": "image", "image": image}
    video = await load_video_url(part.url, config, client, fps=part.fps, param=f"{param}.video_url")
    return {"type": "video", "video": video}


async def resolve_messages(
    messages: list[ChatMessage],
    config: MediaConfig,
    client: httpx.AsyncClient,
    decode: bool = True,
) -> list[dict[str, Any]]:
    """Chat messages in the LLM API's form, every media URL loaded (concurrently).

    decode=False: media are fetched but left as `PendingMedia`, for a preprocess worker to
    decode (`media.decode_pending`).

    Text-only messages keep a plain string content so any chat template can render them.
    Raises APIError(400) for a media problem, naming the offending content part.
    """
    jobs: list[Any] = []
    shapes: list[tuple[dict[str, Any], bool, int]] = []  # (fields, plain text, parts)
    # Checked first: a bad message must fail before any coroutine exists to be dropped.
    all_fields = [_message_fields(message) for message in messages]
    for i, (message, fields) in enumerate(zip(messages, all_fields, strict=True)):
        if message.content is None or isinstance(message.content, str):
            shapes.append((fields, True, 0))
            jobs.append(_constant(message.content or ""))
            continue
        shapes.append((fields, False, len(message.content)))
        for j, part in enumerate(message.content):
            jobs.append(_resolve_part(part, f"messages.{i}.content.{j}", config, client, decode))
    try:
        resolved = await asyncio.gather(*jobs)
    except MediaError as exc:
        raise APIError(400, str(exc), code=exc.code, param=exc.param) from None
    out, cursor = [], 0
    for fields, plain, num_parts in shapes:
        if plain:
            out.append({**fields, "content": resolved[cursor]})
            cursor += 1
        else:
            out.append({**fields, "content": list(resolved[cursor : cursor + num_parts])})
            cursor += num_parts
    return out


def _message_fields(message: ChatMessage) -> dict[str, Any]:
    """The template's view of a message besides its content: role, and the tool fields.

    NOTE: a call's arguments arrive as JSON text (OpenAI's form); the Qwen templates read them
    as a mapping (`tool_call.arguments | items`), so they are parsed here; text that is not a
    JSON object is a 400 naming the message.
    """
    fields: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
    if message.name is not None:
        fields["name"] = message.name
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                raise APIError(
                    400,
                    f"tool call {call.function.name!r}: arguments must be a JSON object",
                    code="invalid_request",
                    param="messages.tool_calls",
                )
            function = {"name": call.function.name, "arguments": arguments}
            calls.append({"id": call.id, "type": "function", "function": function})
        fields["tool_calls"] = calls
    return fields


async def _constant(value: Any) -> Any:
    return value


def guided_decoding(
    request: ChatCompletionRequest | CompletionRequest,
    tool_parser: type[ToolParser] | None = None,
) -> GuidedDecodingParams | None:
    """The request's structured-output constraint (at most one may be given), or None.

    `tool_parser`: the server's tool-call format, which `strict` tools under "auto" are held
    to (strict_tools.py); a chat request with such tools needs it."""
    fmt = request.response_format
    given: dict[str, dict[str, Any]] = {}
    if fmt is not None and fmt.type == "json_object":
        given["response_format"] = {"json_object": True}
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.json_schema if fmt.json_schema is not None else None
        if schema is None:
            raise APIError(
                400, "response_format json_schema needs json_schema.schema",
                code="invalid_request", param="response_format",
            )  # fmt: skip
        given["response_format"] = {"json": schema}
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):  # fmt: skip
        value = getattr(request, name)
        if value is not None:
            given[name] = {key: value}
    forced = forced_tool_guide(request) if isinstance(request, ChatCompletionRequest) else None
    if forced is not None:
        if given:
            raise APIError(
                400, f"tool_choice {request.tool_choice!r} enforces the call with structured "
                f"output; it cannot be combined with {sorted(given)}", param="tool_choice",
            )  # fmt: skip
        return forced
    if isinstance(request, ChatCompletionRequest) and has_strict_tools(request):
        if given:
            raise APIError(
                400, f"strict tools are enforced with structured output under tool_choice "
                f"'auto'; they cannot be combined with {sorted(given)} (set strict false, or "
                f"use tool_choice 'required')", param="tools",
            )  # fmt: skip
        if tool_parser is None:
            raise ValueError("strict tools need the server's tool-call format (tool_parser)")
        return strict_tool_guide(request, tool_parser)
    if len(given) > 1:
        raise APIError(
            400, f"give one structured-output constraint, got {sorted(given)}",
            code="invalid_request", param=sorted(given)[1],
        )  # fmt: skip
    if not given:
        return None
    ((name, spec),) = given.items()
    try:
        return GuidedDecodingParams(**spec)  # type: ignore[arg-type]
    except ValueError as exc:
        raise APIError(400, f"{name}: {exc}", code="invalid_request", param=name) from None


def to_sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    tool_parser: type[ToolParser] | None = None,
) -> SamplingParams:
    """SamplingParams of a request; invalid combinations raise APIError(400). `tool_parser`:
    the server's tool-call format (`guided_decoding`)."""
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "n": request.n}
    if request.temperature is not None:
        kwargs["temperature"] = float(request.temperature)
    if request.top_p is not None:
        kwargs["top_p"] = float(request.top_p)
    if request.top_k is not None:
        kwargs["top_k"] = max(int(request.top_k), 0)
    if request.seed is not None:
        kwargs["seed"] = int(request.seed)
    if request.priority:
        kwargs["priority"] = int(request.priority)
    if request.stop is not None:
        kwargs["stop"] = [request.stop] if isinstance(request.stop, str) else list(request.stop)
    if request.stop_token_ids:
        kwargs["stop_token_ids"] = list(request.stop_token_ids)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        value = getattr(request, name)
        if value is not None:
            kwargs[name] = float(value)
    if request.min_tokens is not None:
        kwargs["min_tokens"] = int(request.min_tokens)
    if request.logit_bias:
        kwargs["logit_bias"] = {int(k): float(v) for k, v in request.logit_bias.items()}
    if request.bad_words:
        kwargs["bad_words"] = list(request.bad_words)
    if request.num_logprobs is not None:
        kwargs["logprobs"] = request.num_logprobs
    prompt_logprobs = (
        request.sampled_prompt_logprobs
        if isinstance(request, CompletionRequest)
        else request.prompt_logprobs
    )
    if prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = prompt_logprobs
    guided = guided_decoding(request, tool_parser)
    if guided is not None:
        kwargs["guided_decoding"] = guided
    kwargs["ignore_eos"] = bool(request.ignore_eos)
    kwargs["include_stop_str_in_output"] = bool(request.include_stop_str_in_output)
    kwargs["skip_special_tokens"] = bool(request.skip_special_tokens)
    kwargs["spaces_between_special_tokens"] = bool(request.spaces_between_special_tokens)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise APIError(
            400, f"invalid sampling parameters: {exc}", code="invalid_sampling_params"
        ) from None
