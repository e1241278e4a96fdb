"""The dummy seq slot: one convention for every per-slot buffer.

Per-slot state (the mRoPE delta cache, the recurrent conv/SSM rows) has one row per seq slot
plus a last row, the dummy slot, that padded rows of a CUDA graph read and write: they never
touch a live request's state. Every buffer sizes itself with `slot_rows`, and the graph
runners pad with `dummy_slot`.
"""

from __future__ import annotations


def slot_rows(max_num_seq_slots: int) -> int:
    """Rows of a per-slot buffer: every seq slot, then the dummy slot."""
    return max_num_seq_slots + 1


def dummy_slot(max_num_seq_slots: int) -> int:
    """The index of the dummy slot (the last row)."""
    return max_num_seq_slots
