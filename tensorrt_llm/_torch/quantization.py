"""The checkpoint's quantization: `QuantConfig`, read once from config.json, frozen.

Supported: block-wise FP8 as the Qwen `-FP8` releases publish it,

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

at the top level of config.json or inside `text_config` (both: they must agree). Every other
`quant_method` (awq, gptq, compressed-tensors, modelopt, bitsandbytes, ...), FP8 without a block
size (per-tensor) or with static activation scales, and any key we do not implement, fail at load
with an error that names what was found and what is supported.

`QuantConfig.converts(names)` says whether a module stays out of the 16-bit world. Checkpoints
name modules in several layouts (hub `model.layers.N...` / `visual...`, transformers 5
`model.language_model.layers.N...` / `model.visual...`) and the release lists vary
(`model.visual`, `visual`, `lm_head`, `mlp.gate`, per-layer full names), so a module is matched
under every name the weight loader accepts for it (`checkpoint_module_names`). A pattern `p`
matches a name `n` when (our choice, a superset of what the HF quantizers skip):
  - `n == p`, or `n` starts with `p + "."` (HF's prefix rule, at a module boundary);
  - `n` ends with `p` (HF's suffix rule: "fc1" matches "model.layers.3.fc1");
  - `p` is a run of whole components inside `n` (transformers 4's substring rule, kept at
    module boundaries so "mlp.gate" never matches "mlp.gate_proj").
Patterns are literal names (no regex). Matching too much is safe: a layer the checkpoint stores
in e4m3 but we keep in 16 bits is a load error, never a silent 16-bit load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SUPPORTED_QUANT_METHODS: tuple[str, ...] = ("fp8",)
# Values of `LlmArgs.quantization`: "fp8" is per-channel on the fly (16-bit checkpoints only),
# "fp8_block" the releases' 128 x 128 block layout (converted at load, or the checkpoint's own).
QUANTIZATION_MODES: tuple[str | None, ...] = (None, "fp8", "fp8_block")
_KNOWN_KEYS = frozenset(
    {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert"}
)
# HF's FineGrainedFP8Config option to load the weights dequantized; only its default is ours.
_DEFAULT_VALUED_KEYS: Mapping[str, Any] = {"dequantize": False}
# What the releases keep in 16 bits (the vision tower, routers and scalar gates, the LM head,
# the DeltaNet beta/alpha projections): the list `quantization="fp8_block"` uses on a 16-bit
# checkpoint or random weights, and the tiny block-FP8 writer's rule.
RELEASE_MODULES_TO_NOT_CONVERT: tuple[str, ...] = (
    "visual",
    "model.visual",
    "lm_head",
    "mlp.gate",
    "mlp.shared_expert_gate",
    "linear_attn.in_proj_a",
    "linear_attn.in_proj_b",
)
# Our module-name prefixes -> the checkpoint prefixes the loader maps onto them (first match
# wins). Mirrors `models/qwen_vl_vision_inputs.split_vl_weights`: a VL model holds its text
# stack at `llm.` and its tower at `visual.`; text LLMs use the checkpoint's names as they are.
CHECKPOINT_PREFIXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("llm.model.", ("model.", "model.language_model.")),
    ("llm.", ("",)),
    ("visual.", ("visual.", "model.visual.")),
)


def _unsupported(method: Any, detail: str = "") -> ValueError:
    supported = ", ".join(f"{m!r}" for m in SUPPORTED_QUANT_METHODS)
    return ValueError(
        f"checkpoint quantization_config has quant_method={method!r}{detail}, which this engine "
        f"cannot load; supported: {supported} with weight_block_size [bn, bk], fmt 'e4m3' and "
        "activation_scheme 'dynamic' (the Qwen -FP8 releases)"
    )


@dataclass(frozen=True)
class QuantConfig:
    """Block-FP8 weights (e4m3 + fp32 `weight_scale_inv` per `weight_block_size` block) with
    per-token-group dynamic activation quantization.

    `from_checkpoint`: the checkpoint stores the weights quantized (its quantization_config);
    False for `quantization="fp8_block"` on 16-bit or random weights, converted as they load.
    """

    quant_method: str = "fp8"
    weight_block_size: tuple[int, int] = (128, 128)
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] = ()
    from_checkpoint: bool = True

    def __post_init__(self) -> None:
        if self.quant_method not in SUPPORTED_QUANT_METHODS:
            raise _unsupported(self.quant_method)
        block = self.weight_block_size
        if (
            not isinstance(block, tuple)
            or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block)
        ):
            raise ValueError(f"weight_block_size must be two positive ints, got {block!r}")
        if self.fmt != "e4m3":
            raise ValueError(f"block-FP8 fmt {self.fmt!r} is not supported; only 'e4m3'")
        if self.activation_scheme != "dynamic":
            raise _unsupported(
                self.quant_method, f" with activation_scheme={self.activation_scheme!r}"
            )
        if not all(isinstance(p, str) and p for p in self.modules_to_not_convert):
            raise ValueError(
                f"modules_to_not_convert must be non-empty names, got {self.modules_to_not_convert}"
            )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> QuantConfig:
        """From a `quantization_config` dict as config.json has it."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"quantization_config must be an object, got {raw!r}")
        method = raw.get("quant_method")
        if method not in SUPPORTED_QUANT_METHODS:
            raise _unsupported(method)
        if raw.get("weight_block_size") is None:
            raise _unsupported(method, " without weight_block_size (per-tensor FP8)")
        unknown = sorted(set(raw) - _KNOWN_KEYS - set(_DEFAULT_VALUED_KEYS))
        odd = sorted(k for k, v in _DEFAULT_VALUED_KEYS.items() if k in raw and raw[k] != v)
        if unknown or odd:
            raise ValueError(
                f"quantization_config fields not supported: {unknown + odd}; known: "
                f"{sorted(_KNOWN_KEYS)} (and {dict(_DEFAULT_VALUED_KEYS)} at its default)"
            )
        block = raw["weight_block_size"]
        if not isinstance(block, Sequence) or isinstance(block, str):
            raise ValueError(f"weight_block_size must be [bn, bk], got {block!r}")
        skip = raw.get("modules_to_not_convert") or ()
        if isinstance(skip, str) or not isinstance(skip, Sequence):
            raise ValueError(f"modules_to_not_convert must be a list of names, got {skip!r}")
        return cls(
            quant_method=method,
            weight_block_size=tuple(block),  # type: ignore[arg-type]  # checked in post_init
            fmt=raw.get("fmt", "e4m3"),
            activation_scheme=raw.get("activation_scheme", "dynamic"),
            modules_to_not_convert=tuple(skip),
        )

    @classmethod
    def from_pretrained_config(cls, config: Any) -> QuantConfig | None:
        """The checkpoint's quantization (top level or `text_config`), None when 16-bit."""
        top = getattr(config, "quantization_config", None)
        text = getattr(getattr(config, "text_config", None), "quantization_config", None)
        if top is not None and text is not None and _as_dict(top) != _as_dict(text):
            raise ValueError(
                "config.json has two different quantization_config entries (top level and "
                f"text_config): {_as_dict(top)} vs {_as_dict(text)}"
            )
        raw = top if top is not None else text
        return None if raw is None else cls.from_dict(_as_dict(raw))

    @classmethod
    def on_the_fly(cls) -> QuantConfig:
        """`quantization="fp8_block"` on 16-bit or random weights: the releases' layout."""
        return cls(modules_to_not_convert=RELEASE_MODULES_TO_NOT_CONVERT, from_checkpoint=False)

    def converts(self, names: Iterable[str]) -> bool:
        """False when any of a module's checkpoint `names` is listed in modules_to_not_convert."""
        return not any(matches(p, n) for n in names for p in self.modules_to_not_convert)

    def to_dict(self) -> dict[str, Any]:
        """The config.json form (what the tiny block-FP8 writer stores)."""
        return {
            "quant_method": self.quant_method,
            "fmt": self.fmt,
            "activation_scheme": self.activation_scheme,
            "weight_block_size": list(self.weight_block_size),
            "modules_to_not_convert": list(self.modules_to_not_convert),
        }


