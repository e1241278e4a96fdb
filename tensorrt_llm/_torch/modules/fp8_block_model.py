"""A model's block-FP8 layers from a `QuantConfig`: which `Linear`s convert (on the meta device,
before any weight exists), random block-FP8 weights for benchmarks, and the MoE experts' hook.

Which layers: every project `Linear` none of whose checkpoint names (`checkpoint_module_names`,
each HF part of a fused projection under each layout the loader accepts) is listed in
`modules_to_not_convert`. A fused projection with some parts listed and others not is an error:
one layer cannot hold both.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..quantization import QuantConfig, checkpoint_module_names
from ..weight_loading import FUSED_PROJECTIONS
from .fused_moe.moe import MoEExperts
from .gated_delta_net import GATED_DELTA_NET_FUSED_PROJECTIONS
from .linear import Linear

logger = logging.getLogger(__name__)

# Every fused projection a checkpoint part may be loaded into (the loaders' tables).
_FUSED: dict[str, tuple[str, ...]] = {**FUSED_PROJECTIONS, **GATED_DELTA_NET_FUSED_PROJECTIONS}


def _shard_names(name: str, linear: Linear) -> list[list[str]]:
    """For each output shard of `linear`, its checkpoint names under every layout."""
    layouts = checkpoint_module_names(name)
    leaf = name.rpartition(".")[2]
    parts = _FUSED.get(leaf, (leaf,))
    if len(parts) != len(linear.output_splits):
        raise ValueError(
            f"{name} is filled from {len(parts)} checkpoint projections {parts} but its "
            f"output_splits {linear.output_splits} have {len(linear.output_splits)} shards"
        )
    return [[f"{n.rpartition('.')[0]}.{p}".lstrip(".") for n in layouts] for p in parts]


def fp8_block_linears(model: nn.Module, quant_config: QuantConfig) -> dict[str, Linear]:
    """The `Linear`s of `model` that `quant_config` makes block-FP8, by module name."""
    chosen: dict[str, Linear] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        shards = _shard_names(name, module)
        converts = [quant_config.converts(names) for names in shards]
        if all(converts):
            chosen[name] = module
        elif any(converts):
            listed = [names[0] for names, c in zip(shards, converts, strict=True) if not c]
            raise ValueError(
                f"{name} fuses checkpoint projections of which only {listed} are listed in "
                "modules_to_not_convert; a fused layer is either all block-FP8 or all 16-bit"
            )
    return chosen


def apply_fp8_block_config_(model: nn.Module, quant_config: QuantConfig) -> int:
    """Switch the chosen linears to block-FP8 (call on the meta model); returns how many."""
    chosen = fp8_block_linears(model, quant_config)
    for name, linear in chosen.items():
        linear.to_fp8_block_(
            quant_config.weight_block_size,
            quantize_on_load=not quant_config.from_checkpoint,
            name=name,
        )
    return len(chosen)


@torch.no_grad()
def fill_dummy_fp8_block_(model: nn.Module, seed: int, std: float = 0.02) -> int:
    """Random block-FP8 weights (load_format="dummy"): a normal 16-bit matrix per shard,
    quantized by the releases' rule, generated where the layer lives; returns the count."""
    generators: dict[torch.device, torch.Generator] = {}
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.fp8_block is None:
            continue
        device = module.weight.device
        gen = generators.get(device)
        if gen is None:
            gen = generators[device] = torch.Generator(device).manual_seed(seed + 1)
        shards = [
            torch.empty(rows, module.in_features, device=device).normal_(0.0, std, generator=gen)
            for rows in module.output_splits
        ]
        module.load_fp8_block_shards(name, shards, None, quantize=True)
        count += 1
    return count


def quantize_moe_experts_fp8_block_(model: nn.Module) -> int:
    """The routed experts' block-FP8 conversion (quantization="fp8_block" on 16-bit or random
    weights), by the releases' rule; returns how many expert modules converted."""
    count = 0
    for module in model.modules():
        if isinstance(module, MoEExperts):
            module.quantize_fp8_block_()
            count += 1
    return count
