"""What a recurrent-state snapshot costs (prefix caching of hybrid models): the bytes, and the
GPU and host time of one save (slot -> pool) and one restore (pool -> slot) at a real model's
sizes, with random state (the copies do not depend on the values).

    python benchmarks/bench_state_snapshot.py --config benchmarks/configs/qwen3_6_27b.json

On CUDA the GPU time comes from CUDA events around `--iters` calls and the host time from the
wall clock of the same calls (the engine runs them eagerly, once per snapshot). A save runs
once per snapshot point of a prefill and once per `tokens_per_block` decode tokens of each
running request; a restore once per admission with a hit.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from tensorrt_llm._torch.pyexecutor.block_hash import compute_block_keys
from tensorrt_llm._torch.pyexecutor.capacity import recurrent_state_bytes_per_slot
from tensorrt_llm._torch.pyexecutor.state_snapshot_pool import RecurrentSnapshotPool


def _state(text: SimpleNamespace, slots: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Per-slot tensors shaped as `RecurrentStateCache` builds them (conv 16-bit, SSM fp32)."""
    layers = sum(1 for t in text.layer_types if t == "linear_attention")
    conv_dim = (
        2 * text.linear_num_key_heads * text.linear_key_head_dim
        + text.linear_num_value_heads * text.linear_value_head_dim
    )
    ssm = (text.linear_num_value_heads, text.linear_key_head_dim, text.linear_value_head_dim)
    out: dict[str, torch.Tensor] = {}
    for j in range(layers):
        conv_shape = (slots, conv_dim, text.linear_conv_kernel_dim - 1)
        out[f"recurrent.conv_{j}"] = torch.randn(conv_shape, device=device).to(torch.bfloat16)
        out[f"recurrent.ssm_{j}"] = torch.randn((slots, *ssm), device=device)
    return out


def _time(call: Callable[[], None], iters: int, device: torch.device) -> tuple[float, float]:
    """(GPU us, host us) per call; GPU time is the host time off CUDA."""
    call()  # first call pays one-time costs
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    host = (time.perf_counter() - t0) * 1e6 / iters
    if device.type != "cuda":
        return host, host
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters, host


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a hybrid config.json (benchmarks/configs)")
    p.add_argument("--slots", type=int, default=8, help="seq slots of the state (+1 dummy)")
    p.add_argument("--entries", type=int, default=4, help="snapshot pool entries")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    raw = json.loads(Path(args.config).read_text())
    text = SimpleNamespace(**raw.get("text_config", raw))
    device = torch.device(args.device)
    state = _state(text, args.slots + 1, device)
    per = recurrent_state_bytes_per_slot(text, torch.bfloat16)
    pool = RecurrentSnapshotPool(state, args.entries * per)
    key = compute_block_keys(list(range(4)), 4)[0]

    def save() -> None:  # dropped first: a key already held is not copied again
        pool.drop(key)
        pool.save(key, 0)

    def restore() -> None:
        pool.restore(key, 1)

    pool.save(key, 0)
    restore_gpu, restore_host = _time(restore, args.iters, device)
    save_gpu, save_host = _time(save, args.iters, device)
    moved = 2 * per  # read + write
    print(
        f"snapshot {per / 2**20:.1f} MiB over {len(state) // 2} DeltaNet layers on {device}: "
        f"save {save_gpu:.1f} us {device.type} / {save_host:.1f} us host, restore "
        f"{restore_gpu:.1f} us {device.type} / {restore_host:.1f} us host "
        f"({moved / restore_gpu / 1e3:.0f} GB/s)"
    )


if __name__ == "__main__":
    main()
