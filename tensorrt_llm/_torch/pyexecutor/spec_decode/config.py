"""`MTPDecodingConfig`: the user's speculative-decoding knobs, under TensorRT-LLM's names.

`LLM(speculative_config=...)` takes one of these or a dict of its fields (`decoding_type`
included, as TensorRT-LLM's YAML files spell it); `parse_speculative_config` normalises
both. Only MTP exists here: any other `decoding_type` is an error naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DECODING_TYPES = ("MTP",)
# Draft tokens per step: beyond a handful the acceptance of a one-layer MTP head is ~0.
MAX_NEXTN_PREDICT_LAYERS = 8


@dataclass(frozen=True)
class MTPDecodingConfig:
    """Multi-token prediction with the checkpoint's `mtp.*` head.

    num_nextn_predict_layers: draft tokens proposed per step (k); each generation step verifies
      them in one target forward of 1 + k tokens per request. The head's layers are reused in
      turn when k exceeds them (Qwen3.5 ships one).

    With the overlap scheduler (the default) a step's rows depend on how many drafts the
    previous step accepted, so the next step is built only once those counts are on the host
    (no look-ahead launch, unlike plain decoding); what overlaps is the previous step's
    streaming responses (delivery, detokenization by the front end), sent while the device runs
    the next verify forward. Outputs equal the non-overlap executor's (py_executor_overlap.py).
    """

    num_nextn_predict_layers: int = 1
    decoding_type: str = "MTP"

    def __post_init__(self) -> None:
        if self.decoding_type not in DECODING_TYPES:
            raise ValueError(
                f"speculative_config.decoding_type must be one of {list(DECODING_TYPES)}, got "
                f"{self.decoding_type!r}"
            )
        k = self.num_nextn_predict_layers
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_NEXTN_PREDICT_LAYERS:
            raise ValueError(
                "speculative_config.num_nextn_predict_layers must be an int in "
                f"[1, {MAX_NEXTN_PREDICT_LAYERS}], got {k!r}"
            )

    @property
    def max_draft_len(self) -> int:
        """TensorRT-LLM's name for the draft tokens per step."""
        return self.num_nextn_predict_layers


def parse_speculative_config(value: Any) -> MTPDecodingConfig | None:
    """None, an `MTPDecodingConfig` or a dict of its fields -> the config (ValueError naming
    the field otherwise)."""
    if value is None or isinstance(value, MTPDecodingConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(
            f"speculative_config must be an MTPDecodingConfig, a dict or None, got {value!r}"
        )
    # NOTE: the decoding type first: an upstream Eagle / NGram config has fields MTP lacks,
    # and "unknown field max_draft_len" would hide that the method itself is missing.
    kind = value.get("decoding_type")
    if kind is not None and kind not in DECODING_TYPES:
        raise ValueError(
            f"speculative_config.decoding_type must be one of {list(DECODING_TYPES)}, got "
            f"{kind!r} (no other speculative decoding method exists here)"
        )
    known = {f.name for f in dataclasses.fields(MTPDecodingConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"unknown speculative_config field(s) {unknown}; supported: {sorted(known)}"
        )
    if "decoding_type" not in value:
        raise ValueError("speculative_config needs decoding_type (only 'MTP' is supported)")
    return MTPDecodingConfig(**value)


SPEC_WITH_REUSE_ERROR = (
    "speculative_config with KV block reuse is not supported yet; pass enable_block_reuse=False"
)


def check_speculative_support(
    config: MTPDecodingConfig,
    text_config: Any,
    *,
    max_num_tokens: int,
    enable_block_reuse: bool,
) -> None:
    """The combinations MTP cannot run yet, as errors naming the knob (`to_engine_config`):
    before any weight is read or any tensor-parallel rank is started."""
    num_layers = int(getattr(text_config, "mtp_num_hidden_layers", 0) or 0)
    if num_layers <= 0:
        model_type = getattr(text_config, "model_type", "?")
        raise ValueError(
            "speculative_config (MTP) needs a checkpoint with an MTP head: its text config "
            f"({model_type}) declares no mtp_num_hidden_layers (Qwen3.5 / Qwen3.6 ship one)"
        )
    k = config.num_nextn_predict_layers
    if 1 + k > max_num_tokens:
        raise ValueError(
            f"max_num_tokens={max_num_tokens} cannot hold one verify row of 1 + "
            f"{k} tokens (speculative_config.num_nextn_predict_layers)"
        )
    if enable_block_reuse:
        # NOTE: the MTP layer's KV of a cached block and the snapshot points are not checked
        # with drafts yet (hybrid models take block reuse only when asked).
        raise ValueError(SPEC_WITH_REUSE_ERROR)
