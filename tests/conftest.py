"""Test tiers: tests/unit (pure logic, seconds) and tests/integration (real processes)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Unit tests first, in a process no fleet test has used yet (their gRPC asyncio servers have
    # hung after the fleet tests' gRPC clients in the same process). Tests that kill fleet
    # processes run last, so the shared fleets serve every other test whole.
    items.sort(
        key=lambda item: (
            item.get_closest_marker("destructive") is not None,
            item.get_closest_marker("integration") is not None,
        )
    )
