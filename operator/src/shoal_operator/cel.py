"""CEL rules (``x-kubernetes-validations``) evaluated in Python, as the API server would.

The spec models check their own rules on load with this, so a spec that reached the operator
without the API server's checks (an older CRD, a test) is refused with the same message.
"""

from __future__ import annotations

import functools
from typing import Any

import celpy


@functools.cache
def _program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def typed(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` with every field of OpenAPI type ``number`` a float (the API server's CEL
    types them as double, so ``2`` and ``1.0`` compare)."""
    kind = schema.get("type")
    if kind == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind == "object" and isinstance(value, dict):
        props = schema.get("properties", {})
        return {k: typed(v, props.get(k, {})) for k, v in value.items()}
    if kind == "array" and isinstance(value, list):
        return [typed(v, schema.get("items", {})) for v in value]
    return value


def failures(rules: list[dict[str, str]], value: dict[str, Any]) -> list[str]:
    """The messages of the rules that ``value`` (as ``self``) breaks: a rule's
    ``messageExpression`` evaluated where it has one, else its ``message``."""
    activation = {"self": celpy.json_to_cel(value)}
    broken = []
    for rule in rules:
        result = _program(rule["rule"]).evaluate(activation)
        if result is not True and result != celpy.celtypes.BoolType(True):
            expression = rule.get("messageExpression")
            broken.append(str(_program(expression).evaluate(activation)) if expression else rule["message"])
    return broken
