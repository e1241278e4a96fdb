"""SlotState: the device-resident state of every seq slot, in one place.

Per slot it holds the last sampled token (the token pool: the overlap scheduler's next step
reads a token that is still on the device from here, so host lists only ever hold real
tokens), and it knows the model's own per-slot tensors (the mRoPE delta cache, the recurrent
conv/SSM rows; `EngineModel.per_slot_state`). Every one of them has `slot_rows(n)` rows: the
seq slots, then the dummy slot that padded graph rows read and write (`seq_slots.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..seq_slots import dummy_slot, slot_rows

if TYPE_CHECKING:
    from ..models.engine_model import EngineModel


class SlotState:
    def __init__(self, max_num_seq_slots: int, device: torch.device, model: EngineModel) -> None:
        self.num_rows = slot_rows(max_num_seq_slots)
        self.dummy_slot = dummy_slot(max_num_seq_slots)
        # [num_rows] int64, device: the last token sampled for each slot (stale for free slots).
        self.token_pool = torch.zeros(self.num_rows, dtype=torch.long, device=device)
        self.model_state = model.per_slot_state()
        # NOTE: a model built for more slots than the engine uses is fine: the dummy slot is
        # then a row no request is given (the scheduler hands out slots below it).
        short = {n: t.shape[0] for n, t in self.model_state.items() if t.shape[0] < self.num_rows}
        if short:
            raise ValueError(
                f"per-slot tensors of {type(model).__name__} need at least {self.num_rows} rows "
                f"({max_num_seq_slots} seq slots + the dummy slot), got {short}"
            )

    def record_tokens(self, seq_slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Store this step's sampled tokens at their slots (device, no sync).

        `seq_slots` [n] int64 and `tokens` [n] int64 on the pool's device, in the same order.
        """
        self.token_pool.index_copy_(0, seq_slots, tokens)

    def last_tokens(self, seq_slots: torch.Tensor, out: torch.Tensor) -> None:
        """Write the last sampled token of each of `seq_slots` into `out` (device, no sync)."""
        torch.index_select(self.token_pool, 0, seq_slots, out=out)
