"""Live migration: move a running request, with its KV cache, to another engine.

One ``MigrationManager`` per engine plays both roles. As the **source** (``SourceMove``, a state
machine of these steps)::

    prepare   target reserves room or refuses            (gRPC PrepareMigration)
    pre-copy  full KV blocks -> target's staging area,    (KV agent SendBlocks, in stages,
              while the request keeps decoding here        bounded by max stages / last-stage blocks)
    warm      the target takes the staged blocks into     (gRPC WarmMigration, vLLM engines)
              its prefix cache before the stop
    tail      the partly filled last block as far as it   (SendBlocks partial=True,
              is written, the request still decoding        running=True)
    stop      at a step boundary, no final piece; vLLM     (EngineService.stop_for_migration,
              keeps the blocks while the agent holds them   KV agent Hold)
    last      nothing, if the tokens written since the     (SendBlocks partial=True,
              tail are few and in its block (the target     release=True; or Release)
              computes them); else the blocks filled
              since, the partial one too; then the blocks
              are released
    commit    token state -> target, which admits          (gRPC CommitMigration)
              prompt + outputs so far with the KV loaded
    handover  owner record in Redis (fencing generation),  (hand-over piece to the router)
              the router moves the request to the target
    free      vLLM freed the source's blocks at the stop

Full blocks never change again, so they are copied while the request decodes; only the few
blocks filled since the last pre-copy stage, and the partly filled last one, are copied while
the request is stopped. The target loads the KV of every token but the last sampled one, which
it computes like a decode step, so the output goes on exactly as if the request never moved.
Every step has a deadline. A target that refuses or fails before the stop leaves the request
running here; one that fails after the stop gets the request back here: it resumes from its
tokens, with this engine's prefix cache still holding its KV. Every move ends with a code
(``shoal_protos.moves.MoveCode``) that says why.

As the **target** (``TargetSide``) it answers ``PrepareMigration`` / ``WarmMigration`` /
``CommitMigration`` / ``CancelMigration``; a staging area with no commit is freed when its
reservation times out.

The modules: ``source`` (one move out), ``target`` (moves in), ``drain`` (emptying the engine),
``peers`` (the other engines: target choice, control channels, KV links, aborts passed on),
``records`` (history, metrics, Redis records), ``common`` (errors, the KV agent's line, the
clock), ``manager`` (the engine's one entry point, and its gRPC servicer).
"""

from shoal_engine.migration.common import (
    MIN_TOKENS_LEFT,
    AgentClient,
    MigrationError,
    mean_step_ms,
    target_phases_ms,
)
from shoal_engine.migration.manager import EngineControlServicer, MigrationManager
from shoal_engine.migration.peers import MAX_CHANNELS

__all__ = [
    "MAX_CHANNELS",
    "MIN_TOKENS_LEFT",
    "AgentClient",
    "EngineControlServicer",
    "MigrationError",
    "MigrationManager",
    "mean_step_ms",
    "target_phases_ms",
]
