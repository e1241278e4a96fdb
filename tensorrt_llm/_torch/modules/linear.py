"""Linear layer with optional fused output shards (qkv, gate_up), and `quantize_model_fp8_`,
which converts a model's Linears to FP8 in place (fp8_linear.py has the FP8 compute).

A Linear is 16-bit, per-channel FP8 (`quantize_linear_fp8_`, after loading) or block-FP8
(`to_fp8_block_`, before loading: fp8_block_linear.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...mapping import Mapping
from ..distributed import AnyShard, all_reduce, all_reduce_max
from .fp8_block_cublas import choose_block_gemm
from .fp8_block_linear import fp8_block_forward, load_fp8_block, scale_rows, shard_block_scales
from .fp8_linear import (
    FP8_DTYPE,
    Fp8Activation,
    UnscaledOutput,
    fp8_gemm_unscaled,
    fp8_linear,
    quantize_linear_fp8_,
    row_amax,
    uses_tensorwise_gemm,
)
from .tensor_parallel import ParamShards, TensorParallelMode, shard_linear


class Linear(nn.Module):
    """`y = x @ W^T + b` with `W: [out_features, in_features]` (nn.Linear layout).

    `output_splits` records how the output rows are made of several HF projections (for a
    fused qkv or gate_up projection), so the weight loader can place each shard and later
    quantised variants know the boundaries.

    Tensor parallelism (`mapping.tp_size > 1` and a `tensor_parallel_mode`): the sizes given
    are the full model's; the layer holds this rank's shard (`tensor_parallel.py`), and a ROW
    layer all-reduces its output before adding the bias. Without either it is the plain layer.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        output_splits: Sequence[int] | None = None,
        *,
        mapping: Mapping | None = None,
        tensor_parallel_mode: TensorParallelMode | None = None,
        output_shards: Sequence[AnyShard] | None = None,
    ) -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear sizes must be positive, got {in_features}x{out_features}")
        splits = tuple(output_splits) if output_splits is not None else (out_features,)
        if sum(splits) != out_features:
            raise ValueError(f"output_splits {splits} do not sum to out_features={out_features}")
        self.mapping = mapping if mapping is not None else Mapping()
        # Checkpoint slices of this rank's parameters (empty: whole tensors), and whether the
        # output is a partial sum to all-reduce (a ROW layer under tensor parallelism).
        self.tp_shards: ParamShards = {}
        self.reduce_output = False
        # The full model's sizes (block-FP8 scale shards check their blocks against them).
        self.full_in_features, self.full_output_splits = in_features, splits
        if tensor_parallel_mode is not None and self.mapping.has_tp:
            local = shard_linear(
                in_features, splits, tensor_parallel_mode, self.mapping, output_shards
            )
            in_features, splits = local.in_features, local.output_splits
            out_features = sum(splits)
            self.tp_shards, self.reduce_output = local.tp_shards, local.reduce_output
        elif output_shards is not None:
            raise ValueError("output_shards needs a tensor-parallel mapping and mode")
        self.in_features = in_features
        self.out_features = out_features
        self.output_splits = splits
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        # Block-FP8 mode (`to_fp8_block_`): (bn, bk) of `weight_scale_inv`, the checkpoint's
        # per-shard block, and whether 16-bit weights are quantized as they load.
        self.fp8_block: tuple[int, int] | None = None
        self.checkpoint_block: tuple[int, int] | None = None
        self.quantize_on_load = False

    @property
    def per_channel_fp8(self) -> bool:
        """Converted by `quantize_model_fp8_` (e4m3 weight, per-channel `weight_scale`)."""
        return self.fp8_block is None and self.weight.dtype == FP8_DTYPE

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        if self.reduce_output:  # NOTE: one flag read on one GPU, the body below unchanged
            return self._forward_row_parallel(x)
        if self.fp8_block is not None:
            if isinstance(x, Fp8Activation) and x.group != self.fp8_block[1]:
                raise TypeError(
                    f"FP8 activations in groups of {x.group or 'a row'} given to a block-FP8 "
                    f"Linear with {self.fp8_block[1]}-column scale blocks"
                )
            return fp8_block_forward(
                x, self.weight, self.weight_scale_inv, self.bias, self.fp8_block
            )
        if isinstance(x, Fp8Activation) and x.group:
            raise TypeError("block-FP8 activation groups given to a Linear that is not block-FP8")
        if self.per_channel_fp8:
            return fp8_linear(x, self.weight, self.weight_scale, self.bias)
        if isinstance(x, Fp8Activation):
            raise TypeError("FP8 activation rows given to a 16-bit Linear")
        return F.linear(x, self.weight, self.bias)

    def _forward_row_parallel(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        """A ROW layer's partial product (no bias), all-reduced once; the bias joins the full
        sum once."""
        out = all_reduce(self._row_partial(x), self.mapping)
        return out if self.bias is None else out + self.bias

    def forward_partial(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        """A ROW layer's partial sum before its all-reduce, for a caller that adds it to other
        partial sums and reduces them all at once (the MoE block's shared expert)."""
        if not self.reduce_output:
            raise ValueError("forward_partial: not a tensor-parallel ROW Linear")
        if self.bias is not None:  # it must join the reduced sum once, which we do not see
            raise ValueError("forward_partial: a ROW Linear with a bias")
        return self._row_partial(x)

    def _row_partial(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        """This rank's share of a ROW product, no bias. Block-FP8: this rank's input columns
        start on a bk boundary (`shard_block_scales`), so its groups are the full layer's."""
        if self.fp8_block is not None:
            if isinstance(x, Fp8Activation) and x.group != self.fp8_block[1]:
                raise TypeError(
                    f"FP8 activations in groups of {x.group or 'a row'} given to a block-FP8 "
                    f"Linear with {self.fp8_block[1]}-column scale blocks"
                )
            out = fp8_block_forward(x, self.weight, self.weight_scale_inv, None, self.fp8_block)
        elif isinstance(x, Fp8Activation) and x.group:
            raise TypeError("block-FP8 activation groups given to a Linear that is not block-FP8")
        elif self.per_channel_fp8:
            out = fp8_linear(x, self.weight, self.weight_scale, None)
        elif isinstance(x, Fp8Activation):
            raise TypeError("FP8 activation rows given to a 16-bit Linear")
        else:
            out = F.linear(x, self.weight)
        return out

    def to_fp8_block_(
        self, block: tuple[int, int], quantize_on_load: bool = False, name: str = "Linear"
    ) -> None:
        """Switch to block-FP8 before the weights exist (typically on the meta device): an
        e4m3 `weight [N, K]` and an fp32 `weight_scale_inv` in `block` (bn, bk) blocks, or
        row-granular (bn = 1) when a fused shard does not end on a bn boundary.

        A tensor-parallel shard also reads its slice of the checkpoint's scales (whole
        blocks: a ValueError naming `name` when its rows / columns do not start on one)."""
        if self.fp8_block is not None or self.per_channel_fp8:
            raise ValueError("Linear is already FP8")
        if self.tp_shards:
            scales = shard_block_scales(
                name,
                self.tp_shards["weight"],
                self.full_output_splits,
                self.full_in_features,
                rows=not self.reduce_output,
                block=block,
                tp_size=self.mapping.tp_size,
            )
            self.tp_shards = {**self.tp_shards, "weight_scale_inv": scales}
        device = self.weight.device
        bn = scale_rows(self.output_splits, block)
        grid = (-(-self.out_features // bn), -(-self.in_features // block[1]))
        self.weight = nn.Parameter(
            torch.empty(self.out_features, self.in_features, dtype=FP8_DTYPE, device=device),
            requires_grad=False,
        )
        self.weight_scale_inv = nn.Parameter(
            torch.empty(grid, dtype=torch.float32, device=device), requires_grad=False
        )
        self.fp8_block = (bn, block[1])
        self.checkpoint_block = block
        self.quantize_on_load = quantize_on_load

    def load_fp8_block_shards(
        self,
        name: str,
        shards: Sequence[torch.Tensor],
        scales: Sequence[torch.Tensor] | None,
        quantize: bool | None = None,
    ) -> None:
        """Fill this block-FP8 layer from its checkpoint shards (one per `output_splits`
        entry): e4m3 with fp32 scales, or 16-bit without when quantized on load."""
        if self.fp8_block is None or self.checkpoint_block is None:
            raise ValueError(f"{name} is not a block-FP8 Linear")
        if len(shards) != len(self.output_splits):
            raise ValueError(f"{name}: {len(shards)} shards for splits {self.output_splits}")
        load_fp8_block(
            name,
            self.weight,
            self.weight_scale_inv,
            shards,
            scales,
            self.output_splits,
            self.checkpoint_block,
            self.fp8_block[0],
            self.quantize_on_load if quantize is None else quantize,
        )

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether a producer should hand this layer `x` as e4m3 rows (`Fp8Activation`):
        a per-channel FP8 layer at the sizes where it runs the tensor-wise GEMM on them."""
        return self.per_channel_fp8 and x.dim() == 2 and uses_tensorwise_gemm(x)

    def takes_fp8_groups(self, x: torch.Tensor) -> bool:
        """Whether a producer should hand this layer `x` already quantised per 1 x bk group
        (`Fp8Activation` with `group = bk`): a block-FP8 layer, on CUDA, 16-bit rows at least
        one group wide (the producers' kernels hold a whole group in one row block), at the
        row counts where the GEMM is cuBLASLt's.

        NOTE: only for cuBLASLt. At the Triton GEMM's decode sizes the hand-off cost more than
        the launch it saves: Qwen3-VL-8B c=1 ITL 3.9 ms with it, 3.4 ms without (per-channel
        FP8: 3.6 ms); c=32 level; prefill (cuBLASLt) gains from it (c=128 TTFT 1.40 vs 1.67 s).
        """
        if not (
            self.fp8_block is not None
            and self.in_features >= self.fp8_block[1]
            and x.is_cuda
            and x.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16)
        ):
            return False
        n, k = self.weight.shape
        return choose_block_gemm(x.device, x.shape[0], n, k, self.fp8_block) == "cublas"

    def forward_unscaled(
        self, x: torch.Tensor | Fp8Activation
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For a consumer kernel that applies FP8 scales itself (saving a rescale pass):
        (output before scaling, row scales, column scales) when this layer is FP8 without a
        bias and `x` takes the tensor-wise GEMM (always, for `Fp8Activation` rows); None
        otherwise (call `forward`).
        """
        if not self.per_channel_fp8 or self.bias is not None or self.reduce_output:
            # A partial sum must be scaled before the reduce: a ROW layer always scales.
            return None
        if isinstance(x, Fp8Activation):
            out, row_scale = fp8_gemm_unscaled(x, self.weight)
            return out, row_scale, self.weight_scale
        if not uses_tensorwise_gemm(x):
            return None
        out, row_scale = fp8_gemm_unscaled(x.reshape(-1, x.shape[-1]), self.weight)
        return out.reshape(*x.shape[:-1], self.out_features), row_scale, self.weight_scale

    def forward_deferred(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor | UnscaledOutput:
        """`forward`, but an FP8 layer on the tensor-wise path (no bias) returns its output
        unscaled, for a reader that applies the scales on load (`RMSNorm.forward_for`)."""
        unscaled = self.forward_unscaled(x)
        return self(x) if unscaled is None else UnscaledOutput(*unscaled)

    def extra_repr(self) -> str:
        block = f", fp8_block={self.fp8_block}" if self.fp8_block is not None else ""
        tp = f", tp_rank={self.mapping.tp_rank}/{self.mapping.tp_size}" if self.tp_shards else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, output_splits={self.output_splits}{block}{tp}"
        )


def quantize_model_fp8_(model: nn.Module, skip: tuple[str, ...] = ("visual",)) -> int:
    """Convert every project `Linear` outside the `skip` sub-modules; returns how many.

    All of them, narrowing projections (o, down) included: with the tensor-wise GEMM they are
    faster than bf16 at decode sizes too (Qwen3-VL-8B on the H200 at 32 rows: down 22.1 vs
    31.1 us, o 10.2 vs 11.0 us; benchmarks/results/fp8_gemm_h200.md).

    Tensor parallelism: a row-parallel layer's scales come from its rows' amax all-reduced
    (MAX) over the ranks, so they equal the TP=1 layer's (fp8_linear.py). NOTE: a collective
    per such layer; every rank converts the same layers in the same (module) order.
    MoE experts (`MoEExperts`, not a `Linear`) stay 16-bit at any tp size; a shared expert's
    Linears are column / row shards like the MLP's, the router is replicated (whole rows).
    """
    chosen = per_channel_fp8_linears(model, skip)
    for name, module in chosen:
        quantize_linear_fp8_(module, _full_row_amax(name, module))
    return len(chosen)


def per_channel_fp8_linears(
    model: nn.Module, skip: tuple[str, ...] = ("visual",)
) -> list[tuple[str, Linear]]:
    """The `Linear`s `quantize_model_fp8_` converts, by module name."""
    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or any(part in skip for part in name.split(".")):
            continue
        if module.fp8_block is not None:
            raise ValueError(f"{name} is block-FP8 already; per-channel fp8 needs 16-bit weights")
        chosen.append((name, module))
    return chosen


def _full_row_amax(name: str, linear: Linear) -> torch.Tensor | None:
    """The amax of each whole output row for a row-parallel shard (None: its rows are whole)."""
    split_inputs = linear.in_features != linear.full_in_features
    if split_inputs and not linear.reduce_output:
        raise ValueError(f"{name}: its input features are split but its output is not reduced")
    if not linear.reduce_output or linear.weight.dtype == FP8_DTYPE:
        return None
    return all_reduce_max(row_amax(linear.weight.data), linear.mapping)
