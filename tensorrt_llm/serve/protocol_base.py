"""The base classes of the OpenAI protocol models (openai_protocol.py, openai_logprobs.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class OpenAIBaseModel(BaseModel):
    # NOTE: allow_inf_nan=False so that a NaN/inf sampling knob is a 400, never a crash later.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StrictRequestModel(OpenAIBaseModel):
    """Request objects: an unknown key is a validation error (a 400 naming it)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
