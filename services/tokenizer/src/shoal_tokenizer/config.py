"""Tokenizer service settings: one frozen model, loaded once in ``main`` and passed down."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class TokenizerConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    models: dict[str, Path] = Field(min_length=1)
    """Served model name -> folder holding its Hugging Face tokenizer files."""

    host: str = "127.0.0.1"
    """Address the gRPC server binds."""

    port: int = Field(default=50051, ge=1, le=65535)
    """Port the gRPC server binds."""

    max_concurrent_rpcs: int = Field(default=256, ge=1)
    """RPCs served at once; more are refused with RESOURCE_EXHAUSTED rather than queued."""
