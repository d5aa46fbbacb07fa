"""Server-side apply for kmock, which otherwise merges every PATCH as a JSON merge patch.

A real API server answers ``PATCH`` with ``Content-Type: application/apply-patch+yaml`` by
structured merge (``sigs.k8s.io/structured-merge-diff``): each field manager owns the fields it
applied; applying again sets what the new configuration holds, and removes each field the same
manager applied before and leaves out now, unless another manager owns it too. Lists are merged
item by item where Kubernetes declares them maps keyed by some fields (containers by name, env
by name...), replaced whole elsewhere. ``ApplyingEmulator`` does that for the kinds the operator
writes, so tests see what a real server would keep and drop; a merge patch or a create records
its manager's fields as an update (``fieldManager`` of the request, else ``unnamed``).

What it leaves out: ownership of map and list nodes themselves (only leaves and list items are
owned), conflicts (the operator always forces), and field validation.
"""

from __future__ import annotations

import copy
from typing import Any

import kmock as kmock_lib

APPLY_PATCH = "application/apply-patch+yaml"

# Lists Kubernetes declares as maps (``+listType=map``), by field name, with their keys.
_LIST_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "imagePullSecrets": ("name",),
    "ownerReferences": ("uid",),
    "topologySpreadConstraints": ("topologyKey", "whenUnsatisfiable"),
}
# Container ports are keyed by containerPort and protocol, Service ports by port and protocol.
_PORT_KEYS = (("containerPort", "protocol"), ("port", "protocol"))

Path = tuple[Any, ...]


def _keys(field: str, items: list[Any]) -> tuple[str, ...] | None:
    """The key fields of the list ``field`` holds, None when it is replaced whole."""
    if not items or not all(isinstance(item, dict) for item in items):
        return _LIST_KEYS.get(field)
    if field == "ports":
        return next((keys for keys in _PORT_KEYS if keys[0] in items[0]), None)
    return _LIST_KEYS.get(field)


def _key_of(item: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, tuple[Any, ...]]:
    # An absent protocol is TCP, as the API server defaults it.
    return ("k", tuple(item.get(k, "TCP" if k == "protocol" else None) for k in keys))


def fields(value: Any, field: str = "", prefix: Path = ()) -> set[Path]:
    """The paths ``value`` sets: leaves, and the items of keyed lists."""
    if isinstance(value, dict) and value:
        found: set[Path] = set()
        for key, item in value.items():
            found |= fields(item, key, (*prefix, key))
        return found
    if isinstance(value, list) and (keys := _keys(field, value)) is not None:
        found = set()
        for item in value:
            at = (*prefix, _key_of(item, keys))
            found |= {at} | fields(item, "", at)
        return found
    return {prefix}


def _child(node: Any, step: Any, field: str) -> Any:
    if isinstance(step, tuple) and isinstance(node, list):
        keys = _keys(field, node)
        return next((item for item in node if keys and _key_of(item, keys) == step), None)
    return node.get(step) if isinstance(node, dict) else None


def _remove(obj: dict[str, Any], path: Path) -> None:
    """Remove what ``path`` names from ``obj``, then maps and keyed lists left empty above it."""
    parents: list[tuple[Any, Any, str]] = []
    node: Any = obj
    field = ""
    for step in path[:-1]:
        parents.append((node, step, field))
        node = _child(node, step, field)
        field = step if isinstance(step, str) else ""
        if node is None:
            return
    _remove_step(node, path[-1], field)
    for parent, step, parent_field in reversed(parents):
        child = _child(parent, step, parent_field)
        if child not in ({}, []):
            break
        _remove_step(parent, step, parent_field)


def _remove_step(node: Any, step: Any, field: str) -> None:
    if isinstance(node, dict):
        node.pop(step, None)
    elif isinstance(node, list):
        keys = _keys(field, node)
        node[:] = [item for item in node if not (keys and _key_of(item, keys) == step)]


def merge(live: Any, config: Any, field: str = "") -> Any:
    """``config`` set onto ``live``: maps key by key, keyed lists item by item (the applied
    items in their order, then the others), anything else replaced."""
    if isinstance(live, dict) and isinstance(config, dict):
        result = dict(live)
        for key, value in config.items():
            result[key] = merge(live.get(key), value, key)
        return result
    if isinstance(live, list) and isinstance(config, list) and (keys := _keys(field, config)):
        by_key = {_key_of(item, keys): item for item in live if isinstance(item, dict)}
        applied = [merge(by_key.get(_key_of(item, keys)), item) for item in config]
        taken = {_key_of(item, keys) for item in config}
        return applied + [item for item in live if _key_of(item, keys) not in taken]
    return copy.deepcopy(config)


