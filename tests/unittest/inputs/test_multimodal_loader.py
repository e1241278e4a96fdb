"""Plain prompts with media get the chat template and one placeholder per item; the README's
Python example runs as written; `default_multimodal_input_loader` under upstream's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tensorrt_llm
from tensorrt_llm.inputs import TextPrompt, create_input_processor, default_multimodal_input_loader
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

IMAGE = str(Path(tensorrt_llm.__file__).parent / "assets" / "demo.png")
README = Path(__file__).resolve().parents[3] / "README.md"


@pytest.fixture(scope="module")
def proc():
    return create_input_processor(get_or_build_demo_checkpoint())


def _chat(text: str, images: int) -> list[dict]:
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("images", [1, 2])
def test_plain_prompt_with_media_gets_the_chat_template(proc, images: int) -> None:
    data = {"image": [IMAGE] * images}
    plain, plain_extra = proc({"prompt": "Describe the image.", "multi_modal_data": data})
    chat, chat_extra = proc(
        {"prompt": _chat("Describe the image.", images), "multi_modal_data": data}
    )
    assert plain == chat
    assert plain_extra["multimodal_data"]["image"]["image_grid_thw"].shape[0] == images


def test_some_placeholders_but_not_enough_keep_the_error(proc) -> None:
    prompt = "<|vision_start|><|image_pad|><|vision_end|> two images?"
    with pytest.raises(ValueError, match="placeholder count mismatch.*or none at all"):
        proc({"prompt": prompt, "multi_modal_data": {"image": [IMAGE, IMAGE]}})


def test_token_prompts_are_not_templated(proc) -> None:
    ids = proc.tokenizer("Describe the image.")["input_ids"]
    with pytest.raises(ValueError, match="placeholder count mismatch"):
        proc({"prompt_token_ids": ids, "multi_modal_data": {"image": [IMAGE]}})


def test_default_multimodal_input_loader(proc) -> None:
    ckpt = str(get_or_build_demo_checkpoint())
    inputs = default_multimodal_input_loader(
        tokenizer=proc.tokenizer,
        model_dir=ckpt,
        model_type="qwen2_vl",
        modality="image",
        prompts=["Describe the image.", "What is in it?"],
        media=[IMAGE, [IMAGE, IMAGE]],
    )
    assert [len(i["multi_modal_data"]["image"]) for i in inputs] == [1, 2]
    texts = ("Describe the image.", "What is in it?")
    for entry, text, images in zip(inputs, texts, (1, 2), strict=True):
        want, _ = proc(
            {"prompt": _chat(text, images), "multi_modal_data": entry["multi_modal_data"]}
        )
        got, _ = proc(TextPrompt(**entry))
        assert got == want
    # One prompt, N media: a single request with all of them (TensorRT-LLM's mode 2).
    one = default_multimodal_input_loader(
        tokenizer=None,
        model_dir=ckpt,
        model_type="qwen2_vl",
        modality="image",
        prompts=["Compare them."],
        media=[IMAGE, IMAGE],
    )
    assert len(one) == 1 and len(one[0]["multi_modal_data"]["image"]) == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mm_embeddings": [object()]}, "mm_embeddings are not supported"),
        ({"model_type": "llava"}, "model_type 'llava' is not served"),
        ({"modality": "audio"}, "modality 'audio'"),
        ({"prompts": ["a", "b", "c"], "media": [IMAGE, IMAGE]}, "3 prompts but 2 media"),
        ({"image_data_format": "np"}, "image_data_format"),
    ],
)
def test_loader_errors(proc, kwargs: dict, match: str) -> None:
    args = {
        "tokenizer": proc.tokenizer,
        "model_dir": str(get_or_build_demo_checkpoint()),
        "model_type": "qwen2_vl",
        "modality": "image",
        "prompts": ["a"],
        "media": [IMAGE],
    }
    with pytest.raises(ValueError, match=match):
        default_multimodal_input_loader(**{**args, **kwargs})


def test_readme_python_example_runs_as_written(tmp_path: Path) -> None:
    text = README.read_text(encoding="utf-8")
    code = re.search(r"## Using it\n\n```python\n(.*?)```", text, re.S)
    assert code is not None, "the README lost its Python example"
    source = code.group(1)
    assert '"/path/to/' in source and '"photo.png"' in source
    source = re.sub(r'model="/path/to/[^"]*"', f'model="{get_or_build_demo_checkpoint()}"', source)
    source = source.replace('"photo.png"', repr(IMAGE))
    printed: list[str] = []
    scope = {"print": lambda *a: printed.append(" ".join(map(str, a))), "__name__": "readme"}
    exec(compile(source, "README.md", "exec"), scope)  # noqa: S102 (our own README)
    assert printed and isinstance(scope["out"].outputs[0].text, str)
    assert len(scope["out"].outputs[0].token_ids) >= 1
    scope["llm"].shutdown()
