"""QwenVLModelBase: vision tower + mRoPE text LLM, shared by every Qwen-VL model class.

A step's context requests may carry pixels; their vision embeddings are computed once per request
(kept across prefill chunks) and scattered into the token embeddings of the chunk. The mRoPE
delta of each context request goes into the seq-slot cache; generation rows read theirs back on
the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from ...inputs.multimodal import MultimodalParams
from ..attention_backend.interface import AttentionMetadata
from ..input_errors import RequestInputError
from ..seq_slots import slot_rows
from .engine_model import PiecewiseStack, StackInputs
from .modeling_multimodal_utils import VISION_DEVICE_PATHS, compose_device_paths
from .modeling_qwen2 import Qwen2TextForCausalLM
from .modeling_utils import ModelConfig
from .piecewise_stack import not_registered, piecewise_stack_of
from .qwen_vl_mrope import _prepare_qwen_vl_mrope_config, apply_generation_deltas
from .qwen_vl_vision_inputs import MODALITIES, VisionTower, chunk_embeddings, split_vl_weights
from .vision_data_parallel import check_same_items, run_tower_data_parallel
from .vision_embedding_cache import VisionEmbeddingCache
from .vision_step_encoder import encode_modality

if TYPE_CHECKING:  # annotations only; the model classes import this module
    from ..input_batch import InputBatch
    from ..modules.rotary_embedding import RotaryEmbedding
    from .engine_model import PiecewiseModel
    from .modeling_qwen3vl_vision import Qwen3VisionModel


class QwenVLModelBase(nn.Module):
    """Subclasses set `text_model_cls`, `vision_model_cls` and the device paths."""

    text_model_cls: ClassVar[type[Qwen2TextForCausalLM]]
    vision_model_cls: ClassVar[Callable[..., VisionTower] | None]
    multimodal_data_device_paths: ClassVar[list[str]] = compose_device_paths(VISION_DEVICE_PATHS)
    has_deepstack: ClassVar[bool] = False
    uses_mrope: ClassVar[bool] = True  # `EngineModel` capability
    # Set by `register_auto_model(..., supports_piecewise=)` on each registered class.
    supports_piecewise: ClassVar[bool] = False
    # A buffer (registered in __init__), declared so its reads type as a tensor.
    mrope_position_deltas_cache: torch.Tensor

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        config = model_config.pretrained_config
        self.config = config
        self.model_config = model_config
        text_config = config.text_config
        tie = getattr(config, "tie_word_embeddings", None)
        extra: dict[str, Any] = {}
        if self.text_model_cls.is_hybrid:
            # Hybrid stacks keep per-seq-slot recurrent state; dense ones take no such kwarg.
            extra["max_num_seq_slots"] = model_config.max_num_seq_slots
            extra["ssm_state_dtype"] = model_config.ssm_state_dtype
        self.llm = self.text_model_cls(
            text_config,
            dtype=model_config.torch_dtype,
            attn_backend=model_config.attn_backend,
            tie_word_embeddings=tie,
            mapping=model_config.mapping,
            **extra,
        )
        # `language_model_only: true` checkpoints have no vision tower; media is rejected.
        self.vision_language = not getattr(config, "language_model_only", False)
        self.visual: VisionTower | None = None
        if self.vision_language and self.vision_model_cls is not None:
            # The tower picks its own packed-attention path (its backends differ from the LLM's).
            self.visual = self.vision_model_cls(
                config.vision_config, dtype=model_config.torch_dtype
            )
        self.image_token_id: int = config.image_token_id
        self.video_token_id: int = config.video_token_id
        # Deepstack inputs of a step are views of this buffer (levels x tokens x hidden), kept
        # across steps so media steps allocate nothing; the capacity probe's largest step sizes
        # it at startup, before the KV cache takes the rest of the memory.
        self._deepstack_scratch: torch.Tensor | None = None
        # Tower outputs by media content hash (prefix caching); set by the executor creator.
        self.vision_embedding_cache: VisionEmbeddingCache | None = None
        self.vocab_size: int = text_config.vocab_size
        # NOTE: one entry per seq slot plus a dummy slot (the last) that is never written, so
        # padded rows and requests without a delta read 0.
        self.register_buffer(
            "mrope_position_deltas_cache",
            # explicit device: built for real even under a meta-device construction
            torch.zeros(slot_rows(model_config.max_num_seq_slots), dtype=torch.int32, device="cpu"),
            persistent=False,
        )

    @property
    def has_vision(self) -> bool:
        return self.visual is not None

    @property
    def is_hybrid(self) -> bool:
        return self.text_model_cls.is_hybrid

    @property
    def deepstack_levels(self) -> int:
        """How many deepstack inputs a media step carries (0: the model has none)."""
        if not self.has_deepstack or self.visual is None:
            return 0
        # Only the Qwen3-VL tower has deepstack outputs (`has_deepstack` models).
        return len(cast("Qwen3VisionModel", self.visual).deepstack_visual_indexes)

    @property
    def rotary_emb(self) -> RotaryEmbedding:
        return self.llm.model.rotary_emb

    # ------------------------------------------------------------------ vision
    def _run_tower(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
        # `_encode_step_media` calls this only once it has checked that the tower exists.
        mapping = self.model_config.mapping
        if mapping.has_tp:  # mm_encoder_tp_mode "data": each rank encodes a share
            merge = self.config.vision_config.spatial_merge_size
            return run_tower_data_parallel(self._run_tower_whole, pixels, grid_thw, merge, mapping)
        return self._run_tower_whole(pixels, grid_thw)

    def _run_tower_whole(
        self, pixels: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list]:
        out = cast("VisionTower", self.visual)(pixels, grid_thw)
        return out.embeddings, list(out.deepstack_embeddings)

    def _encode_step_media(self, multimodal_params: Sequence[MultimodalParams]) -> None:
        """Run the vision tower once per modality for every request of the step still lacking
        embeddings, and cache each request's share on its params (items inside a prefix hit
        are skipped, items in the embedding cache are not encoded: vision_step_encoder.py).

        NOTE: one packed tower call for all images of the step (each image is its own
        cu_seqlens segment), instead of one call per request: per-request calls made the host,
        not the GPU, the bottleneck of batched prefill.
        """
        todo = [p for p in multimodal_params if p.cached_embeddings is None]
        if not todo:
            return
        for params in todo:
            params.cached_embeddings = {}
        merge = self.config.vision_config.spatial_merge_size
        mapping = self.model_config.mapping
        device = self.mrope_position_deltas_cache.device
        for kind, pix_key, grid_key in MODALITIES:
            owners = [p for p in todo if p.get(f"{kind}.{pix_key}") is not None]
            if not owners:
                continue
            if self.visual is None:
                raise RequestInputError(
                    [p.runtime.request_id for p in owners if p.runtime is not None],
                    "this checkpoint was loaded without a vision tower (language_model_only); "
                    f"it cannot take {kind} inputs",
                )
            dtype = next(self.visual.parameters()).dtype
            check = None
            if mapping.has_tp:  # the ranks must agree on the items they encode
                check = partial(check_same_items, kind, mapping=mapping, device=device)
            encode_modality(
                self._run_tower,
                owners,
                kind,
                pix_key,
                grid_key,
                merge,
                dtype,
                self.vision_embedding_cache,
                check,
            )

    def _merge_vision(
        self,
        inputs_embeds: torch.Tensor,
        multimodal_params: Sequence[MultimodalParams],
    ) -> list[torch.Tensor] | None:
        """Write the chunk's vision embeddings into `inputs_embeds` rows (in place).

        The rows are each request's `runtime.<kind>_rows`, which the engine derives from the
        placeholder spans the input processor recorded. NOTE: never from `input_ids ==
        pad id`: a decode row that sampled a pad token would then take (or break) the merge.
        Every check runs before any write, so an error fails only the request at fault.
        Returns the deepstack inputs ([T, hidden] each) for models that have them.
        """
        needs_media = [
            p
            for p in multimodal_params
            if p.runtime is not None
            and (p.runtime.num_image_tokens_in_chunk or p.runtime.num_video_tokens_in_chunk)
        ]
        if not needs_media:  # text-only chunks: nothing to check or write
            return None
        self._encode_step_media(needs_media)
        chunks: dict[str, list[torch.Tensor]] = {"image": [], "video": []}
        rows: dict[str, list[torch.Tensor]] = {"image": [], "video": []}
        deep: dict[str, list[list[torch.Tensor]]] = {"image": [], "video": []}
        for params in needs_media:
            for kind in ("image", "video"):
                picked = chunk_embeddings(params, kind)
                if picked is None:
                    continue
                index, main, stack = picked
                rows[kind].append(index)
                chunks[kind].append(main)
                deep[kind].append(stack)
        deepstack: list[torch.Tensor] | None = None
        for kind in ("image", "video"):
            if not chunks[kind]:
                continue
            index = torch.cat(rows[kind]) if len(rows[kind]) > 1 else rows[kind][0]
            src = torch.cat(chunks[kind]).to(inputs_embeds.dtype)
            inputs_embeds.index_copy_(0, index, src)
            if self.has_deepstack and deep[kind] and deep[kind][0]:
                if deepstack is None:
                    deepstack = self._deepstack_buffers(len(deep[kind][0]), inputs_embeds)
                for level, target in enumerate(deepstack):
                    level_src = torch.cat([d[level] for d in deep[kind]]).to(target.dtype)
                    target.index_copy_(0, index, level_src)
        return deepstack

    def _deepstack_buffers(self, levels: int, like: torch.Tensor) -> list[torch.Tensor]:
        """`levels` zeroed `[T, hidden]` tensors shaped like `like`, from the kept scratch."""
        tokens, hidden = like.shape
        buf = self._deepstack_scratch
        if (
            buf is None
            or buf.shape[0] < levels
            or buf.shape[1] < tokens
            or buf.shape[2] != hidden
            or (buf.dtype, buf.device) != (like.dtype, like.device)
        ):
            buf = torch.empty(levels, tokens, hidden, dtype=like.dtype, device=like.device)
            self._deepstack_scratch = buf
        views = buf[:levels, :tokens]
        views.zero_()
        return list(views.unbind(0))

    # ------------------------------------------------------------------ forward
    def forward_batch(self, batch: InputBatch) -> torch.Tensor:
        """The engine's entry point (`EngineModel`)."""
        return self(
            batch.attn_metadata,
            batch.input_ids,
            batch.position_ids,
            multimodal_params=batch.multimodal_params,
            return_context_logits=batch.return_context_logits,
        )

    def forward_hidden(self, batch: InputBatch) -> torch.Tensor:
        """Final-normed hidden states of every token `[T, hidden]` (prompt logprobs)."""
        md = batch.attn_metadata
        inputs = self.stack_inputs(md, batch.input_ids, batch.position_ids, batch.multimodal_params)
        return self.llm.model(
            md,
            inputs_embeds=inputs.inputs_embeds,
            position_ids=inputs.position_ids,
            cos_sin=inputs.cos_sin,
            deepstack_embeds=inputs.deepstack_embeds,
        )

    def lm_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The LM head over the given rows of hidden states."""
        return self.llm.lm_logits(hidden_states)

    def forward(
        self,
        attn_metadata: AttentionMetadata,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        multimodal_params: Sequence[MultimodalParams] = (),
        return_context_logits: bool = False,
    ) -> torch.Tensor:
        inputs = self.stack_inputs(attn_metadata, input_ids, position_ids, multimodal_params)
        return self.forward_stack(attn_metadata, inputs, return_context_logits)

    def forward_stack(
        self,
        attn_metadata: AttentionMetadata,
        inputs: StackInputs,
        return_context_logits: bool = False,
    ) -> torch.Tensor:
        """The decoder stack and the LM head over `stack_inputs`' output."""
        return self.llm(
            attn_metadata,
            inputs_embeds=inputs.inputs_embeds,
            position_ids=inputs.position_ids,
            cos_sin=inputs.cos_sin,
            deepstack_embeds=inputs.deepstack_embeds,
            return_context_logits=return_context_logits,
        )

    def stack_inputs(
        self,
        attn_metadata: AttentionMetadata,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        multimodal_params: Sequence[MultimodalParams] = (),
    ) -> StackInputs:
        """Everything before the decoder stack: token and media embeddings (the vision tower
        runs here), the mRoPE delta bookkeeping and the rotary table rows of the step."""
        num_ctx = attn_metadata.num_contexts
        num_ctx_tokens = attn_metadata.num_ctx_tokens
        inputs_embeds = self.llm.model.embed_tokens(input_ids)
        deepstack = None
        if num_ctx:
            deepstack = self._merge_vision(inputs_embeds, multimodal_params)
        seq_slots = attn_metadata.seq_slots
        mrope = _prepare_qwen_vl_mrope_config(
            self.mrope_position_deltas_cache,
            seq_slots[:num_ctx],
            seq_slots[num_ctx : attn_metadata.num_seqs],
            multimodal_params,
            self.rotary_emb,
            position_ids,
            num_ctx_tokens,
        )
        positions = apply_generation_deltas(
            position_ids, mrope["mrope_position_deltas"], num_ctx_tokens
        )
        ctx_cos_sin = mrope["mrope_rotary_cos_sin"]
        if ctx_cos_sin is None:
            cos_sin = self.rotary_emb.get_cos_sin(positions[:, 0, :])
        elif attn_metadata.num_generations:
            gen_cos_sin = self.rotary_emb.get_cos_sin(positions[:, 0, num_ctx_tokens:])
            cos_sin = torch.cat([ctx_cos_sin, gen_cos_sin])
        else:
            cos_sin = ctx_cos_sin
        return StackInputs(inputs_embeds, positions, cos_sin, deepstack)

    def compute_logits(
        self, hidden_states: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The LM head over each request's last token of the stack's output."""
        return self.llm.compute_logits(hidden_states, attn_metadata)

    def per_slot_state(self) -> dict[str, torch.Tensor]:
        """The mRoPE delta of each slot, then the text stack's own per-slot state."""
        return {
            "mrope_position_deltas": self.mrope_position_deltas_cache,
            **self.llm.per_slot_state(),
        }

    # ------------------------------------------------------------------ piecewise graphs
    def why_not_piecewise(self) -> str:
        """The piecewise graphs capture the text stack between its token mixers (attention,
        DeltaNet), so each layer must split there and be row-wise otherwise (the stack's
        `piecewise_blocker`); the class opts in by its registration."""
        reason = self.llm.model.piecewise_blocker()
        if reason:
            return reason
        return "" if self.supports_piecewise else not_registered(type(self))

    def as_piecewise(self) -> PiecewiseModel | None:
        return None if self.why_not_piecewise() else self

    def piecewise_stack(self) -> PiecewiseStack:
        """The text stack and the sizes of its static inputs (`why_not_piecewise()` is "")."""
        reason = self.why_not_piecewise()
        if reason:
            raise ValueError(f"piecewise graphs: {reason}")
        return piecewise_stack_of(self.llm.model, self.deepstack_levels)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        text, vision = split_vl_weights(weights)
        self.llm.load_weights(text)
        if self.visual is not None:
            self.visual.load_weights(vision)
        elif vision and self.vision_language:
            raise ValueError(f"unexpected vision weights: {sorted(vision)[:3]} ...")
