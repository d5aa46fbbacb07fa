from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRECOPY: _ClassVar[Mode]
    STOP_AND_COPY: _ClassVar[Mode]
    RECOMPUTE: _ClassVar[Mode]
    PRECOPY_UNWARMED: _ClassVar[Mode]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    MIGRATED: _ClassVar[Outcome]
    REFUSED: _ClassVar[Outcome]
    FAILED: _ClassVar[Outcome]
    GONE: _ClassVar[Outcome]
PRECOPY: Mode
STOP_AND_COPY: Mode
RECOMPUTE: Mode
PRECOPY_UNWARMED: Mode
OUTCOME_UNSPECIFIED: Outcome
MIGRATED: Outcome
REFUSED: Outcome
FAILED: Outcome
GONE: Outcome

class MigrateRequest(_message.Message):
    __slots__ = ("request_id", "target_engine_id", "reason", "mode")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target_engine_id: str
    reason: str
    mode: Mode
    def __init__(self, request_id: _Optional[str] = ..., target_engine_id: _Optional[str] = ..., reason: _Optional[str] = ..., mode: _Optional[_Union[Mode, str]] = ...) -> None: ...

class MigrationResult(_message.Message):
    __slots__ = ("migration_id", "request_id", "source_engine_id", "target_engine_id", "outcome", "reason", "detail", "stages", "bytes", "blocks", "kv_tokens", "total_tokens", "downtime_ms", "duration_ms", "warm_tokens", "phase_ms", "source_step_ms", "source_step_ms_before", "code", "target_cached_blocks")
    class PhaseMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DOWNTIME_MS_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    WARM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PHASE_MS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_STEP_MS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    request_id: str
    source_engine_id: str
    target_engine_id: str
    outcome: Outcome
    reason: str
    detail: str
    stages: int
    bytes: int
    blocks: int
    kv_tokens: int
    total_tokens: int
    downtime_ms: float
    duration_ms: float
    warm_tokens: int
    phase_ms: _containers.ScalarMap[str, float]
    source_step_ms: float
    source_step_ms_before: float
    code: str
    target_cached_blocks: int
    def __init__(self, migration_id: _Optional[str] = ..., request_id: _Optional[str] = ..., source_engine_id: _Optional[str] = ..., target_engine_id: _Optional[str] = ..., outcome: _Optional[_Union[Outcome, str]] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ..., stages: _Optional[int] = ..., bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., downtime_ms: _Optional[float] = ..., duration_ms: _Optional[float] = ..., warm_tokens: _Optional[int] = ..., phase_ms: _Optional[_Mapping[str, float]] = ..., source_step_ms: _Optional[float] = ..., source_step_ms_before: _Optional[float] = ..., code: _Optional[str] = ..., target_cached_blocks: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("deadline_s", "leave_rotation", "rejoin_after_s")
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    LEAVE_ROTATION_FIELD_NUMBER: _ClassVar[int]
    REJOIN_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    deadline_s: float
    leave_rotation: bool
    rejoin_after_s: float
    def __init__(self, deadline_s: _Optional[float] = ..., leave_rotation: _Optional[bool] = ..., rejoin_after_s: _Optional[float] = ...) -> None: ...

class DrainResult(_message.Message):
    __slots__ = ("migrated", "failed", "remaining", "migrations")
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    migrated: int
    failed: int
    remaining: int
    migrations: _containers.RepeatedCompositeFieldContainer[MigrationResult]
    def __init__(self, migrated: _Optional[int] = ..., failed: _Optional[int] = ..., remaining: _Optional[int] = ..., migrations: _Optional[_Iterable[_Union[MigrationResult, _Mapping]]] = ...) -> None: ...

class ListMigrationsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListMigrationsResult(_message.Message):
    __slots__ = ("migrations",)
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    migrations: _containers.RepeatedCompositeFieldContainer[MigrationResult]
    def __init__(self, migrations: _Optional[_Iterable[_Union[MigrationResult, _Mapping]]] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("migration_id", "request_id", "source_engine_id", "num_blocks", "max_blocks", "bytes_per_block", "tensor_parallel_size", "pipeline_parallel_size", "recompute", "block_hashes")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    request_id: str
    source_engine_id: str
    num_blocks: int
    max_blocks: int
    bytes_per_block: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    recompute: bool
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, migration_id: _Optional[str] = ..., request_id: _Optional[str] = ..., source_engine_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., max_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., recompute: _Optional[bool] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class PrepareReply(_message.Message):
    __slots__ = ("accepted", "detail", "kv_address", "staging_ttl_s", "code", "cached_blocks")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STAGING_TTL_S_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    detail: str
    kv_address: str
    staging_ttl_s: float
    code: str
    cached_blocks: int
    def __init__(self, accepted: _Optional[bool] = ..., detail: _Optional[str] = ..., kv_address: _Optional[str] = ..., staging_ttl_s: _Optional[float] = ..., code: _Optional[str] = ..., cached_blocks: _Optional[int] = ...) -> None: ...

class WarmRequest(_message.Message):
    __slots__ = ("migration_id", "token_ids", "kv_tokens")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_tokens: int
    def __init__(self, migration_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., kv_tokens: _Optional[int] = ...) -> None: ...

class WarmReply(_message.Message):
    __slots__ = ("warmed", "detail")
    WARMED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    warmed: bool
    detail: str
    def __init__(self, warmed: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("migration_id", "add_request", "kv_tokens", "last_output_at")
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    ADD_REQUEST_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_OUTPUT_AT_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    add_request: bytes
    kv_tokens: int
    last_output_at: float
    def __init__(self, migration_id: _Optional[str] = ..., add_request: _Optional[bytes] = ..., kv_tokens: _Optional[int] = ..., last_output_at: _Optional[float] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("accepted", "detail")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    detail: str
    def __init__(self, accepted: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("migration_id",)
    MIGRATION_ID_FIELD_NUMBER: _ClassVar[int]
    migration_id: str
    def __init__(self, migration_id: _Optional[str] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
