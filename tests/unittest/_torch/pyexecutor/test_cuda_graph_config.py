"""`cuda_graph_config`: which batch sizes get a decode graph and which graph a batch replays in."""

from __future__ import annotations

from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import graph_batch_sizes, pick_bucket
from tensorrt_llm.llmapi import CudaGraphConfig, LlmArgs
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint


def test_capture_sizes_follow_the_config() -> None:
    assert graph_batch_sizes(CudaGraphConfig(), 20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(CudaGraphConfig(max_batch_size=24), 64) == [1, 2, 4, 8, 16, 24]
    assert graph_batch_sizes(CudaGraphConfig(batch_sizes=[8, 3, 8]), 64) == [3, 8]


def test_padding_picks_the_smallest_holding_graph_else_exact_only() -> None:
    sizes = [1, 2, 4, 8]
    assert [pick_bucket(sizes, b, True) for b in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]
    assert [pick_bucket(sizes, b, False) for b in (1, 3, 5, 8, 9)] == [1, None, None, 8, None]


def test_llm_args_accept_dict_and_none() -> None:
    model = str(get_or_build_demo_checkpoint())
    args = LlmArgs.from_kwargs(
        model=model, max_batch_size=8, cuda_graph_config={"batch_sizes": [2, 8]}
    )
    assert args.cuda_graph_config == CudaGraphConfig(batch_sizes=[2, 8])
    assert LlmArgs.from_kwargs(model=model).cuda_graph_config == CudaGraphConfig()
    assert LlmArgs.from_kwargs(model=model, cuda_graph_config=None).cuda_graph_config is None