def _as_dict(raw: Any) -> Any:
    to_dict = getattr(raw, "to_dict", None)  # a transformers QuantizationConfigMixin
    return to_dict() if callable(to_dict) else raw


def matches(pattern: str, name: str) -> bool:
    """Whether `pattern` (a modules_to_not_convert entry) covers module `name` (module doc)."""
    if name == pattern or name.startswith(pattern + ".") or name.endswith(pattern):
        return True
    return f".{pattern}." in f".{name}."


def checkpoint_module_names(
    module_name: str, fused: Mapping[str, tuple[str, ...]] = {}
) -> list[str]:
    """Every checkpoint name of our module `module_name`: under each layout the loader accepts
    (CHECKPOINT_PREFIXES) and, for a fused projection, each of its HF parts."""
    for ours, theirs in CHECKPOINT_PREFIXES:
        if module_name.startswith(ours):
            rests = [p + module_name[len(ours) :] for p in theirs]
            break
    else:
        rests = [module_name]
    out: list[str] = []
    for full in rests:
        head, _, leaf = full.rpartition(".")
        parts = fused.get(leaf, (leaf,))
        out += [f"{head}.{p}" if head else p for p in parts]
    return out


def resolve_quant_config(quantization: str | None, pretrained_config: Any) -> QuantConfig | None:
    """The block-FP8 config the engine builds with, from the user's `quantization` and the
    checkpoint; None for a 16-bit model (or per-channel "fp8", applied after loading)."""
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_MODES)}")
    checkpoint = QuantConfig.from_pretrained_config(pretrained_config)
    if checkpoint is not None:
        if quantization == "fp8":
            raise ValueError(
                "quantization='fp8' asks to quantize a checkpoint that is already block-FP8 "
                "(its config.json has a quantization_config); leave quantization unset "
                "(or 'fp8_block') to load it as it is"
            )
        return checkpoint
    return QuantConfig.on_the_fly() if quantization == "fp8_block" else None
