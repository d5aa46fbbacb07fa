"""What the engine service tells its KV connector, typed: the connector's settings (vLLM's
``kv_connector_extra_config``) and a request's KV load (its ``kv_transfer_params``).

Both cross vLLM as plain dicts (vLLM copies them between its processes); they are built from
and read into these structs at the edges, so a misspelt or missing key fails where it is
made instead of silently loading nothing."""

from __future__ import annotations

from typing import Any, cast

import msgspec

PARAMS_KEY = "shoal"
"""The key of Shoal's entry in a request's ``kv_transfer_params``."""


class KvLoad(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A request that arrives by migration: the first ``tokens`` tokens of its KV wait in the
    staging area of ``migration``."""

    migration: str
    tokens: int
    keep: bool = False
    """Leave the staging area for the commit (a warm-up before the stop); else it is freed once
    loaded."""


class KvParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Shoal's entry in a request's ``kv_transfer_params``."""

    id: str
    """Shoal's request id (vLLM's own differs)."""
    load: KvLoad | None = None

    def to_vllm(self) -> dict[str, Any]:
        return {PARAMS_KEY: msgspec.to_builtins(self, order="deterministic")}

    @classmethod
    def from_vllm(cls, kv_transfer_params: dict[str, Any] | None) -> KvParams | None:
        """Shoal's entry of a request's ``kv_transfer_params``; None for requests without one."""
        raw = (kv_transfer_params or {}).get(PARAMS_KEY)
        return None if raw is None else msgspec.convert(raw, cls)


class ConnectorSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The connector's settings, from the engine's (``vllm_backend``)."""

    control_address: str
    """Where the engine service reaches the KV agent (rank 0's; further ranks go past it)."""
    data_address: str
    """Where the KV agent's data socket binds."""
    host: str
    """Where other engines reach the data socket: a bind to ``::`` names no one address."""
    transport: str = "tcp"
    staging_bytes: int = 1 << 30
    max_pairs: int = 4
    debug_reads: bool = False
    tls_dir: str = ""
    timeout_s: float = 10.0
    """A transfer never outlasts the migration step it serves."""
    chunk_bytes: int = 8 << 20
    staging_ttl_s: float = 60.0

    def to_vllm(self) -> dict[str, Any]:
        return cast(dict[str, Any], msgspec.to_builtins(self))

    @classmethod
    def from_vllm(cls, extra_config: dict[str, Any]) -> ConnectorSettings:
        return msgspec.convert(extra_config, cls)
