"""The IPC codec: tensors arrive bit-identical, large ones through shared memory, none leak."""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import pytest
import torch

from tensorrt_llm.executor import ipc


def _our_segments() -> set[str]:
    prefix = ipc.shm_name_prefix()
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def _payload() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "image": {
            "pixel_values": torch.randn(200, 1176, generator=gen),  # ~940 KB: shared memory
            "image_grid_thw": torch.tensor([[1, 10, 20]]),
        },
        "bf16": torch.randn(300, 300, generator=gen).bfloat16(),  # 180 KB, no numpy dtype
        "mask": torch.rand(17, generator=gen) > 0.5,
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(3, dtype=torch.int32),
        "strided": torch.randn(4, 300, 300, generator=gen)[:, ::3],  # non-contiguous, large
        "mrope_config": {"mrope_position_deltas": torch.tensor([[-5]], dtype=torch.int32)},
    }


def _assert_identical(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            _assert_identical(got[key], want[key])
        return
    assert got.dtype == want.dtype and got.shape == want.shape
    # Bit-identical: compare the raw bytes, so NaN payloads or -0.0 could not hide a change.
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory")
def test_large_tensors_go_through_shared_memory_and_are_unlinked() -> None:
    before = _our_segments()
    want = _payload()
    encoded = ipc.encode(want)
    # The three big tensors travel as segments; the pickle frame stays small.
    assert len(encoded.shm_names) == 3
    assert set(encoded.shm_names) <= _our_segments()
    assert len(encoded.frames[0]) < 4096
    _assert_identical(ipc.decode(encoded.frames), want)
    assert _our_segments() == before  # the receiver unlinked every segment it read


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _decode_in_child(frames: list[bytes], queue: Any) -> None:
    # Plain bytes back: torch's queue reducers would share the tensors' storage instead.
    got = _flatten(ipc.decode(frames))
    queue.put(
        {
            k: (str(v.dtype), tuple(v.shape), v.reshape(-1).view(torch.uint8).numpy().tobytes())
            for k, v in got.items()
        }
    )


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory")
def test_tensors_cross_a_process_bit_identical() -> None:
    want = _payload()
    encoded = ipc.encode(want)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_decode_in_child, args=([bytes(f) for f in encoded.frames], queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(30)
    assert child.exitcode == 0
    flat = _flatten(want)
    assert got.keys() == flat.keys()
    for key, tensor in flat.items():
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert got[key] == (str(tensor.dtype), tuple(tensor.shape), raw), key
    assert not set(encoded.shm_names) & _our_segments()


def test_segments_of_an_unread_message_are_unlinked_by_the_sender() -> None:
    encoded = ipc.encode({"x": torch.randn(100_000)})
    assert len(encoded.shm_names) == 1 and encoded.shm_names[0] in _our_segments()
    ipc.unlink_segments(encoded.shm_names)  # e.g. the engine died before reading it
    assert encoded.shm_names[0] not in _our_segments()
    ipc.unlink_segments(encoded.shm_names)  # idempotent


def test_small_tensors_stay_inline() -> None:
    encoded = ipc.encode({"ids": torch.arange(10), "deltas": torch.tensor([[2]])})
    assert encoded.shm_names == []
    got = ipc.decode(encoded.frames)
    assert torch.equal(got["ids"], torch.arange(10)) and got["deltas"].tolist() == [[2]]
