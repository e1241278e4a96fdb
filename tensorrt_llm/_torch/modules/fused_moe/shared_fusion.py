"""The shared expert of Qwen3.5-MoE / Qwen3-Next run as one more routed expert.

HF computes `routed(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`: at batch 1 that
is six more launches per layer (the 1-row gate GEMV and its reduce, the sigmoid, gate_up,
SiLU, down, the scale and the add). When the shared expert has the routed experts' width
(`shared_expert_intermediate_size == moe_intermediate_size`, true for Qwen3.6-35B-A3B and
Qwen3-Next), it is the same SwiGLU as a routed expert, so after loading:
- its gate_up / down weights become expert E of the stacks (`[E + 1, 2I, H]`, `[E + 1, H, I]`);
- `shared_expert_gate.weight` becomes row E of the router weight (whose rows are then padded
  to a multiple of 8, `router.py`): one GEMM gives `[T, E + 1]` logits, the softmax/top-k
  reads the first E, and the routing emits a (k + 1)-th pair `(E, sigmoid(logit_E))` per
  token (`moe_routing.py`), which the grouped GEMM weights like any other pair. The sigmoid
  is taken in fp32 and rounded to the model dtype, as HF's is.
The sum over the k + 1 pairs is one fp32 accumulation, where HF adds two rounded tensors: the
results agree to rounding (exactly so up to fp32 reassociation in fp32 models).

Not fused (the block keeps the separate path), with the reason logged once:
- the widths differ (Qwen3.5-MoE releases with a wider shared expert);
- expert parallelism (`local_experts`): the shared expert is tensor-parallel there, not one
  rank's expert; its partial sum joins the routed one in the layer's single all-reduce;
- the precisions differ: block-FP8 routed experts with a 16-bit shared expert, or the reverse
  (e.g. between `Linear`'s quantize-on-load and the experts' later conversion; `build_model`
  fuses again after that), or FP8 layers whose scale blocks differ;
- biases on the shared expert (none of the Qwen families has them).
Loading weights into a fused block is refused: load first, then fuse.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .moe import MoE

logger = logging.getLogger(__name__)
_logged: set[str] = set()


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def why_not_fusable(moe: MoE) -> str | None:
    """None when `moe`'s shared expert can join the routed experts, else the reason."""
    shared, gate, experts = moe.shared_expert, moe.shared_expert_gate, moe.experts
    if moe.shared_fused:
        return "already fused"
    if shared is None or gate is None:
        return "no shared expert"
    if moe.local_experts is not None:
        return "expert parallelism"
    if shared.intermediate_size != experts.intermediate_size:
        return (f"shared_expert_intermediate_size {shared.intermediate_size} != "
                f"moe_intermediate_size {experts.intermediate_size}")  # fmt: skip
    gate_up, down = shared.gate_up_proj, shared.down_proj
    if gate_up.tp_shards or down.tp_shards:
        return "a tensor-parallel shared expert"
    if any(m.bias is not None for m in (gate_up, down, gate)):
        return "the shared expert has biases"
    if gate.weight.dtype != moe.gate.weight.dtype:
        return f"shared_expert_gate is {gate.weight.dtype}, the router {moe.gate.weight.dtype}"
    scales = experts.block_scales()
    if scales is None:
        if gate_up.fp8_block is not None or down.fp8_block is not None:
            return "block-FP8 shared expert with 16-bit routed experts"
        dtypes = {gate_up.weight.dtype, down.weight.dtype, experts.gate_up_proj.dtype}
        if len(dtypes) != 1:
            return f"the shared and routed experts' dtypes differ: {sorted(map(str, dtypes))}"
        return None
    if gate_up.fp8_block is None or down.fp8_block is None:
        return "16-bit shared expert with block-FP8 routed experts"
    if gate_up.fp8_block != scales.gate_up_block or down.fp8_block != scales.down_block:
        return (f"FP8 scale blocks differ: shared {gate_up.fp8_block}/{down.fp8_block}, routed "
                f"{scales.gate_up_block}/{scales.down_block}")  # fmt: skip
    return None


@torch.no_grad()
def fuse_shared_expert(moe: MoE) -> bool:
    """Append `moe`'s shared expert to its routed experts and its gate to the router (see the
    module docstring); returns whether it fused. The separate modules are dropped."""
    reason = why_not_fusable(moe)
    if reason is not None:
        if reason not in ("no shared expert", "already fused") and reason not in _logged:
            _logged.add(reason)
            logger.info("MoE shared expert stays separate: %s", reason)
        return False
    shared, gate, experts = moe.shared_expert, moe.shared_expert_gate, moe.experts
    assert shared is not None and gate is not None
    gate_up, down = shared.gate_up_proj, shared.down_proj
    experts.gate_up_proj = _param(torch.cat([experts.gate_up_proj, gate_up.weight[None]]))
    experts.down_proj = _param(torch.cat([experts.down_proj, down.weight[None]]))
    if experts.gate_up_proj_scale_inv is not None and experts.down_proj_scale_inv is not None:
        experts.gate_up_proj_scale_inv = _param(
            torch.cat([experts.gate_up_proj_scale_inv, gate_up.weight_scale_inv[None].float()])
        )
        experts.down_proj_scale_inv = _param(
            torch.cat([experts.down_proj_scale_inv, down.weight_scale_inv[None].float()])
        )
    experts.num_experts += 1
    moe.gate.append_shared_gate_(gate.weight)
    moe.shared_expert = None
    moe.shared_expert_gate = None
    moe.shared_fused = True
    return True


def fuse_shared_experts_(model: nn.Module) -> int:
    """`fuse_shared_expert` on every MoE block of `model` (after its weights are loaded, and
    again after a block-FP8 conversion of the experts); returns how many fused now."""
    # By the method, not isinstance(MoE): moe.py imports this module, and an import back
    # would be a cycle between the files (tests/unittest/test_import_layering.py).
    return sum(
        bool(m.fuse_shared_expert_())
        for m in model.modules()
        if callable(getattr(m, "fuse_shared_expert_", None))
    )