def merge_patch(live: Any, wanted: Any) -> Any:
    """The JSON merge patch that turns ``live`` into ``wanted`` (how the result is stored)."""
    if not (isinstance(live, dict) and isinstance(wanted, dict)):
        return wanted
    patch = {key: None for key in live if key not in wanted}
    for key, value in wanted.items():
        if key not in live:
            patch[key] = value
        elif live[key] != value:
            patch[key] = merge_patch(live[key], value)
    return patch


class ApplyingEmulator(kmock_lib.KubernetesEmulator):
    """kmock's Kubernetes emulator with server-side apply (use it with
    ``@pytest.mark.kmock(cls=ApplyingEmulator)``)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.managers: dict[tuple[Any, ...], dict[tuple[str, str], set[Path]]] = {}
        """Per object (kmock's key): each (manager, operation)'s fields."""

    async def _handle(self, request: Any) -> Any:
        if request.resource is None or request.subresource:
            return await super()._handle(request)
        manager = request.params.get("fieldManager", "unnamed")
        content_type = request.headers.get("Content-Type", "")
        if request.method.value == "PATCH" and content_type.startswith(APPLY_PATCH):
            self._apply(request, manager)
        elif request.action == kmock_lib.action.CREATE and isinstance(request.data, dict):
            meta = request.data.get("metadata") or {}
            key = (request.resource, request.namespace or meta.get("namespace"), meta.get("name"))
            self.managers[key] = {(manager, "Update"): fields(request.data)}
        elif request.action == kmock_lib.action.UPDATE and isinstance(request.data, dict):
            self._record_update((request.resource, request.namespace, request.name), manager, request.data)
        return await super()._handle(request)

    def _record_update(self, key: tuple[Any, ...], manager: str, patch: dict[str, Any]) -> None:
        owned = self.managers.setdefault(key, {})
        changed = fields(patch)
        for who, paths in owned.items():
            if who != (manager, "Update"):
                paths.difference_update(changed)
        owned.setdefault((manager, "Update"), set()).update(changed)

    def _apply(self, request: Any, manager: str) -> None:
        key = (request.resource, request.namespace, request.name)
        config = request.data
        owned = self.managers.setdefault(key, {})
        live = self._objects[key] if key in self._objects else None  # noqa: SIM401 (no .get)
        if live is None or live.deleted:
            owned.clear()
            owned[(manager, "Apply")] = fields(config)
            # Served as the create it is (kmock picks its reaction by method and action, and
            # among the requests it recorded: this one is changed in place).
            _serve_as(request, "POST", kmock_lib.action.CREATE, config)
            return
        current = copy.deepcopy(dict(live.raw))
        applied = fields(config)
        others = set().union(*(paths for who, paths in owned.items() if who != (manager, "Apply")))
        gone = owned.get((manager, "Apply"), set()) - applied - others
        # Whole list items first: the leaves under one go with it (and cannot name it once emptied).
        for path in sorted(gone, key=len):
            _remove(current, path)
        wanted = merge(current, config)
        # Forced: fields this apply sets to a new value are no longer the other managers'.
        for who, paths in owned.items():
            if who != (manager, "Apply"):
                paths.difference_update({p for p in applied if _at(current, p) != _at(wanted, p)})
        owned[(manager, "Apply")] = applied
        _serve_as(request, "PATCH", kmock_lib.action.UPDATE, merge_patch(dict(live.raw), wanted))


def _serve_as(request: Any, method: str, action: Any, data: Any) -> None:
    """Turn the apply ``request`` into the create or merge patch that stores its result (kmock's
    requests are frozen; kmock sets their fields this way itself)."""
    object.__setattr__(request, "method", kmock_lib.method(method))
    object.__setattr__(request, "action", action)
    object.__setattr__(request, "data", data)


def _at(obj: Any, path: Path) -> Any:
    node, field = obj, ""
    for step in path:
        node = _child(node, step, field)
        field = step if isinstance(step, str) else ""
        if node is None:
            return None
    return node
