"""Nothing a request asks for is dropped silently: the request fields this server accepts and
ignores, the OpenAI / vLLM fields it does not implement yet, and the check that turns anything
else into a 400 naming the field (run on the raw JSON before the request model sees it)."""

from __future__ import annotations

from typing import Any

from .openai_protocol import APIError

# Accepted and ignored: they never change what is generated (listed in the README).
IGNORED_REQUEST_FIELDS = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
)


def _off(*values: Any) -> Any:
    return lambda v: v in values


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


# OpenAI / vLLM request fields this server does not implement yet, each with the values that
# ask for nothing (accepted: clients send some of them with their defaults).
NOT_IMPLEMENTED_FIELDS: dict[str, Any] = {
    # vLLM's chat `echo` (the last message echoed back); completions implement theirs.
    "echo": _off(None, False),
    "functions": _empty,
    "function_call": _off(None, "none", "auto"),
    "guided_decoding_backend": _off(None),
    "structured_outputs": _empty,
    "use_beam_search": _off(None, False),
    "length_penalty": _off(None, 1, 1.0),
    "reasoning_effort": _off(None),
    "chat_template": _off(None),
    "add_generation_prompt": _off(None, True),
    "continue_final_message": _off(None, False),
    "documents": _empty,
    "audio": _off(None),
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": _off(None),
    "verbosity": _off(None),
    "web_search_options": _off(None),
}


def check_request_fields(data: dict[str, Any], known: frozenset[str]) -> dict[str, Any]:
    """`data` without the ignored fields, or APIError(400) naming a field this server does not
    know (`known`: the request model's own fields) or does not implement with that value."""
    unknown = [k for k in data if k not in known and k not in NOT_IMPLEMENTED_FIELDS]
    unknown = [k for k in unknown if k not in IGNORED_REQUEST_FIELDS]
    if unknown:
        raise APIError(
            400,
            f"unknown request field(s) {sorted(unknown)[:8]}: not part of the API this server "
            "implements (see the README's supported parameters)",
            code="unsupported_field",
            param=sorted(unknown)[0],
        )
    for name, is_off in NOT_IMPLEMENTED_FIELDS.items():
        if name in data and name not in known and not is_off(data[name]):
            raise APIError(
                400, f"{name} is not supported by this server yet", code="unsupported_feature",
                param=name,
            )  # fmt: skip
    return {k: v for k, v in data.items() if k in known}
