"""With prefix caching on, a prompt the engine saw before is a cache hit: the warm-up and every
wave of a run must use prompts of their own, or the timings measure the cache."""

from __future__ import annotations

import json
from pathlib import Path

from tensorrt_llm._torch.config_utils import load_pretrained_config
from tensorrt_llm.bench import workload_modes
from tensorrt_llm.bench.workload import make_requests, prepare_model_folder
from tensorrt_llm.commands.bench import parse_args
from tensorrt_llm.tools.tiny_checkpoint import build_config_dict


def _images(config: object, workload: object) -> list[bytes]:
    reqs = make_requests(config, workload)
    return [img.tobytes() for r in reqs for img in r["multi_modal_data"]["image"]]


def test_warm_up_and_waves_share_no_prompt(tmp_path: Path) -> None:
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(build_config_dict("qwen3_vl")))
    folder = prepare_model_folder(cfg, tmp_path / "model", 64)
    config = load_pretrained_config(str(folder))
    args = parse_args(["--config", str(cfg), "--isl", "200", "--osl", "4", "--image_size", "64"])
    waves = [workload_modes._workload(args, c, None) for c in (1, 2, 4)]
    seen: set[bytes] = set()
    for wave in waves:
        for images in (
            _images(config, wave),
            _images(config, workload_modes._warm_up_workload(wave)),
        ):
            assert not seen & set(images)
            seen.update(images)
    assert len(seen) == sum(max(w.num_requests, 0) + 4 for w in waves)
