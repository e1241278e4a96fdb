"""Block-FP8 expert tensors as the Qwen `-FP8` releases ship them, in `MoEExperts`' layout.

A release stores each expert projection as an e4m3 `weight` `[out, in]` plus an fp32
`weight_scale_inv` `[ceil(out/bn), ceil(in/bk)]` (`triton_kernels/fp8_block.py`). Stacked into
`MoEExperts`:
- `gate_up_proj` e4m3 `[E, 2I, H]` with `gate_up_proj_scale_inv` `[E, ceil(2I/bn), ceil(H/bk)]`
  when I is a multiple of bn; otherwise the gate/up boundary falls inside a scale block, so the
  scales become row-granular (`bn = 1`: `[E, 2I, ceil(H/bk)]`, each row the scale of its block),
  which keeps every weight's dequantized value exact (`gate_up_block`).
- `down_proj` e4m3 `[E, H, I]` with `down_proj_scale_inv` `[E, ceil(H/bn), ceil(I/bk)]`.
The names are transformers' (`FP8Expert`): a stacked checkpoint with scales uses them too.

NOTE: a float8 tensor is never loaded as if it were 16-bit: an e4m3 expert weight without its
scale, or a scale without an e4m3 weight, is a ValueError naming the tensor.
"""

from __future__ import annotations

import torch

from ..triton_kernels.fp8_block import (
    BLOCK_SIZE,
    FP8_DTYPE,
    check_block_scales,
    quantize_weight_fp8_block,
)

SCALE_SUFFIX = "_scale_inv"  # stacked names: gate_up_proj_scale_inv, down_proj_scale_inv


def is_float8(tensor: torch.Tensor) -> bool:
    return tensor.dtype.is_floating_point and tensor.element_size() == 1


def gate_up_block(inter: int, block: tuple[int, int] = BLOCK_SIZE) -> tuple[int, int]:
    """The (bn, bk) of a stacked gate_up: the release's, or row-granular when I % bn != 0."""
    return (block[0], block[1]) if inter % block[0] == 0 else (1, block[1])


def rows_of_scales(scale: torch.Tensor, block_rows: int, rows: int) -> torch.Tensor:
    """Row-granular scales `[rows, kb]` from block scales `[ceil(rows / block_rows), kb]`."""
    return scale.repeat_interleave(block_rows, dim=0)[:rows]


def stack_gate_up_fp8(
    gate: tuple[torch.Tensor, torch.Tensor],
    up: tuple[torch.Tensor, torch.Tensor],
    block: tuple[int, int] = BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's (e4m3 `[2I, H]`, scale_inv) from its gate and up (weight, scale_inv)."""
    (gate_w, gate_s), (up_w, up_s) = gate, up
    inter = gate_w.shape[0]
    if gate_up_block(inter, block) != block:
        gate_s, up_s = (
            rows_of_scales(gate_s, block[0], inter),
            rows_of_scales(up_s, block[0], inter),
        )
    return torch.cat([gate_w, up_w]), torch.cat([gate_s, up_s]).float()


def quantize_expert_fp8_block(
    gate_up: torch.Tensor, down: torch.Tensor, block: tuple[int, int] = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One 16-bit expert -> (gate_up e4m3, its scale_inv, down e4m3, its scale_inv) by the
    releases' rule: gate, up and down each quantized on their own in `block` tiles
    (`quantize_weight_fp8_block`), so the bytes equal a release's after loading."""
    inter = gate_up.shape[0] // 2
    gate = quantize_weight_fp8_block(gate_up[:inter], block)
    up = quantize_weight_fp8_block(gate_up[inter:], block)
    w13, s13 = stack_gate_up_fp8(gate, up, block)
    w2, s2 = quantize_weight_fp8_block(down, block)
    return w13, s13, w2, s2


def check_fp8_pair(name: str, weight: torch.Tensor, scale: torch.Tensor | None) -> None:
    """A ValueError unless `weight` and `scale` are both present-and-float8 or both not."""
    if is_float8(weight) and scale is None:
        raise ValueError(
            f"{name} is {weight.dtype} but has no weight_scale_inv next to it; a float8 "
            f"expert weight is never loaded as 16-bit"
        )
    if scale is not None and not is_float8(weight):
        raise ValueError(f"{name} has a scale_inv but is {weight.dtype}, not float8")
    if scale is not None and weight.dtype != FP8_DTYPE:
        raise ValueError(f"{name}: only {FP8_DTYPE} block-FP8 weights are supported, got "
                         f"{weight.dtype}")  # fmt: skip


def stack_per_expert_fp8(
    prefix: str,
    mats: list[dict[str, torch.Tensor]],
    block: tuple[int, int] = BLOCK_SIZE,
) -> dict[str, torch.Tensor]:
    """`MoEExperts` tensors from per-expert HF e4m3 weights and their `weight_scale_inv`s."""
    pairs: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for e, m in enumerate(mats):
        pairs.append({})
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"{prefix}{e}.{proj}.weight"
            scale = m[proj + SCALE_SUFFIX]
            check_block_scales(m[proj], scale, block, name)
            pairs[-1][proj] = (m[proj], scale.float())
    gate_up = [stack_gate_up_fp8(p["gate_proj"], p["up_proj"], block) for p in pairs]
    return {
        prefix + "gate_up_proj": torch.stack([w for w, _ in gate_up]),
        prefix + "gate_up_proj" + SCALE_SUFFIX: torch.stack([s for _, s in gate_up]),
        prefix + "down_proj": torch.stack([p["down_proj"][0] for p in pairs]),
        prefix + "down_proj" + SCALE_SUFFIX: torch.stack([p["down_proj"][1] for p in pairs]),
    }


def stacked_scale_fp8(
    name: str,
    weight: torch.Tensor,
    scale: torch.Tensor,
    transposed: bool,
    inter: int,
    block: tuple[int, int] = BLOCK_SIZE,
) -> torch.Tensor:
    """The scale_inv of a stacked e4m3 expert tensor in our orientation and granularity.

    `weight` is already in our layout; `transposed` says the checkpoint's was `[E, in, out]`
    (Qwen3-VL-MoE), whose scales are then `[E, ceil(in/bk), ceil(out/bn)]`.
    """
    if scale.dim() != 3:
        raise ValueError(f"{name}{SCALE_SUFFIX} must be [E, ., .], got {tuple(scale.shape)}")
    scale = scale.transpose(1, 2).float() if transposed else scale.float()
    want = block
    if name.endswith("gate_up_proj") and gate_up_block(inter, block) != block:
        want = (1, block[1])
        if scale.shape[1] != weight.shape[1]:  # release blocks -> rows, as per-expert loading
            scale = rows_of_scales(scale.transpose(0, 1), block[0], weight.shape[1])
            scale = scale.transpose(0, 1)
    for e in range(weight.shape[0]):
        check_block_scales(weight[e], scale[e], want, f"{name}[{e}]")
    return scale.contiguous()
