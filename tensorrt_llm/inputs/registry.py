"""Input processors by HF architecture name: the class that turns prompts into tokens.

Model classes register their processors (`register_auto_model`, in the one registry of
`_torch/model_registry.py`); `create_input_processor` imports the module that registers an
architecture on first use, so nothing heavy loads up front.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from .._torch.model_registry import SUPPORTED_ARCHITECTURES, RegistryView

# render_chat is re-exported: the model input processors import it from here.
from .chat_tokenize import render_chat, tokenize_chat  # noqa: F401
from .data import as_prompt_dict
from .utils import collect_multimodal_data, media_from_messages
from .validation import check_prompt_token_ids


class InputProcessor(Protocol):
    """Turns one prompt into token ids plus extra per-request inputs."""

    def __call__(self, inputs: Any, sampling_params: Any = None) -> tuple[list[int], dict]: ...


# architecture -> input processor class: a view of the one model registry, where each model
# class registers its processor (`register_auto_model`). Looking an architecture up imports
# the model module that registers it.
INPUT_PROCESSOR_REGISTRY: Mapping[str, type] = RegistryView(lambda r: r.input_processor_cls)


def load_hf_config(model_path: str | Path, trust_remote_code: bool = False) -> Any:
    """The checkpoint's HF config, read from local files only."""
    try:
        from .._torch.config_utils import load_pretrained_config
    except ImportError:
        load_pretrained_config = None
    if load_pretrained_config is not None:
        return load_pretrained_config(str(model_path))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(
        str(model_path), local_files_only=True, trust_remote_code=trust_remote_code
    )


def load_tokenizer(model_path: str | Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(model_path), local_files_only=True, trust_remote_code=trust_remote_code
    )


def _architecture(model_path: str | Path, config: Any | None) -> str | None:
    if config is not None:
        routed = getattr(config, "tllm_architecture", None)  # set by load_pretrained_config
        if routed is not None:
            return routed
        archs = getattr(config, "architectures", None)
    else:
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in checkpoint folder {model_path}")
        archs = json.loads(path.read_text(encoding="utf-8")).get("architectures")
    return archs[0] if archs else None


def get_input_processor_class(architecture: str | None, config: Any | None = None) -> type:
    """Registered class for an architecture; text-only checkpoints fall back to text."""
    if architecture is not None and architecture in INPUT_PROCESSOR_REGISTRY:
        return INPUT_PROCESSOR_REGISTRY[architecture]
    if config is not None and getattr(config, "vision_config", None) is not None:
        raise ValueError(
            f"no input processor registered for multimodal architecture {architecture!r}; "
            f"known: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return TextInputProcessor


def create_input_processor(
    checkpoint_dir: str | Path,
    config: Any | None = None,
    tokenizer: Any | None = None,
    trust_remote_code: bool = False,
) -> InputProcessor:
    """Build the input processor for a local HF checkpoint, picked by its architecture."""
    if config is None:
        config = load_hf_config(checkpoint_dir, trust_remote_code)
    cls = get_input_processor_class(_architecture(checkpoint_dir, config), config)
    return cls(
        str(checkpoint_dir), config=config, tokenizer=tokenizer, trust_remote_code=trust_remote_code
    )


class TextInputProcessor:
    """Text LLMs (Qwen2ForCausalLM, Qwen3ForCausalLM, ...): tokenize, nothing else."""

    def __init__(
        self,
        model_path: str,
        config: Any | None = None,
        tokenizer: Any | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        self.model_path = str(model_path)
        self.config = config if config is not None else load_hf_config(model_path)
        self.tokenizer = tokenizer or load_tokenizer(model_path, trust_remote_code)

    def __call__(self, inputs: Any, sampling_params: Any = None) -> tuple[list[int], dict]:
        prompt = as_prompt_dict(inputs)
        data = collect_multimodal_data(prompt.get("multi_modal_data"))
        if isinstance(prompt.get("prompt"), list):
            embedded = media_from_messages(prompt["prompt"])
            data = {k: data[k] + embedded[k] for k in data}
        present = [k for k, v in data.items() if v]
        if present:
            raise ValueError(f"text-only model {self.model_path} cannot take {present} inputs")
        if "prompt_token_ids" in prompt:
            return check_prompt_token_ids(prompt["prompt_token_ids"]), {}
        text = prompt["prompt"]
        if isinstance(text, list):  # request text never becomes control tokens
            return tokenize_chat(self.tokenizer, text, prompt.get("chat_template_kwargs")), {}
        return list(self.tokenizer(text)["input_ids"]), {}

    def get_dummy_prompt(self, num_tokens: int) -> list[int]:
        """`num_tokens` ids of ordinary text, for memory probing."""
        return dummy_text_ids(self.tokenizer, num_tokens)


def dummy_text_ids(tokenizer: Any, num_tokens: int) -> list[int]:
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    ids = tokenizer.encode(" hello", add_special_tokens=False) or [0]
    return (ids * (num_tokens // len(ids) + 1))[:num_tokens]
