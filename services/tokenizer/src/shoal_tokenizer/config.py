"""Tokenizer service settings: one frozen model, loaded once in ``main`` and passed down."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from shoal_protos.addresses import resolve_bind_host


class TokenizerConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    models: dict[str, Path] = Field(min_length=1)
    """Served model name -> folder holding its Hugging Face tokenizer files."""

    revision: str | None = Field(default=None, min_length=1)
    """Hugging Face revision (branch, tag or commit) of each model named by Hub repository; None:
    the default branch. Local folders have none. A gated model's token comes from the
    ``HF_TOKEN`` environment variable, which ``huggingface_hub`` reads itself."""

    host: str = "127.0.0.1"
    """Address of this tokenizer as the pod knows itself (on Kubernetes the pod's IP; routers
    reach it through its Service): the gRPC server binds it unless ``bind_host`` says otherwise."""

    bind_host: str | None = None
    """Address the gRPC server binds; None: ``host``. ``::`` listens on every IPv6 and IPv4
    address (so that ``kubectl port-forward``, which connects to the pod's loopback, reaches it);
    gRPC takes ``0.0.0.0`` as every address too."""

    port: int = Field(default=50051, ge=1, le=65535)
    """Port the gRPC server binds."""

    max_concurrent_rpcs: int = Field(default=256, ge=1)
    """RPCs served at once; more are refused with RESOURCE_EXHAUSTED rather than queued."""

    @property
    def listen_host(self) -> str:
        """The address the gRPC server binds: ``bind_host``, else ``host``."""
        return resolve_bind_host(self.bind_host, self.host)
