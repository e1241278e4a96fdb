"""Causal depthwise conv1d with carried state: HF parity, chunked prefill, decode steps."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

from tensorrt_llm._torch.modules.causal_conv1d import (
    CausalConv1d,
    causal_conv1d_fn,
    causal_conv1d_fn_ref,
    causal_conv1d_update,
)

DIM, WIDTH = 6, 4


def _weights(bias: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(DIM, WIDTH, generator=gen)
    return weight, (torch.randn(DIM, generator=gen) if bias else None)


def _states(n: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((n, DIM, WIDTH - 1), fill)


@pytest.mark.parametrize("length", [1, 3, 11])
@pytest.mark.parametrize("bias", [False, True])
def test_prefill_matches_hf(length: int, bias: bool) -> None:
    weight, b = _weights(bias)
    x = torch.randn(length, DIM)
    states = _states(1)
    out = causal_conv1d_fn(x, weight, b, [length], states)
    ref = hf_qwen3_5.causal_conv1d_fn(x.t()[None], weight, b, activation="silu")[0].t()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    # The state is the last width-1 inputs, zero-padded on the left for short sequences.
    expected = torch.cat([torch.zeros(WIDTH - 1, DIM), x])[-(WIDTH - 1) :].t()
    torch.testing.assert_close(states[0], expected)


def test_no_activation_is_plain_conv() -> None:
    weight, b = _weights(bias=True)
    x = torch.randn(7, DIM)
    out = causal_conv1d_fn(x, weight, b, [7], _states(1), activation=None)
    padded = torch.nn.functional.pad(x.t()[None], (WIDTH - 1, 0))
    ref = torch.nn.functional.conv1d(padded, weight[:, None], b, groups=DIM)[0].t()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def test_packed_sequences_equal_separate_runs() -> None:
    weight, b = _weights(bias=True)
    lens = [5, 1, 8]
    x = torch.randn(sum(lens), DIM)
    init = torch.randn(3, DIM, WIDTH - 1)
    carry = [True, False, True]
    packed_states = init.clone()
    packed = causal_conv1d_fn(x, weight, b, lens, packed_states, carry)
    start = 0
    for i, n in enumerate(lens):
        one = init[i : i + 1].clone() if carry[i] else _states(1)
        out = causal_conv1d_fn(x[start : start + n], weight, b, [n], one, [carry[i]])
        torch.testing.assert_close(packed[start : start + n], out)
        torch.testing.assert_close(packed_states[i], one[0])
        start += n


def test_chunked_prefill_carries_state() -> None:
    weight, b = _weights(bias=True)
    x = torch.randn(13, DIM)
    full_states = _states(1)
    full = causal_conv1d_fn(x, weight, b, [13], full_states)
    states = _states(1, fill=7.0)  # stale slot contents: the first chunk must ignore them
    outs = []
    for i, (lo, hi) in enumerate([(0, 2), (2, 9), (9, 13)]):
        outs.append(causal_conv1d_fn(x[lo:hi], weight, b, [hi - lo], states, [i > 0]))
    torch.testing.assert_close(torch.cat(outs), full)
    torch.testing.assert_close(states, full_states)


def test_decode_steps_equal_prefill_and_hf_update() -> None:
    weight, b = _weights(bias=True)
    x = torch.randn(2, 9, DIM)  # two requests decoding side by side
    full = [causal_conv1d_fn(x[r], weight, b, [9], _states(1)) for r in range(2)]
    states = _states(2)
    causal_conv1d_fn(x[:, :4].reshape(8, DIM), weight, b, [4, 4], states)
    hf_states = states.clone()
    for t in range(4, 9):
        step = causal_conv1d_update(x[:, t], states, weight, b)
        hf_step = hf_qwen3_5.causal_conv1d_update(x[:, t, :, None], hf_states, weight, b, "silu")
        for r in range(2):
            torch.testing.assert_close(step[r], full[r][t], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(step, hf_step[:, :, 0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(states, hf_states)


def test_module_uses_hf_weight_layout() -> None:
    conv = CausalConv1d(DIM, WIDTH)
    assert tuple(conv.weight.shape) == (DIM, 1, WIDTH) and conv.bias is None
    weight, _ = _weights()
    with torch.no_grad():
        conv.weight.copy_(weight[:, None])
    x = torch.randn(5, DIM)
    torch.testing.assert_close(
        conv(x, [5], _states(1)), causal_conv1d_fn(x, weight, None, [5], _states(1))
    )
    states = _states(1, fill=0.5)
    expected_states = states.clone()
    expected = causal_conv1d_update(x[:1], expected_states, weight, None)
    torch.testing.assert_close(conv.step(x[:1], states), expected)
    torch.testing.assert_close(states, expected_states)


def test_bad_inputs_raise() -> None:
    weight, _ = _weights()
    x = torch.randn(5, DIM)
    with pytest.raises(ValueError, match="sum to the token count"):
        causal_conv1d_fn(x, weight, None, [4], _states(1))
    with pytest.raises(ValueError, match="conv_states must be"):
        causal_conv1d_fn(x, weight, None, [5], torch.zeros(1, DIM, WIDTH))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_fn(x, weight, None, [5], _states(1), activation="gelu")
    with pytest.raises(ValueError, match="has_initial_state"):
        causal_conv1d_fn(x, weight, None, [5], _states(1), [True, False])
    with pytest.raises(ValueError, match="decode tokens"):
        causal_conv1d_update(x[:2], _states(3), weight, None)
    with pytest.raises(ValueError, match="kernel"):
        CausalConv1d(DIM, 1)


@pytest.mark.parametrize("bias,activation", [(False, "silu"), (True, None), (True, "silu")])
def test_batched_prefill_matches_per_request_reference(bias: bool, activation: str | None) -> None:
    """The one-gather-per-tap prefill equals the per-request loop: sequences shorter than the
    state, mixed carried/fresh states (a fresh one must ignore its slot's stale contents)."""
    weight, b = _weights(bias)
    lens = [1, 2, 3, 9, 1, 17]
    carry = [True, False, True, False, True, True]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(lens), DIM, generator=gen)
    stale = torch.randn(len(lens), DIM, WIDTH - 1, generator=gen)
    got_states, want_states = stale.clone(), stale.clone()
    got = causal_conv1d_fn(x, weight, b, lens, got_states, carry, activation)
    want = causal_conv1d_fn_ref(x, weight, b, lens, want_states, carry, activation)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_states, want_states)
    assert not torch.equal(got_states, stale)
    # All fresh (None) and all carried take their own shortcuts.
    for flags in (None, [True] * len(lens)):
        got_states, want_states = stale.clone(), stale.clone()
        got = causal_conv1d_fn(x, weight, b, lens, got_states, flags, activation)
        want = causal_conv1d_fn_ref(x, weight, b, lens, want_states, flags, activation)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_states, want_states)


def test_batched_prefill_bf16_stays_within_rounding_of_reference() -> None:
    weight, b = _weights(bias=True)
    weight, b = weight.bfloat16(), b.bfloat16()
    lens = [4, 1, 11]
    x = torch.randn(sum(lens), DIM, generator=torch.Generator().manual_seed(2)).bfloat16()
    got_states = torch.randn(3, DIM, WIDTH - 1).bfloat16()
    want_states = got_states.clone()
    got = causal_conv1d_fn(x, weight, b, lens, got_states, [False, True, True])
    want = causal_conv1d_fn_ref(x, weight, b, lens, want_states, [False, True, True])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(got_states, want_states)
