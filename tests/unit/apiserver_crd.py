"""The checks a Kubernetes 1.32 API server applies to a CustomResourceDefinition on create, in Python.

No API server runs in unit tests, and the one that does in a cluster refuses a CRD only when the
chart is installed. This module reproduces, from ``k8s.io/apiextensions-apiserver`` (Kubernetes
1.32), the checks that refuse a CRD, so a unit test finds the refusal first. It also admits a
custom object the way the API server does (prune, default, validate, CEL) to test rules against.

What each part reproduces (functions of ``staging/src/k8s.io/apiextensions-apiserver``):

* ``pkg/apis/apiextensions/validation/validation.go``: ``ValidateCustomResourceDefinition``,
  ``validateCustomResourceDefinitionSpec`` (group, scope, names, versions, storage version,
  ``preserveUnknownFields`` with defaults, subresources, printer columns, selectable fields),
  ``validateCustomResourceDefinitionValidation`` (the order: structural schema, then defaults,
  then CEL, each only when the step before found nothing; the status-subresource root fields;
  the whole-schema cost total against ``StaticEstimatedCRDCostLimit``) and
  ``ValidateCustomResourceDefinitionOpenAPISchema`` with ``specStandardValidatorV3.validate``
  (unsupported keywords, ``uniqueItems``, ``properties`` with ``additionalProperties``, list and
  map types, list-map keys, rule fields, CEL compilation, ``getExpressionCost`` per rule against
  ``StaticEstimatedCostLimit``, ``oldSelf`` where items cannot be correlated).
  The one-version case follows the v1-to-internal conversion, which hoists a schema every
  version shares to ``spec.validation`` (hence the paths in the API server's messages).
* ``.../validation/cel_validation.go``: ``CELSchemaContext`` cardinality (the product of the
  ``maxItems``/``maxProperties`` of enclosing lists and maps), ``TotalCost``.
* ``pkg/apiserver/schema/validation.go`` and ``complete.go``: ``ValidateStructural`` (a type on
  every node, metadata limited to name/generateName, nothing but value validation inside
  ``allOf``/``anyOf``/``oneOf``/``not``, no ``additionalProperties`` at the root, the
  int-or-string exceptions) and ``validateStructuralCompleteness``.
* ``pkg/apiserver/schema/defaulting/validation.go``: ``ValidateDefaults``: every ``default`` is
  pruned (unknown fields are an error), checked against its own node's schema, and only then
  evaluated by the node's ``x-kubernetes-validations`` rules and those of the nodes under it,
  with ``self`` (and ``oldSelf``) bound to the default *as written*: the defaults of the fields
  inside it are not filled in first (``s.Default.Object`` goes to ``celValidator.Validate``
  untouched), so ``default: {}`` breaks every rule that reads a field of it.
* ``pkg/apiserver/schema/pruning/algorithm.go`` (``Prune``), ``defaulting/algorithm.go``
  (``Default``), ``pkg/apiserver/validation/validation.go`` (``ValidateCustomResource``, the
  mapping of kube-openapi's errors to field errors) with kube-openapi's ``validate`` package.
* ``pkg/apiserver/schema/cel/compilation.go`` (``Compile``, ``compileRule``, ``maxCardinality``,
  the ``sizeEstimator``) with ``k8s.io/apiserver/pkg/cel/common/schemas.go`` (``SchemaDeclType``:
  the sizes the cost estimate assumes from ``maxLength``/``maxItems``/``maxProperties`` or, where
  they are missing, from ``MaxRequestSizeBytes``), and ``cel/validation.go`` (``Validator``: which
  nodes' rules run, ``self``/``oldSelf`` binding, the wording of its errors).
* ``k8s.io/apiserver/pkg/apis/cel/config.go``: ``PerCallLimit``, ``RuntimeCELCostBudget``,
  ``MaxRequestSizeBytes``; ``apimachinery/pkg/util/validation/field/errors.go``: message format.

Approximations, said plainly:

* CEL is parsed and evaluated by ``celpy`` (cel-python), not cel-go. Compilation is parsing plus
  a light type check of what the API server's checker refuses most often: fields a rule reads
  that its node does not declare, unknown functions, a result that is not a bool. Overloads are
  not resolved.
* The cost estimate ports cel-go's ``checker.CostEstimator`` rules (per-node costs, O(n) string
  and list operations, comprehensions times the size of what they iterate) onto celpy's tree.
  Where this port is unsure, it means to err high (k8s library functions it does not model are
  charged a full scan of their input; an unknown result size is unbounded, as in cel-go;
  scalars count 1 where upstream may count 0), so that a rule it accepts is accepted upstream;
  a rule it refuses may, rarely, be accepted upstream.
  ``PerCallLimit`` is a run-time limit upstream (a rule whose evaluation costs more fails),
  not a check on create; :func:`cost_report` gives each rule's one-evaluation estimate, which
  a test may hold under it as a stricter, conservative check of its own.
* Not reproduced: ``format`` checks of values, metadata checks of defaults inside embedded
  resources, ``optionalOldSelf`` evaluation (celpy has no optionals), the run-time cost budget,
  conversion webhooks' TLS, and exact Go ``%#v`` printing of structs (maps and lists print
  like Go's; a rule in a compile error prints its rule and message only).
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from string import ascii_lowercase, ascii_uppercase
from typing import Any

import celpy
import lark

# k8s.io/apiserver/pkg/apis/cel/config.go and apiextensions/validation/validation.go.
PER_CALL_LIMIT = 1_000_000
RUNTIME_CEL_COST_BUDGET = 10_000_000
STATIC_ESTIMATED_COST_LIMIT = 10_000_000
STATIC_ESTIMATED_CRD_COST_LIMIT = 100_000_000
MAX_REQUEST_SIZE_BYTES = 3 * 1024 * 1024
UINT64_MAX = 2**64 - 1

# --------------------------------------------------------------------------------------------
# Field errors as k8s.io/apimachinery/pkg/util/validation/field prints them.

_OMIT = object()


@dataclass(frozen=True)
class FieldError:
    """One ``field.Error``: ``str()`` is the API server's ``<path>: <type>[: <value>]: <detail>``."""

    kind: str
    path: str
    value: Any = _OMIT
    detail: str = ""

    def __str__(self) -> str:
        body = self.kind
        if self.kind not in _VALUELESS and self.value is not _OMIT:
            body += f": {go_value(self.value)}"
        if self.detail:
            body += f": {self.detail}"
        return f"{self.path}: {body}"


_VALUELESS = {"Required value", "Forbidden", "Too long", "Internal error"}


def invalid(path: str, value: Any, detail: str) -> FieldError:
    return FieldError("Invalid value", path, value, detail)


def required(path: str, detail: str = "") -> FieldError:
    return FieldError("Required value", path, detail=detail)


def forbidden(path: str, detail: str) -> FieldError:
    return FieldError("Forbidden", path, detail=detail)


def not_supported(path: str, value: Any, values: list[str]) -> FieldError:
    detail = "supported values: " + ", ".join(json.dumps(v) for v in values) if values else ""
    return FieldError("Unsupported value", path, value, detail)


def go_float(number: float) -> str:
    """``fmt.Sprint(float64)``: shortest digits; exponent form from 1e+06 up and below 1e-04."""
    if math.isinf(number) or math.isnan(number):
        return {math.inf: "+Inf", -math.inf: "-Inf"}.get(number, "NaN")
    if number == 0:
        return "0"
    sign, digits, exponent = Decimal(repr(number)).normalize().as_tuple()
    text = "".join(map(str, digits))
    point = len(text) + int(exponent)  # digits before the decimal point
    prefix = "-" if sign else ""
    if point - 1 < -4 or point - 1 >= 6:  # strconv's %g with the shortest precision
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        return f"{prefix}{mantissa}e{point - 1:+03d}"
    if point <= 0:
        return f"{prefix}0.{'0' * -point}{text}"
    if point >= len(text):
        return prefix + text + "0" * (point - len(text))
    return f"{prefix}{text[:point]}.{text[point:]}"


def go_value(value: Any) -> str:
    """A bad value as ``field.Error`` prints it (``%q`` strings, ``%v`` numbers, ``%#v`` else)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return go_float(value)
    if isinstance(value, _Raw):
        return str(value)
    if isinstance(value, str):
        return _go_quote(value)
    return _go_sharp(value)


def _go_quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _go_sharp(value: Any) -> str:
    """Go's ``%#v`` of a decoded JSON value (maps print with sorted keys, as fmt does)."""
    if isinstance(value, dict):
        inner = ", ".join(f"{_go_quote(k)}:{_go_sharp(v)}" for k, v in sorted(value.items()))
        return "map[string]interface {}{" + inner + "}"
    if isinstance(value, list):
        return "[]interface {}{" + ", ".join(_go_sharp(v) for v in value) + "}"
    if value is None:
        return "interface {}(nil)"
    if isinstance(value, bool | int | str):
        return go_value(value)
    if isinstance(value, float):
        return go_float(value)
    return repr(value)


def _child(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _key(path: str, key: str | int) -> str:
    return f"{path}[{key}]"


def _rule_value(rule: dict[str, Any]) -> str:
    """The ``%#v`` of an ``apiextensions.ValidationRule``, as far as it is useful to read."""
    return (
        f"apiextensions.ValidationRule{{Rule:{_go_quote(str(rule.get('rule', '')))}, "
        f"Message:{_go_quote(str(rule.get('message', '')))}}}"
    )


class _Raw(str):
    """A value printed as is (a Go struct or list the API server prints with ``%#v``)."""

    __slots__ = ()


# --------------------------------------------------------------------------------------------
# Structural schemas: pkg/apiserver/schema/validation.go (ValidateStructural) and complete.go.

ROOT, ITEM, FIELD = "root", "item", "field"
_JUNCTORS = ("allOf", "anyOf", "oneOf")
_X_VALIDATIONS = "x-kubernetes-validations"
_PRESERVE = "x-kubernetes-preserve-unknown-fields"
_EMBEDDED = "x-kubernetes-embedded-resource"
_INT_OR_STRING = "x-kubernetes-int-or-string"
_LIST_TYPE = "x-kubernetes-list-type"
_LIST_MAP_KEYS = "x-kubernetes-list-map-keys"
_MAP_TYPE = "x-kubernetes-map-type"
# The keys of a Structural's value validation (what may appear inside allOf and the like).
_VALUE_VALIDATION = {
    "format", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxLength",
    "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "multipleOf", "enum",
    "maxProperties", "minProperties", "required", "allOf", "oneOf", "anyOf", "not",
}  # fmt: skip
_INT_OR_STRING_ANY_OF = [{"type": "integer"}, {"type": "string"}]


def structural_errors(schema: dict[str, Any], path: str) -> list[FieldError]:
    """``ValidateStructuralWithOptions`` for a CRD: invariants and completeness, sorted."""
    errors = _invariants(schema, ROOT, path)
    errors += _completeness(schema, schema, path, path)
    return sorted(errors, key=str)


def _invariants(node: dict[str, Any], level: str, path: str) -> list[FieldError]:
    """``validateStructuralInvariants``."""
    errors: list[FieldError] = []
    if node.get("type") == "array" and "items" not in node:
        errors.append(required(_child(path, "items"), "must be specified"))
    if isinstance(node.get("items"), dict):
        errors += _invariants(node["items"], ITEM, _child(path, "items"))
    for name, child in _properties(node).items():
        errors += _invariants(child, FIELD, _key(_child(path, "properties"), name))
    extra = node.get("additionalProperties")
    if extra is not None:
        if level == ROOT:
            errors.append(forbidden(_child(path, "additionalProperties"), "must not be used at the root"))
        if isinstance(extra, dict):
            errors += _invariants(extra, FIELD, _child(path, "additionalProperties"))
    errors += _extension_errors(node, path)
    errors += _value_validation_errors(
        node, node.get("anyOf") == _INT_OR_STRING_ANY_OF, _int_or_string_all_of(node), level, path
    )
    errors += _type_invariants(node, level, path)
    check_metadata = level == ROOT or bool(node.get(_EMBEDDED))
    for meta in ("kind", "apiVersion"):
        child = _properties(node).get(meta)
        if child is not None and check_metadata and child.get("type") != "string":
            errors.append(
                invalid(
                    _child(_key(_child(path, "properties"), meta), "type"),
                    child.get("type", ""),
                    "must be string",
                )
            )
    if "metadata" in _properties(node):
        errors += _metadata_invariants(
            node["properties"]["metadata"],
            check_metadata,
            level,
            _key(_child(path, "properties"), "metadata"),
        )
    if node.get(_EMBEDDED) and not node.get(_PRESERVE) and not _properties(node):
        errors.append(
            required(
                _child(path, "properties"),
                "must not be empty if x-kubernetes-embedded-resource is true without "
                "x-kubernetes-preserve-unknown-fields",
            )
        )
    return errors


def _properties(node: dict[str, Any]) -> dict[str, dict[str, Any]]:
    props = node.get("properties")
    return props if isinstance(props, dict) else {}


def _int_or_string_all_of(node: dict[str, Any]) -> bool:
    all_of = node.get("allOf")
    return bool(all_of) and isinstance(all_of[0], dict) and all_of[0].get("anyOf") == _INT_OR_STRING_ANY_OF


def _extension_errors(node: dict[str, Any], path: str) -> list[FieldError]:
    """``validateExtensions``."""
    errors = []
    if node.get(_INT_OR_STRING) and node.get(_PRESERVE):
        errors.append(
            invalid(_child(path, _PRESERVE), True, "must be false if x-kubernetes-int-or-string is true")
        )
    if node.get(_INT_OR_STRING) and node.get(_EMBEDDED):
        errors.append(
            invalid(_child(path, _EMBEDDED), True, "must be false if x-kubernetes-int-or-string is true")
        )
    return errors


def _type_invariants(node: dict[str, Any], level: str, path: str) -> list[FieldError]:
    """The type rules of ``validateStructuralInvariants``: a type on every node but the
    int-or-string and preserve-unknown-fields ones, ``object`` at the root."""
    errors = []
    kind = node.get("type", "")
    embedded = bool(node.get(_EMBEDDED))
    if embedded and kind != "object":
        message = "must be object if x-kubernetes-embedded-resource is true"
        errors.append(
            invalid(_child(path, "type"), kind, message) if kind else required(_child(path, "type"), message)
        )
    elif not kind and not node.get(_INT_OR_STRING) and not node.get(_PRESERVE):
        message = {
            ROOT: "must not be empty at the root",
            ITEM: "must not be empty for specified array items",
            FIELD: "must not be empty for specified object fields",
        }[level]
        errors.append(required(_child(path, "type"), message))
    if embedded and node.get("additionalProperties") is not None:
        errors.append(
            forbidden(
                _child(path, "additionalProperties"),
                "must not be used if x-kubernetes-embedded-resource is set",
            )
        )
    if level == ROOT and kind and kind != "object":
        errors.append(invalid(_child(path, "type"), kind, "must be object at the root"))
    return errors


# Keys a Structural keeps (others, such as ``example``, are dropped when it is built).
_STRUCTURAL_KEYS = (
    {"description", "type", "title", "default", "nullable", "properties", "items", "additionalProperties"}
    | _VALUE_VALIDATION
    | {_PRESERVE, _EMBEDDED, _INT_OR_STRING, _LIST_TYPE, _LIST_MAP_KEYS, _MAP_TYPE, _X_VALIDATIONS}
)


def _metadata_invariants(node: dict[str, Any], check: bool, level: str, path: str) -> list[FieldError]:
    """``validateStructuralMetadataInvariants``: at the root, metadata may only restrict
    ``name`` and ``generateName`` (its type and default are checked elsewhere)."""
    errors = []
    if check and node.get("type") != "object":
        errors.append(invalid(_child(path, "type"), node.get("type", ""), "must be object"))
    if level == ROOT:
        rest = {k: v for k, v in node.items() if k in _STRUCTURAL_KEYS and k not in ("type", "default")}
        if set(_properties(rest)) in ({"name", "generateName"}, {"name"}, {"generateName"}, set()):
            rest.pop("properties", None)
        if rest:
            errors.append(
                forbidden(
                    path,
                    "must not specify anything other than name and generateName, "
                    "but metadata is implicitly specified",
                )
            )
    return errors


def _value_validation_errors(
    node: dict[str, Any], skip_any_of: bool, skip_first_all_of_any_of: bool, level: str, path: str
) -> list[FieldError]:
    """``validateValueValidation``: what may appear under the junctors, and valid patterns."""
    errors: list[FieldError] = []
    for junctor in _JUNCTORS:
        if junctor == "anyOf" and skip_any_of:
            continue
        for i, nested in enumerate(node.get(junctor) or []):
            skip = junctor == "allOf" and i == 0 and skip_first_all_of_any_of
            errors += _nested_errors(nested, skip, level, _key(_child(path, junctor), i))
    if isinstance(node.get("not"), dict):
        errors += _nested_errors(node["not"], False, level, _child(path, "not"))
    pattern = node.get("pattern")
    if isinstance(pattern, str) and pattern:
        problem = go_regexp_error(pattern)
        if problem:
            errors.append(
                invalid(
                    _child(path, "pattern"),
                    pattern,
                    f"must be a valid regular expression, but isn't: {problem}",
                )
            )
    return errors


_NESTED_FORBIDDEN = (
    ("type", "must be empty to be structural"),
    ("additionalProperties", "must be undefined to be structural"),
    ("default", "must be undefined to be structural"),
    ("title", "must be empty to be structural"),
    ("description", "must be empty to be structural"),
    ("nullable", "must be false to be structural"),
    ("externalDocs", "must be undefined to be structural"),
    (_PRESERVE, "must be false to be structural"),
    (_EMBEDDED, "must be false to be structural"),
    (_INT_OR_STRING, "must be false to be structural"),
    (_LIST_MAP_KEYS, "must be empty to be structural"),
    (_LIST_TYPE, "must be undefined to be structural"),
    (_MAP_TYPE, "must be undefined to be structural"),
    (_X_VALIDATIONS, "must be empty to be structural"),
)


def _nested_errors(nested: Any, skip_any_of: bool, level: str, path: str) -> list[FieldError]:
    """``validateNestedValueValidation``: only value validation inside a junctor."""
    if not isinstance(nested, dict):
        return []
    errors = _value_validation_errors(nested, skip_any_of, False, level, path)
    if isinstance(nested.get("items"), dict):
        errors += _nested_errors(nested["items"], False, level, _child(path, "items"))
    for name, child in _properties(nested).items():
        errors += _nested_errors(child, False, FIELD, _key(_child(path, "properties"), name))
    for key, message in _NESTED_FORBIDDEN:
        value = nested.get(key)
        if value not in (None, False, "", [], {}) or (key == "default" and value is not None):
            errors.append(forbidden(_child(path, key), message))
    if "metadata" in _properties(nested):
        errors.append(
            forbidden(
                _key(_child(path, "properties"), "metadata"), "must not be specified in a nested context"
            )
        )
    return errors


def _completeness(
    v_node: dict[str, Any], s_node: dict[str, Any] | None, s_path: str, v_path: str
) -> list[FieldError]:
    """``validateValueValidationCompleteness``: a field named under a junctor must exist in the
    structural spine. Upstream starts this at the root's junctors only, as here."""
    errors: list[FieldError] = []
    nested_list = [
        (n, _key(_child(v_path, j), i)) for j in _JUNCTORS for i, n in enumerate(v_node.get(j) or [])
    ]
    if isinstance(v_node.get("not"), dict):
        nested_list.insert(0, (v_node["not"], _child(v_path, "not")))
    for nested, path in nested_list:
        if isinstance(nested, dict):
            errors += _nested_completeness(nested, s_node, s_path, path)
    return errors


def _nested_completeness(
    nested: dict[str, Any], s_node: dict[str, Any] | None, s_path: str, v_path: str
) -> list[FieldError]:
    if s_node is None:
        return [required(s_path, f"because it is defined in {v_path}")]
    errors = _completeness(nested, s_node, s_path, v_path)
    if isinstance(nested.get("items"), dict):
        items = s_node.get("items") if isinstance(s_node.get("items"), dict) else None
        errors += _nested_completeness(
            nested["items"], items, _child(s_path, "items"), _child(v_path, "items")
        )
    for name, child in _properties(nested).items():
        s_child = _properties(s_node).get(name)
        s_child_path = _key(_child(s_path, "properties"), name)
        v_child_path = _key(_child(v_path, "properties"), name)
        if s_child is None:
            errors.append(required(s_child_path, f"because it is defined in {v_child_path}"))
        elif isinstance(child, dict):
            errors += _nested_completeness(child, s_child, s_child_path, v_child_path)
    return errors


def go_regexp_error(pattern: str) -> str | None:
    """Why Go's RE2 ``regexp.Compile`` refuses ``pattern`` (Python's ``re`` stands in, with the
    constructs RE2 does not have refused), or None."""
    for construct, name in ((r"(?=", "(?="), (r"(?!", "(?!"), (r"(?<=", "(?<="), (r"(?<!", "(?<!")):
        if construct in pattern:
            return f"error parsing regexp: invalid or unsupported Perl syntax: `{name}`"
    if re.search(r"\\[1-9]", pattern):
        return (
            "error parsing regexp: invalid escape sequence: `" + re.search(r"\\[1-9]", pattern).group() + "`"
        )
    try:
        re.compile(pattern)
    except re.error as error:
        return f"error parsing regexp: {error}"
    return None


# --------------------------------------------------------------------------------------------
# CEL types of schema nodes: k8s.io/apiserver/pkg/cel/common/schemas.go (SchemaDeclType).


@dataclass
class Decl:
    """A CEL declaration type: its kind, fields or element, and the sizes the cost estimate
    assumes (``MaxElements``: characters, items or entries; ``MinSerializedSize`` in JSON)."""

    kind: str  # object, map, list, string, bytes, int, double, bool, dyn, duration, timestamp
    fields: dict[str, Decl] = field(default_factory=dict)
    elem: Decl | None = None
    max_elements: int = 0
    min_size: int = 1


_SCALARS = {"int", "uint", "double", "bool", "null", "duration", "timestamp"}
_CEL_RESERVED = {
    "true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function", "if",
    "import", "let", "loop", "package", "namespace", "return", "var", "void", "while",
}  # fmt: skip


def cel_escape(name: str) -> str | None:
    """``cel.Escape``: a property's name in CEL, or None where no CEL name can stand for it."""
    if name in _CEL_RESERVED:
        return f"__{name}__"
    if not re.fullmatch(r"[a-zA-Z_.\-/][a-zA-Z0-9_.\-/]*", name):
        return None
    escaped = name.replace("__", "__underscores__")
    for char, word in ((".", "dot"), ("-", "dash"), ("/", "slash")):
        escaped = escaped.replace(char, f"__{word}__")
    return escaped


def _string_decl(node: dict[str, Any]) -> Decl:
    unbounded = MAX_REQUEST_SIZE_BYTES - 2
    fmt = node.get("format")
    if fmt in ("duration", "date", "date-time"):
        return Decl(
            {"duration": "duration"}.get(fmt, "timestamp"),
            max_elements={"duration": 32, "date": 12, "date-time": 32}[fmt],
            min_size={"duration": 3, "date": 12, "date-time": 21}[fmt],
        )
    kind = "bytes" if fmt == "byte" else "string"
    if isinstance(node.get("maxLength"), int):
        factor = 1 if kind == "bytes" else 4  # maxLength counts runes; a rune is up to 4 bytes
        return Decl(kind, max_elements=max(node["maxLength"], 0) * factor, min_size=2)
    enum = [v for v in node.get("enum") or [] if isinstance(v, str)]
    if enum and kind == "string":
        return Decl(kind, max_elements=max(len(v) for v in enum), min_size=2)
    return Decl(kind, max_elements=unbounded, min_size=2)


def schema_decl(node: dict[str, Any], is_resource_root: bool = False) -> Decl | None:
    """``SchemaDeclType``: the CEL type of a schema node, None if CEL cannot see it."""
    if node.get(_INT_OR_STRING):
        length = node.get("maxLength")
        most = length * 4 if isinstance(length, int) else MAX_REQUEST_SIZE_BYTES - 2
        return Decl("dyn", max_elements=most, min_size=1)
    if is_resource_root:
        node = _with_type_and_object_meta(node)
    kind = node.get("type")
    if kind == "array":
        items = node.get("items")
        elem = schema_decl(items, bool(items.get(_EMBEDDED))) if isinstance(items, dict) else None
        if elem is None:
            return None
        most = node.get("maxItems")
        most = max(most, 0) if isinstance(most, int) else (MAX_REQUEST_SIZE_BYTES - 2) // (elem.min_size + 1)
        return Decl("list", elem=elem, max_elements=most, min_size=2)
    if kind == "object":
        return _object_decl(node)
    if kind == "string":
        return _string_decl(node)
    return {"boolean": Decl("bool", min_size=4), "number": Decl("double"), "integer": Decl("int")}.get(
        str(kind)
    )


def _object_decl(node: dict[str, Any]) -> Decl | None:
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        values = schema_decl(extra, bool(extra.get(_EMBEDDED)))
        if values is None:
            return None
        most = node.get("maxProperties")
        most = (
            max(most, 0) if isinstance(most, int) else (MAX_REQUEST_SIZE_BYTES - 2) // (values.min_size + 6)
        )
        return Decl("map", elem=values, max_elements=most, min_size=2)
    fields = {}
    min_size = 2  # {}
    needed = set(node.get("required") or [])
    for name, prop in _properties(node).items():
        decl = schema_decl(prop, bool(prop.get(_EMBEDDED)))
        if decl is None:
            continue
        escaped = cel_escape(name)
        if escaped is not None:
            fields[escaped] = decl
        if name in needed and "default" not in prop:
            min_size += len(name) + decl.min_size + 4
    return Decl("object", fields=fields, min_size=min_size)


def _with_type_and_object_meta(node: dict[str, Any]) -> dict[str, Any]:
    """``WithTypeAndObjectMeta``: kind, apiVersion and metadata.name/generateName are always
    visible to rules at a resource's root."""
    props = _properties(node)
    meta = props.get("metadata") or {}
    if (
        props.get("kind", {}).get("type") == "string"
        and props.get("apiVersion", {}).get("type") == "string"
        and meta.get("type") == "object"
        and _properties(meta).get("name", {}).get("type") == "string"
        and _properties(meta).get("generateName", {}).get("type") == "string"
    ):
        return node
    string = {"type": "string"}  # no maxLength: a rule reading the name is costed as unbounded
    meta = {"type": "object", "properties": {"name": string, "generateName": string}}
    return {**node, "properties": {**props, "kind": string, "apiVersion": string, "metadata": meta}}


# --------------------------------------------------------------------------------------------
# CEL expressions: celpy's parse tree as a small AST, checked and costed like cel-go would.


@dataclass
class Expr:
    """A CEL expression node. ``kind``: lit, ident, select, has, call, comp, list, map."""

    kind: str
    name: str = ""  # identifier, field, function/operator, or comprehension macro
    args: list[Expr] = field(default_factory=list)
    target: Expr | None = None  # receiver of a method call, operand of a select
    value: Any = None  # a literal's value
    var: str = ""  # a comprehension's variable
    decl: Decl | None = None  # filled in by the type check
    size: tuple[int, int] | None = None  # a size the cost estimate knows (literals, results)


_BINARY = {
    "conditionalor": "_||_", "conditionaland": "_&&_", "relation_lt": "_<_", "relation_le": "_<=_",
    "relation_gt": "_>_", "relation_ge": "_>=_", "relation_eq": "_==_", "relation_ne": "_!=_",
    "relation_in": "@in", "addition_add": "_+_", "addition_sub": "_-_", "multiplication_mul": "_*_",
    "multiplication_div": "_/_", "multiplication_mod": "_%_",
}  # fmt: skip
_MACROS = {"all", "exists", "exists_one", "map", "filter"}


class CelCompileError(Exception):
    """A rule the API server would refuse to compile (the message follows cel-go's)."""


@functools.cache
def _environment() -> celpy.Environment:
    return celpy.Environment()  # building one builds a parser: keep one


@functools.cache
def _parse_tree(source: str) -> lark.Tree | str:
    """celpy's parse tree of ``source``, or the syntax error as cel-go words it."""
    try:
        return _environment().compile(source)
    except celpy.CELParseError as error:
        where = f"{error.line or '?'}:{error.column or '?'}"
        return f"ERROR: <input>:{where}: Syntax error: {error.args[0].splitlines()[0]}"


def parse_cel(source: str) -> Expr:
    """``source`` as a new :class:`Expr` (CelCompileError when celpy cannot parse it)."""
    tree = _parse_tree(source)
    if isinstance(tree, str):
        raise CelCompileError(tree)
    return _to_expr(tree)


def _tree_children(tree: lark.Tree) -> list[Any]:
    return [c for c in tree.children if c is not None]


def _to_expr(tree: Any) -> Expr:
    """One node of celpy's grammar (``cel.lark``) as an Expr."""
    if isinstance(tree, lark.Token):
        return Expr("ident", name=str(tree))
    kids = _tree_children(tree)
    rule = tree.data
    if rule in ("expr",) and len(kids) == 3:
        return Expr("call", name="_?_:_", args=[_to_expr(k) for k in kids])
    if rule in ("conditionalor", "conditionaland") and len(kids) == 2:
        return Expr("call", name=_BINARY[rule], args=[_to_expr(kids[0]), _to_expr(kids[1])])
    if rule in ("relation", "addition", "multiplication") and len(kids) == 2:
        operator = kids[0]
        return Expr(
            "call", name=_BINARY[operator.data], args=[_to_expr(operator.children[0]), _to_expr(kids[1])]
        )
    if rule == "unary" and len(kids) == 2:
        return Expr("call", name="!_" if kids[0].data == "unary_not" else "-_", args=[_to_expr(kids[1])])
    if len(kids) == 1 and rule in (
        "expr", "conditionalor", "conditionaland", "relation", "addition", "multiplication", "unary",
        "member", "primary", "paren_expr",
    ):  # fmt: skip
        return _to_expr(kids[0])
    return _to_member(rule, kids)


def _to_member(rule: str, kids: list[Any]) -> Expr:
    if rule == "member_dot":
        return Expr("select", name=str(kids[1]), target=_to_expr(kids[0]))
    if rule == "member_dot_arg":
        return _call(str(kids[1]), _to_expr(kids[0]), _exprs(kids[2:]))
    if rule == "member_index":
        return Expr("call", name="_[_]", args=[_to_expr(kids[0]), _to_expr(kids[1])])
    if rule == "ident_arg":
        return _call(str(kids[0]), None, _exprs(kids[1:]))
    if rule == "ident":
        return Expr("ident", name=str(kids[0]))
    if rule == "dot_ident":
        return Expr("ident", name="." + str(kids[0]))
    if rule == "dot_ident_arg":
        return _call("." + str(kids[0]), None, _exprs(kids[1:]))
    if rule == "list_lit":
        return Expr("list", args=_exprs(kids))
    if rule == "map_lit":
        return Expr("map", args=_exprs(kids))
    if rule == "member_object":  # a message literal: CRD rules declare no message types
        raise CelCompileError("ERROR: <input>: undeclared reference to a message type (in container '')")
    if rule == "literal":
        return _literal(kids[0])
    raise CelCompileError(f"ERROR: <input>: unsupported syntax: {rule}")


def _exprs(kids: list[Any]) -> list[Expr]:
    """The expressions of an optional ``exprlist``/``mapinits``/``fieldinits`` child."""
    out = []
    for kid in kids:
        if isinstance(kid, lark.Tree) and kid.data in ("exprlist", "mapinits", "fieldinits"):
            out += [_to_expr(k) for k in _tree_children(kid)]
        else:
            out.append(_to_expr(kid))
    return out


def _call(name: str, target: Expr | None, args: list[Expr]) -> Expr:
    if name == "has" and target is None:
        if len(args) != 1 or args[0].kind != "select":
            raise CelCompileError("ERROR: <input>: invalid argument to has() macro")
        return Expr("has", name=args[0].name, target=args[0].target)
    if name in _MACROS and target is not None and len(args) in (2, 3):
        if args[0].kind != "ident":
            raise CelCompileError(f"ERROR: <input>: argument must be a simple name ({name} macro)")
        return Expr("comp", name=name, target=target, var=args[0].name, args=args[1:])
    return Expr("call", name=name, target=target, args=args)


def _literal(token: lark.Token) -> Expr:
    text = str(token)
    kind = token.type
    if kind in ("STRING_LIT", "MLSTRING_LIT", "BYTES_LIT"):
        value = _program(text).evaluate({})
        return Expr(
            "lit", name="bytes" if kind == "BYTES_LIT" else "string", value=value, size=(len(value),) * 2
        )
    if kind == "BOOL_LIT":
        return Expr("lit", name="bool", value=text == "true")
    if kind == "NULL_LIT":
        return Expr("lit", name="null", value=None)
    if kind == "FLOAT_LIT":
        return Expr("lit", name="double", value=float(text))
    return Expr("lit", name="uint" if kind == "UINT_LIT" else "int", value=text)


# The type check: what cel-go's checker refuses that a parser does not (unknown fields and
# functions, a result of the wrong type). Function results by name; "elem" is the element type
# of the receiver (or first argument).
_FUNCTION_RESULTS = {
    **dict.fromkeys(["size", "indexOf", "lastIndexOf", "sign", "compareTo", "asInteger", "family"], "int"),
    **dict.fromkeys(["prefixLength", "major", "minor", "patch", "int", "getDate", "getDayOfMonth"], "int"),
    **dict.fromkeys(["getDayOfWeek", "getDayOfYear", "getFullYear", "getMonth", "getHours"], "int"),
    **dict.fromkeys(["getMilliseconds", "getMinutes", "getSeconds"], "int"),
    **dict.fromkeys(["contains", "startsWith", "endsWith", "matches", "isSorted", "isURL", "bool"], "bool"),
    **dict.fromkeys(["isQuantity", "isInteger", "isGreaterThan", "isLessThan", "isIP", "isCIDR"], "bool"),
    **dict.fromkeys(["isUnspecified", "isLoopback", "isLinkLocalMulticast", "isLinkLocalUnicast"], "bool"),
    **dict.fromkeys(["isGlobalUnicast", "containsIP", "containsCIDR", "isSemver", "hasValue"], "bool"),
    **dict.fromkeys(["sets.contains", "sets.equivalent", "sets.intersects", "ip.isCanonical"], "bool"),
    **dict.fromkeys(["string", "lowerAscii", "upperAscii", "replace", "substring", "trim", "join"], "string"),
    **dict.fromkeys(["charAt", "format", "find", "getScheme", "getHost", "getHostname", "getPort"], "string"),
    **dict.fromkeys(["getEscapedPath", "strings.quote", "reverse", "base64.encode"], "string"),
    **dict.fromkeys(["split", "findAll"], "list<string>"),
    **dict.fromkeys(["sum", "min", "max"], "elem"),
    **dict.fromkeys(
        ["url", "quantity", "add", "sub", "ip", "cidr", "masked", "semver", "type", "dyn"], "dyn"
    ),
    **dict.fromkeys(["optional.of", "optional.none", "optional.ofNonZeroValue", "value", "orValue"], "dyn"),
    **dict.fromkeys(
        ["optMap", "optFlatMap", "math.greatest", "math.least", "getQuery", "lists.range"], "dyn"
    ),
    **dict.fromkeys(["base64.decode", "bytes"], "bytes"),
    "uint": "uint",
    "double": "double",
    "asApproximateFloat": "double",
    "duration": "duration",
    "timestamp": "timestamp",
}
_NAMESPACES = {"sets", "strings", "math", "base64", "optional", "lists", "ip"}
_DYN = Decl("dyn", max_elements=UINT64_MAX)
# Type names are values in CEL (``type(self) == int``).
_TYPE_NAMES = {
    name: Decl("type")
    for name in ("int", "uint", "double", "bool", "string", "bytes", "list", "map", "null_type", "type")
}
_BOOL = Decl("bool", min_size=4)
_RELATIONS = {"_<_", "_<=_", "_>_", "_>=_", "_==_", "_!=_", "@in", "_&&_", "_||_", "!_"}


def type_check(expr: Expr, scope: dict[str, Decl]) -> list[str]:
    """Fill in ``expr.decl`` everywhere and return what cel-go's checker would refuse."""
    problems: list[str] = []
    _check(expr, scope, problems)
    return problems


def _check(expr: Expr, scope: dict[str, Decl], problems: list[str]) -> Decl:
    if expr.kind == "lit":
        decl = Decl(expr.name, max_elements=expr.size[1] if expr.size else 0)
    elif expr.kind == "ident":
        decl = scope.get(expr.name) or _TYPE_NAMES.get(expr.name, _DYN)
        if expr.name not in scope and expr.name not in _TYPE_NAMES:
            problems.append(f"undeclared reference to '{expr.name}' (in container '')")
    elif expr.kind in ("select", "has"):
        assert expr.target is not None
        decl = _field(_check(expr.target, scope, problems), expr.name, problems)
        decl = _BOOL if expr.kind == "has" else decl
    elif expr.kind == "comp":
        decl = _check_comprehension(expr, scope, problems)
    elif expr.kind == "list":
        elems = [_check(e, scope, problems) for e in expr.args]
        expr.size = (len(elems), len(elems))
        decl = Decl("list", elem=elems[0] if elems else _DYN, max_elements=len(elems), min_size=2)
    elif expr.kind == "map":
        parts = [_check(e, scope, problems) for e in expr.args]
        expr.size = (len(parts) // 2, len(parts) // 2)
        decl = Decl("map", elem=parts[1] if parts else _DYN, max_elements=len(parts) // 2, min_size=2)
    else:
        decl = _check_call(expr, scope, problems)
    expr.decl = decl
    return decl


def _field(decl: Decl, name: str, problems: list[str]) -> Decl:
    if decl.kind == "object":
        if name not in decl.fields:
            problems.append(f"undefined field '{name}'")
            return _DYN
        return decl.fields[name]
    if decl.kind == "map":
        return decl.elem or _DYN
    if decl.kind != "dyn":
        problems.append(f"type '{decl.kind}' does not support field selection")
    return _DYN


def _check_comprehension(expr: Expr, scope: dict[str, Decl], problems: list[str]) -> Decl:
    assert expr.target is not None
    over = _check(expr.target, scope, problems)
    if over.kind == "list":
        var = over.elem or _DYN
    elif over.kind == "map":  # map keys are strings; their size is bounded by the request only
        var = Decl("string", max_elements=MAX_REQUEST_SIZE_BYTES - 2, min_size=2)
    else:
        var = _DYN
        if over.kind != "dyn":
            problems.append(
                f"expression of type '{over.kind}' cannot be range of a comprehension "
                "(must be list, map, or dynamic)"
            )
    inner = {**scope, expr.var: var}
    results = [_check(e, inner, problems) for e in expr.args]
    if expr.name in ("all", "exists", "exists_one"):
        return _BOOL
    if expr.name == "filter":
        return Decl("list", elem=var, max_elements=over.max_elements, min_size=2)
    return Decl("list", elem=results[-1], max_elements=over.max_elements, min_size=2)


def _check_call(expr: Expr, scope: dict[str, Decl], problems: list[str]) -> Decl:
    name = expr.name
    receiver = expr.target
    if receiver is not None and receiver.kind == "ident" and receiver.name in _NAMESPACES - set(scope):
        # sets.contains(...) and the like: one qualified function name, not a method call
        name = expr.name = f"{receiver.name}.{name}"
        expr.target = None
    target = _check(expr.target, scope, problems) if expr.target is not None else None
    args = [_check(a, scope, problems) for a in expr.args]
    if name in _RELATIONS:
        return _BOOL
    if name == "_?_:_":
        return args[1] if args[1].kind not in ("dyn", "null") else args[2]
    if name == "_+_" and args[0].kind == "list":
        return Decl("list", elem=args[0].elem or args[1].elem, max_elements=UINT64_MAX, min_size=2)
    if name in ("_+_", "_-_", "_*_", "_/_", "_%_", "-_"):
        return Decl(args[0].kind) if args[0].kind in _SCALARS | {"string", "bytes"} else _DYN
    if name == "_[_]":
        return (args[0].elem or _DYN) if args[0].kind in ("list", "map") else _DYN
    result = _FUNCTION_RESULTS.get(name)
    if result is None:
        problems.append(f"undeclared reference to '{name}' (in container '')")
        return _DYN
    if result == "elem":
        holder = target or (args[0] if args else _DYN)
        return holder.elem or _DYN
    if result == "list<string>":
        return Decl("list", elem=Decl("string", max_elements=UINT64_MAX, min_size=2), max_elements=UINT64_MAX)
    return Decl(result, max_elements=0 if result in _SCALARS else UINT64_MAX)


# --------------------------------------------------------------------------------------------
# Cost: cel-go checker/cost.go (coster) with the Kubernetes library's CostEstimator
# (k8s.io/apiserver/pkg/cel/library/cost.go) and compilation.go's sizeEstimator. Upper bounds
# only (CostEstimate.Max); saturating at 2**64-1 like cel-go.

_STRING_TRAVERSAL = 0.1  # common.StringTraversalCostFactor
_REGEX_LENGTH = 0.25  # common.RegexStringLengthCostFactor
_LIST_CREATE, _MAP_CREATE = 10, 30  # common.ListCreateBaseCost, MapCreateBaseCost


def _add(*costs: int) -> int:
    return min(sum(costs), UINT64_MAX)


def _mul(a: int, b: int) -> int:
    return min(a * b, UINT64_MAX)


def _factor(size: int, per_unit: float) -> int:
    """``multiplyByCostFactor``: ceil(size * factor), saturating."""
    if size >= UINT64_MAX / max(per_unit, 1e-12):
        return UINT64_MAX
    return min(math.ceil(size * per_unit), UINT64_MAX)


def size_of(expr: Expr) -> int:
    """``coster.sizeEstimate`` (max): a computed size, else the schema's bound for a field path."""
    return expr.size[1] if expr.size is not None else decl_size(expr.decl)


def decl_size(decl: Decl | None) -> int:
    """The size bound of a value of type ``decl``: the schema's ``MaxElements`` for data the rule
    reads (0 for objects, as upstream), 1 for scalars (``isScalar``), unbounded for results whose
    size nothing bounds."""
    if decl is None or decl is _DYN:
        return UINT64_MAX
    if decl.kind in _SCALARS:
        return max(decl.max_elements, 1)
    return decl.max_elements


def estimate_cost(expr: Expr) -> int:
    """The most a type-checked expression costs to evaluate once (cel-go's ``Cost``)."""
    if expr.kind == "lit":
        return 0
    if expr.kind == "ident":
        return 1
    if expr.kind in ("select", "has"):  # a field read, or a presence test: 1 each
        assert expr.target is not None
        return _add(estimate_cost(expr.target), 1)
    if expr.kind == "list":
        return _add(_LIST_CREATE, *(estimate_cost(e) for e in expr.args))
    if expr.kind == "map":
        return _add(_MAP_CREATE, *(estimate_cost(e) for e in expr.args))
    if expr.kind == "comp":
        return _comprehension_cost(expr)
    return _call_cost(expr)


# The cost of each macro's expansion (parser/macro.go) around its predicate/transform, as
# (accumulator init, loop condition, step overhead, result): e.g. all() steps with
# ``__result__ && p`` (1 + p) under ``@not_strictly_false(__result__)`` (2).
_MACRO_COSTS = {
    "all": (0, 2, 1, 1),
    "exists": (0, 3, 1, 1),
    "exists_one": (0, 0, 2, 2),
    "map": (_LIST_CREATE, 0, 2 + _LIST_CREATE, 1),
    "filter": (_LIST_CREATE, 0, 3 + _LIST_CREATE, 1),
}


def _comprehension_cost(expr: Expr) -> int:
    """``costComprehension``: range + init + result + size(range) * (step + condition)."""
    assert expr.target is not None
    init, condition, overhead, result = _MACRO_COSTS[expr.name]
    body = _add(*(estimate_cost(e) for e in expr.args))
    step = _add(condition, overhead, body)
    count = size_of(expr.target)
    expr.size = (0, count)
    return _add(estimate_cost(expr.target), init, result, _mul(count, step))


def _call_cost(expr: Expr) -> int:
    """``costCall``/``functionCost``: the receiver's cost, plus the function's own cost (which
    includes its arguments')."""
    target_cost = estimate_cost(expr.target) if expr.target is not None else 0
    arg_costs = [estimate_cost(a) for a in expr.args]
    own = _function_cost(expr, arg_costs)
    return _add(target_cost, own)


def _function_cost(expr: Expr, arg_costs: list[int]) -> int:
    name, args, target = expr.name, expr.args, expr.target
    args_sum = _add(*arg_costs)
    if name in ("_&&_", "_||_"):
        return _add(*arg_costs)
    if name == "_?_:_":
        expr.size = (0, max(size_of(args[1]), size_of(args[2])))
        return _add(arg_costs[0], max(arg_costs[1], arg_costs[2]))
    if name in ("_==_", "_!=_", "_<_", "_<=_", "_>_", "_>=_"):
        return _add(_factor(min(size_of(args[0]), size_of(args[1])), _STRING_TRAVERSAL), args_sum)
    if name == "@in":
        in_list = (args[1].decl or _DYN).kind in ("list", "dyn")  # a dyn may be a list: O(n)
        return _add(size_of(args[1]) if in_list else 1, args_sum)
    left = (args[0].decl or _DYN).kind if args else ""
    if name == "_+_" and left in ("string", "bytes", "list", "dyn"):
        # Concatenation sizes add up; a dyn operand may be a string, the dearest overload.
        total = _add(size_of(args[0]), size_of(args[1]))
        expr.size = (0, total)
        return _add(1 if left == "list" else _factor(total, _STRING_TRAVERSAL), args_sum)
    library = _library_cost(expr)
    if library is not None:
        return _add(library, args_sum)
    if name in ("startsWith", "endsWith") and args:
        return _add(_factor(size_of(args[0]), _STRING_TRAVERSAL), args_sum)
    if name == "matches":
        text, regex = (target, args[0]) if target is not None else (args[0], args[1])
        return _add(_regex_cost(text, regex), args_sum)
    if name == "contains" and target is not None and (target.decl or _DYN).kind in ("string", "dyn"):
        return _add(
            _mul(_factor(size_of(target), _STRING_TRAVERSAL), _factor(size_of(args[0]), _STRING_TRAVERSAL)),
            args_sum,
        )
    if name in ("bytes", "string") and args and args[0].decl and args[0].decl.kind in ("string", "bytes"):
        expr.size = (0, _mul(size_of(args[0]), 4))
        return _add(_factor(size_of(args[0]), _STRING_TRAVERSAL), args_sum)
    return _add(1, args_sum)  # O(1)


def _regex_cost(text: Expr, regex: Expr) -> int:
    """A regular expression over a string: (size + 1) * 0.1 times regex length * 0.25."""
    return _mul(_factor(_add(size_of(text), 1), _STRING_TRAVERSAL), _factor(size_of(regex), _REGEX_LENGTH))


def _library_cost(expr: Expr) -> int | None:
    """``library.CostEstimator.EstimateCallCost`` for the Kubernetes CEL libraries (without the
    arguments' own costs); functions it does not list are charged a full scan, which errs high."""
    name, args, target = expr.name, expr.args, expr.target
    if name in ("isSorted", "sum", "max", "min", "indexOf", "lastIndexOf") and target is not None:
        decl = target.decl or _DYN
        if decl.kind == "list":
            elem = decl.elem or _DYN
            text_cost = _factor(decl_size(elem), _STRING_TRAVERSAL) if elem.kind in ("string", "bytes") else 0
            per_item = 1 + text_cost
            return _mul(size_of(target), per_item)
        return _factor(size_of(target), _STRING_TRAVERSAL)
    if name in ("lowerAscii", "upperAscii", "substring", "trim") and target is not None:
        expr.size = (0, size_of(target))
        return _factor(size_of(target), _STRING_TRAVERSAL)
    if name in ("replace", "split") and target is not None:
        expr.size = (0, size_of(target) if name == "split" and len(args) == 1 else UINT64_MAX)
        return _factor(size_of(target), 2 * _STRING_TRAVERSAL)
    if name == "join" and target is not None:
        elem = (target.decl or _DYN).elem
        most = size_of(target)
        total = _mul(most, decl_size(elem))
        if args:  # separators between the items
            total = _add(total, _mul(size_of(args[0]), max(most - 1, 0) if most < UINT64_MAX else UINT64_MAX))
        expr.size = (0, total)
        return _factor(total, _STRING_TRAVERSAL)
    if name.startswith("sets.") and len(args) == 2:  # every element of one against the other
        return _add(1, _mul(size_of(args[0]), size_of(args[1])))
    if name in ("find", "findAll") and target is not None and args:
        expr.size = (0, size_of(target))
        return _regex_cost(target, args[0])
    if name in ("url", "isURL", "quantity", "isQuantity", "cidr", "isCIDR", "isIP") or (
        name == "ip" and args
    ):
        subject = args[0] if args else target
        return _factor(size_of(subject), _STRING_TRAVERSAL) if subject is not None else 1
    if name in (
        "sign", "asInteger", "isInteger", "asApproximateFloat", "isGreaterThan", "isLessThan", "compareTo",
        "add", "sub", "masked", "prefixLength", "family", "isUnspecified", "isLoopback",
        "isLinkLocalMulticast", "isLinkLocalUnicast", "getScheme", "getHost", "getHostname", "getPort",
        "getEscapedPath", "getQuery", "ip",
    ):  # fmt: skip
        return 1
    if name in _FUNCTION_RESULTS and name not in _STANDARD_FUNCTIONS:
        subject = target if target is not None else (args[0] if args else None)
        return _add(1, size_of(subject) if subject is not None else 0)
    return None


# Functions cel-go itself costs (in _function_cost); every other known one is a library's.
_STANDARD_FUNCTIONS = {
    "size", "contains", "startsWith", "endsWith", "matches", "int", "uint", "double", "string", "bytes",
    "bool", "duration", "timestamp", "type", "dyn", "getDate", "getDayOfMonth", "getDayOfWeek",
    "getDayOfYear", "getFullYear", "getMonth", "getHours", "getMilliseconds", "getMinutes", "getSeconds",
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Compiling and evaluating rules: pkg/apiserver/schema/cel/compilation.go and validation.go.


@dataclass
class CompiledRule:
    """``CompilationResult``: an error (the detail the API server prints) or the estimate."""

    rule: dict[str, Any]
    error: str | None = None
    uses_old_self: bool = False
    max_cost: int = 0
    message_error: str | None = None
    message_cost: int | None = None


def compile_rule(rule: dict[str, Any], decl: Decl) -> CompiledRule:
    """``compileRule``: parse, type-check against the node's CEL type, estimate the cost."""
    out = CompiledRule(rule)
    text = str(rule.get("rule", ""))
    if not text.strip():
        return out
    old_self = _DYN if rule.get("optionalOldSelf") else decl
    try:
        expr = _checked(text, {"self": decl, "oldSelf": old_self})
    except CelCompileError as error:
        out.error = f"compilation failed: {error}"
        return out
    if expr.decl is not None and expr.decl.kind not in ("bool", "dyn"):
        out.error = "cel expression must evaluate to a bool"
        return out
    out.uses_old_self = _mentions(expr, "oldSelf")
    out.max_cost = estimate_cost(expr)
    message = str(rule.get("messageExpression", ""))
    if message:
        try:
            message_expr = _checked(message, {"self": decl, "oldSelf": old_self})
        except CelCompileError as error:
            out.message_error = f"messageExpression compilation failed: {error}"
            return out
        if message_expr.decl is not None and message_expr.decl.kind not in ("string", "dyn"):
            out.message_error = "messageExpression must evaluate to a string"
            return out
        out.message_cost = estimate_cost(message_expr)
    return out


def _checked(text: str, scope: dict[str, Decl]) -> Expr:
    expr = parse_cel(text)
    problems = type_check(expr, scope)
    if problems:
        raise CelCompileError("\n".join(f"ERROR: <input>: {p}" for p in dict.fromkeys(problems)))
    return expr


def _mentions(expr: Expr, name: str) -> bool:
    if expr.kind == "ident" and expr.name == name:
        return True
    if expr.kind == "comp" and expr.var == name:
        return False
    children = [*expr.args, *([expr.target] if expr.target is not None else [])]
    return any(_mentions(child, name) for child in children)


@functools.cache
def _program(text: str) -> celpy.Runner:
    return _environment().program(_environment().compile(text), functions=_k8s_functions())


def _ascii_case(text: str, upper: bool) -> celpy.celtypes.StringType:
    pairs = (ascii_lowercase, ascii_uppercase) if upper else (ascii_uppercase, ascii_lowercase)
    return celpy.celtypes.StringType(text.translate(str.maketrans(*pairs)))


def _index_of(target: Any, item: Any, start: int = 0) -> celpy.celtypes.IntType:
    if isinstance(target, str):
        if not 0 <= start <= len(target):
            raise IndexError(f"index out of range: {start}")
        return celpy.celtypes.IntType(target.find(item, start))
    return celpy.celtypes.IntType(next((i for i, x in enumerate(target) if x == item), -1))


def _last_index_of(target: Any, item: Any, *end: int) -> celpy.celtypes.IntType:
    if isinstance(target, str):
        stop = (end[0] + len(item)) if end else len(target)
        return celpy.celtypes.IntType(target.rfind(item, 0, stop))
    found = [i for i, x in enumerate(target) if x == item]
    return celpy.celtypes.IntType(found[-1] if found else -1)


def _split(text: str, separator: str, limit: int = -1) -> celpy.celtypes.ListType:
    if limit == 0:
        parts: list[str] = []
    elif separator == "":
        parts = list(text) if limit < 0 else [*text[: limit - 1], text[limit - 1 :]] if text else []
    else:
        parts = text.split(separator, -1 if limit < 0 else limit - 1)
    return celpy.celtypes.ListType([celpy.celtypes.StringType(p) for p in parts])


@functools.cache
def _k8s_functions() -> dict[str, Any]:
    """The Kubernetes CEL libraries celpy lacks, as far as rules here use them: the strings
    extension (``cel-go/ext``), lists and regex (``k8s.io/apiserver/pkg/cel/library``). URL,
    quantity, IP, CIDR, semver and sets functions are not emulated: a rule using one fails to
    evaluate here with a message that says so."""
    string, integer = celpy.celtypes.StringType, celpy.celtypes.IntType
    return {
        "lowerAscii": lambda s: _ascii_case(s, upper=False),
        "upperAscii": lambda s: _ascii_case(s, upper=True),
        "trim": lambda s: string(s.strip()),
        "charAt": lambda s, i: string(s[i] if i < len(s) else ""),
        "substring": lambda s, start, *end: string(s[start : end[0]] if end else s[start:]),
        "replace": lambda s, old, new, n=-1: string(s.replace(old, new, n)),
        "split": _split,
        "join": lambda items, sep="": string(sep.join(items)),
        "indexOf": _index_of,
        "lastIndexOf": _last_index_of,
        "isSorted": lambda items: celpy.celtypes.BoolType(list(items) == sorted(items)),
        "sum": lambda items: sum(items[1:], items[0]) if items else integer(0),
        "min": min,
        "max": max,
        "find": lambda s, pattern: string(m.group(0) if (m := re.search(pattern, s)) else ""),
        "findAll": lambda s, pattern, n=-1: celpy.celtypes.ListType(
            [string(m.group(0)) for m in re.finditer(pattern, s)][: n if n >= 0 else None]
        ),
    }


def cel_value(value: Any, node: dict[str, Any]) -> Any:
    """``UnstructuredToVal``: JSON as CEL sees it through the schema (``number`` fields are
    doubles even when written ``2``; ``int-or-string`` stays as written)."""
    kind = node.get("type")
    if kind == "number" and isinstance(value, int) and not isinstance(value, bool):
        return celpy.celtypes.DoubleType(value)
    if kind == "string" and isinstance(value, str) and node.get("format") in _FORMAT_TYPES:
        try:  # date-time, date and duration strings are timestamps and durations to CEL
            return _FORMAT_TYPES[node["format"]](value)
        except ValueError:
            return celpy.celtypes.StringType(value)
    if isinstance(value, dict):
        props, extra = _properties(node), node.get("additionalProperties")
        return celpy.celtypes.MapType(
            {
                celpy.celtypes.StringType(k): cel_value(
                    v, props.get(k) or (extra if isinstance(extra, dict) else {})
                )
                for k, v in value.items()
            }
        )
    if isinstance(value, list):
        items = node.get("items") if isinstance(node.get("items"), dict) else {}
        return celpy.celtypes.ListType([cel_value(v, items) for v in value])
    return celpy.json_to_cel(value)


_FORMAT_TYPES = {
    "date-time": celpy.celtypes.TimestampType,
    "date": lambda text: celpy.celtypes.TimestampType(f"{text}T00:00:00Z"),
    "duration": celpy.celtypes.DurationType,
}
_NO_OLD = object()


def evaluate_rule(text: str, self_value: Any, old_value: Any = _NO_OLD) -> bool | str:
    """True or False, or the evaluation error as cel-go words it (``no such key: x``...)."""
    activation = {"self": self_value}
    if old_value is not _NO_OLD:
        activation["oldSelf"] = old_value
    try:
        result = _program(text).evaluate(activation)
    except celpy.CELEvalError as error:
        return _eval_error_text(error)
    except (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError) as error:
        return _eval_error_text(celpy.CELEvalError(str(error), type(error), None))
    if isinstance(result, celpy.CELEvalError):
        return _eval_error_text(result)
    return bool(result) if isinstance(result, bool | celpy.celtypes.BoolType) else "no such overload"


def _eval_error_text(error: celpy.CELEvalError) -> str:
    message = str(error.args[0]) if error.args else str(error)
    cause = error.args[1] if len(error.args) > 1 else None
    if re.match(r"found no matching overload for _(\|\||&&)_", message):
        # celpy wraps two failed operands of || or && together; cel-go reports the first one.
        detail = " ".join(
            str(part) for part in (error.args[2] if len(error.args) > 2 and error.args[2] else ())
        )
        inner = re.search(r"CELEvalError\(\*\((['\"])(.*?)\1, <class '(\w+)'>", detail)
        if inner:
            cause = {"KeyError": KeyError, "ZeroDivisionError": ZeroDivisionError, "IndexError": IndexError}
            return _eval_error_text(celpy.CELEvalError(inner.group(2), cause.get(inner.group(3)), None))
    missing = re.match(r"no such member in mapping: '(.*)'", message)
    if missing:
        return f"no such key: {missing.group(1)}"
    undeclared = re.match(r"undeclared reference to '([^']*)'", message)
    if undeclared:
        return f"{undeclared.group(1)} is not emulated here (celpy lacks it)"
    if cause is ZeroDivisionError:
        return "modulus by zero" if "modulus" in message and "divide" not in message else "division by zero"
    if cause is IndexError:
        return "index out of bounds"
    if cause is TypeError or "no such overload" in message or "no matching overload" in message:
        return "no such overload"
    return message


def _rule_error_string(rule: dict[str, Any]) -> str:
    """``ruleErrorString``: the message if any, else the rule."""
    return str(rule.get("message") or rule.get("rule", "")).strip()


def _failure(rule: dict[str, Any], path: str, kind: str, detail: str) -> FieldError:
    """``fieldErrorForReason`` (1.32 passes the node's type as the value)."""
    if rule.get("fieldPath"):
        path = _child(path, str(rule["fieldPath"]).lstrip("."))
    reason = rule.get("reason")
    if reason == "FieldValueForbidden":
        return forbidden(_show(path), detail)
    if reason == "FieldValueRequired":
        return required(_show(path), detail)
    if reason == "FieldValueDuplicate":
        return FieldError("Duplicate value", _show(path), kind)
    return invalid(_show(path), kind, detail)


def _show(path: str) -> str:
    return path or "<nil>"  # a nil *field.Path prints so


def node_rule_errors(
    value: Any, node: dict[str, Any], path: str, old: Any = _NO_OLD, resource_root: bool = False
) -> list[FieldError]:
    """``Validator.validateExpressions``: the rules of one node against ``value`` as ``self``."""
    rules = node.get(_X_VALIDATIONS) or []
    if value is None or not rules:
        return []
    decl = schema_decl(node, resource_root) or _DYN
    kind = str(node.get("type", ""))
    self_value = cel_value(value, node)
    old_value = cel_value(old, node) if old is not _NO_OLD and old is not None else _NO_OLD
    errors = []
    for rule in rules:
        compiled = compile_rule(rule, decl)
        if compiled.error:
            errors.append(invalid(_show(path), kind, f"rule compile error: {compiled.error}"))
            continue
        text = str(rule.get("rule", ""))
        if not text.strip() or (compiled.uses_old_self and old_value is _NO_OLD):
            continue  # transition rules run only with an old value (optionalOldSelf: not emulated)
        result = evaluate_rule(text, self_value, old_value if compiled.uses_old_self else _NO_OLD)
        if result == "no such overload":
            detail = (
                "'no such overload': call arguments did not match a supported operator, function or macro "
                f"signature for rule: {_rule_error_string(rule)}"
            )
            errors.append(invalid(_show(path), kind, detail))
        elif isinstance(result, str):
            errors.append(invalid(_show(path), kind, f"{result} evaluating rule: {_rule_error_string(rule)}"))
        elif not result:
            errors.append(_failure(rule, path, kind, _failure_message(rule, self_value, old_value)))
    return errors


def _failure_message(rule: dict[str, Any], self_value: Any, old_value: Any) -> str:
    """``messageExpression``'s result when it gives a usable one, else ``ruleMessageOrDefault``."""
    text = str(rule.get("messageExpression", ""))
    if text:
        activation = {"self": self_value, **({"oldSelf": old_value} if old_value is not _NO_OLD else {})}
        try:
            message = _program(text).evaluate(activation)
        except (celpy.CELEvalError, TypeError, ValueError, KeyError, IndexError, ZeroDivisionError):
            message = None  # upstream falls back to the rule's message too
        if (
            isinstance(message, str)
            and message.strip()
            and "\n" not in message
            and len(message.strip()) <= 5 * 1024
        ):
            return message.strip()
    if rule.get("message"):
        return str(rule["message"]).strip()
    return f"failed rule: {_rule_error_string(rule)}"


def rule_errors(
    value: Any, node: dict[str, Any], path: str, old: Any = _NO_OLD, resource_root: bool = False
) -> list[FieldError]:
    """``Validator.validate``: the rules of ``node`` and of every node under it that ``value``
    has data for (an absent field's rules do not run, and its default is not filled in)."""
    if value is None:
        return []
    errors = node_rule_errors(value, node, path, old, resource_root)
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        items = node["items"]
        for i, item in enumerate(value):
            old_item = _correlated_item(item, old, node)
            errors += rule_errors(item, items, _key(path, i), old_item, bool(items.get(_EMBEDDED)))
    elif isinstance(value, dict):
        props, extra = _properties(node), node.get("additionalProperties")
        for key, child_value in value.items():
            child = props.get(key) or (extra if isinstance(extra, dict) else None)
            if child is None:
                continue
            child_path = _child(path, key) if key in props else _key(path, key)
            old_child = old.get(key, _NO_OLD) if isinstance(old, dict) else _NO_OLD
            errors += rule_errors(child_value, child, child_path, old_child, bool(child.get(_EMBEDDED)))
    return errors


def _correlated_item(item: Any, old: Any, node: dict[str, Any]) -> Any:
    """The old item an item is compared with: only map lists correlate, by their keys."""
    if node.get(_LIST_TYPE) != "map" or not isinstance(old, list) or not isinstance(item, dict):
        return _NO_OLD
    keys = node.get(_LIST_MAP_KEYS) or []
    for candidate in old:
        if isinstance(candidate, dict) and all(candidate.get(k) == item.get(k) for k in keys):
            return candidate
    return _NO_OLD


# --------------------------------------------------------------------------------------------
# Values against a schema: kube-openapi's validate.SchemaValidator, and the API server's
# mapping of its errors to field errors (kubeOpenAPIResultToFieldErrors).


@dataclass
class _OpenAPIError:
    code: str  # type, required, enum, too_long, max_items, too_many_properties, or other
    name: str
    value: Any
    message: str
    limit: Any = None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", dict: "object", list: "array"}.get(type(value), type(value).__name__)


def _type_ok(value: Any, node: dict[str, Any]) -> bool:
    if value is None:
        return bool(node.get("nullable"))
    if node.get(_INT_OR_STRING):
        return _json_type(value) in ("integer", "string")
    wanted = node.get("type")
    found = _json_type(value)
    return not wanted or found == wanted or (wanted == "number" and found == "integer")


def _in(name: str) -> str:
    """kube-openapi names a value ``<path> in body`` (the root's path is empty)."""
    return f"{name} in body"


def openapi_errors(value: Any, node: dict[str, Any], name: str = "") -> list[_OpenAPIError]:
    """``SchemaValidator.Validate``: type, junctors, string, number, list, enum, object."""
    if not _type_ok(value, node):
        wanted = "integer,string" if node.get(_INT_OR_STRING) else str(node.get("type"))
        found = _json_type(value)
        message = f"{_in(name)} must be of type {wanted}: {_go_quote(found)}"
        return [_OpenAPIError("type", name, found, message)]
    if value is None:
        return []
    errors = _junctor_errors(value, node, name)
    if isinstance(value, str):
        errors += _string_errors(value, node, name)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        errors += _number_errors(value, node, name)
    elif isinstance(value, list):
        errors += _list_errors(value, node, name)
    enum = node.get("enum")
    if enum is not None and not any(_json_equal(value, e) for e in enum):
        message = f"{_in(name)} should be one of [{' '.join(_go_plain(e) for e in enum)}]"
        errors.append(_OpenAPIError("enum", name, value, message, enum))
    if isinstance(value, dict):
        errors += _object_errors(value, node, name)
    return errors


def _json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(a, bool) and isinstance(b, bool) and a == b)
    return a == b


def _go_plain(value: Any) -> str:
    return value if isinstance(value, str) else go_value(value)


def _junctor_errors(value: Any, node: dict[str, Any], name: str) -> list[_OpenAPIError]:
    errors: list[_OpenAPIError] = []
    for nested in node.get("allOf") or []:
        errors += openapi_errors(value, nested, name)
    if node.get("anyOf") and not any(not openapi_errors(value, n, name) for n in node["anyOf"]):
        errors.append(
            _OpenAPIError("other", name, value, f"{_in(name)} must validate at least one schema (anyOf)")
        )
    if node.get("oneOf") and sum(not openapi_errors(value, n, name) for n in node["oneOf"]) != 1:
        errors.append(
            _OpenAPIError("other", name, value, f"{_in(name)} must validate one and only one schema (oneOf)")
        )
    if isinstance(node.get("not"), dict) and not openapi_errors(value, node["not"], name):
        errors.append(_OpenAPIError("other", name, value, f"{_in(name)} must not validate the schema (not)"))
    return errors


def _string_errors(value: str, node: dict[str, Any], name: str) -> list[_OpenAPIError]:
    errors = []
    longest, shortest, pattern = node.get("maxLength"), node.get("minLength"), node.get("pattern")
    if isinstance(longest, int) and len(value) > longest:
        message = f"{_in(name)} should be at most {longest} chars long"
        errors.append(_OpenAPIError("too_long", name, value, message, longest))
    if isinstance(shortest, int) and len(value) < shortest:
        errors.append(
            _OpenAPIError("other", name, value, f"{_in(name)} should be at least {shortest} chars long")
        )
    if isinstance(pattern, str) and go_regexp_error(pattern) is None and not re.search(pattern, value):
        errors.append(_OpenAPIError("other", name, value, f"{_in(name)} should match '{pattern}'"))
    return errors


def _bound(bound: float, value: float) -> str:
    """A limit as the message prints it: an int for integer data, else a Go float."""
    if isinstance(value, int) and float(bound).is_integer():
        return str(int(bound))
    return go_float(float(bound))


def _number_errors(value: float, node: dict[str, Any], name: str) -> list[_OpenAPIError]:
    errors = []
    multiple = node.get("multipleOf")
    if isinstance(multiple, int | float) and multiple > 0:
        quotient = value / multiple
        if not math.isclose(quotient, round(quotient), rel_tol=0, abs_tol=1e-9):
            message = f"{_in(name)} should be a multiple of {_bound(multiple, value)}"
            errors.append(_OpenAPIError("other", name, value, message))
    top, exclusive_top = node.get("maximum"), bool(node.get("exclusiveMaximum"))
    if isinstance(top, int | float) and (value > top or (exclusive_top and value == top)):
        relation = "less than" if exclusive_top else "less than or equal to"
        errors.append(
            _OpenAPIError("other", name, value, f"{_in(name)} should be {relation} {_bound(top, value)}")
        )
    bottom, exclusive_bottom = node.get("minimum"), bool(node.get("exclusiveMinimum"))
    if isinstance(bottom, int | float) and (value < bottom or (exclusive_bottom and value == bottom)):
        relation = "greater than" if exclusive_bottom else "greater than or equal to"
        message = f"{_in(name)} should be {relation} {_bound(bottom, value)}"
        errors.append(_OpenAPIError("other", name, value, message))
    return errors


def _list_errors(value: list[Any], node: dict[str, Any], name: str) -> list[_OpenAPIError]:
    errors = []
    fewest, most = node.get("minItems"), node.get("maxItems")
    if isinstance(fewest, int) and len(value) < fewest:
        errors.append(_OpenAPIError("other", name, value, f"{_in(name)} should have at least {fewest} items"))
    if isinstance(most, int) and len(value) > most:
        message = f"{_in(name)} should have at most {most} items"
        errors.append(_OpenAPIError("max_items", name, len(value), message, most))
    if node.get("uniqueItems") and len({json.dumps(v, sort_keys=True) for v in value}) < len(value):
        errors.append(_OpenAPIError("other", name, value, f"{_in(name)} shouldn't contain duplicates"))
    if isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            errors += openapi_errors(item, node["items"], f"{name}[{i}]")
    return errors


def _object_errors(value: dict[str, Any], node: dict[str, Any], name: str) -> list[_OpenAPIError]:
    """``objectValidator.Validate`` (a property count error stops the rest, as upstream)."""
    fewest, most = node.get("minProperties"), node.get("maxProperties")
    if isinstance(fewest, int) and len(value) < fewest:
        return [_OpenAPIError("other", name, fewest, f"{_in(name)} should have at least {fewest} properties")]
    if isinstance(most, int) and len(value) > most:
        message = f"{_in(name)} should have at most {most} properties"
        return [_OpenAPIError("too_many_properties", name, len(value), message, most)]
    errors: list[_OpenAPIError] = []
    props, extra = _properties(node), node.get("additionalProperties")
    for key, child in value.items():
        if key in props:
            continue
        if extra is False:
            errors.append(_OpenAPIError("other", name, key, f"{name}.{key} in body is a forbidden property"))
        elif isinstance(extra, dict):
            errors += openapi_errors(child, extra, f"{name}.{key}")
    for key in sorted(props):
        if key in value:
            errors += openapi_errors(value[key], props[key], f"{name}.{key}" if name else key)
    for key in node.get("required") or []:
        if key not in value:
            errors.append(
                _OpenAPIError("required", f"{name}.{key}", None, f"{_in(f'{name}.{key}')} is required")
            )
    return errors


def value_errors(value: Any, node: dict[str, Any], path: str) -> list[FieldError]:
    """``ValidateCustomResource``: ``value`` against ``node``, as field errors under ``path``."""
    errors = []
    for error in openapi_errors(value, node):
        where = _child(path, error.name.lstrip(".")) if error.name not in ("", ".") else path
        where = _show(where)
        if error.code == "required":
            errors.append(required(where))
        elif error.code == "enum":
            values = [e if isinstance(e, str) else json.dumps(e) for e in error.limit]
            errors.append(not_supported(where, error.value, values))
        elif error.code == "too_long":
            errors.append(FieldError("Too long", where, detail=f"may not be longer than {error.limit}"))
        elif error.code in ("max_items", "too_many_properties"):
            errors.append(
                FieldError("Too many", where, error.value, f"must have at most {error.limit} items")
            )
        else:
            errors.append(invalid(where, "" if error.value is None else error.value, error.message))
    return errors


# --------------------------------------------------------------------------------------------
# Pruning and defaulting: pkg/apiserver/schema/pruning/algorithm.go, defaulting/algorithm.go.


def prune(value: Any, node: dict[str, Any], resource_root: bool = False) -> Any:
    """``Prune``: a copy of ``value`` without the fields ``node`` does not specify (kept where
    ``x-kubernetes-preserve-unknown-fields`` is set; at a resource's root, apiVersion, kind and
    metadata are kept)."""
    if isinstance(value, dict):
        props, extra = _properties(node), node.get("additionalProperties")
        out = {}
        for key, child in value.items():
            if resource_root and key in ("apiVersion", "kind", "metadata"):
                out[key] = copy.deepcopy(child)
            elif key in props:
                out[key] = prune(child, props[key], bool(props[key].get(_EMBEDDED)))
            elif isinstance(extra, dict):
                out[key] = prune(child, extra, bool(extra.get(_EMBEDDED)))
            elif node.get(_PRESERVE) or extra is True:
                out[key] = copy.deepcopy(child)
        return out
    if isinstance(value, list):
        items = node.get("items")
        if not isinstance(items, dict):
            return copy.deepcopy(value)
        return [prune(item, items, bool(items.get(_EMBEDDED))) for item in value]
    return value


def apply_defaults(value: Any, node: dict[str, Any]) -> Any:
    """``Default``: a copy of ``value`` with every absent (or non-nullable null) field that has
    a default set to it, and then the defaults under it applied in turn."""
    if isinstance(value, dict):
        out = copy.deepcopy(value)
        props, extra = _properties(node), node.get("additionalProperties")
        for key, prop in props.items():
            if "default" in prop and (key not in out or (out[key] is None and not prop.get("nullable"))):
                out[key] = copy.deepcopy(prop["default"])
        for key, child in out.items():
            schema = props.get(key) or (extra if isinstance(extra, dict) else None)
            if schema is not None:
                out[key] = apply_defaults(child, schema)
        return out
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [apply_defaults(item, node["items"]) for item in value]
    return value


def prune_nulls(value: Any, node: dict[str, Any]) -> Any:
    """``PruneNonNullableNullsWithoutDefaults``: drop nulls a field neither allows nor defaults."""
    if isinstance(value, dict):
        props, extra = _properties(node), node.get("additionalProperties")
        out = {}
        for key, child in value.items():
            schema = props.get(key) or (extra if isinstance(extra, dict) else None)
            if (
                child is None
                and schema is not None
                and not schema.get("nullable")
                and "default" not in schema
            ):
                continue
            out[key] = prune_nulls(child, schema) if schema is not None else child
        return out
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [prune_nulls(item, node["items"]) for item in value]
    return value


# --------------------------------------------------------------------------------------------
# Defaults: pkg/apiserver/schema/defaulting/validation.go (ValidateDefaults).


def default_errors(schema: dict[str, Any], path: str) -> list[FieldError]:
    """``ValidateDefaults`` with ``requirePrunedDefaults`` (always so for a v1 CRD)."""
    return _default_errors(schema, path, resource_root=True, inside_meta=False)


def _default_errors(
    node: dict[str, Any], path: str, resource_root: bool, inside_meta: bool
) -> list[FieldError]:
    errors: list[FieldError] = []
    if "default" in node and node["default"] is not None:
        errors += _one_default_errors(node, path, resource_root, inside_meta)
    # additionalProperties is not followed: defaults are forbidden there.
    if isinstance(node.get("items"), dict):
        errors += _default_errors(
            node["items"], _child(path, "items"), bool(node["items"].get(_EMBEDDED)), inside_meta
        )
    embedded = resource_root or bool(node.get(_EMBEDDED))
    for name, child in _properties(node).items():
        child_meta = inside_meta or (embedded and name in ("metadata", "apiVersion", "kind"))
        child_path = _key(_child(path, "properties"), name)
        errors += _default_errors(child, child_path, bool(child.get(_EMBEDDED)), child_meta)
    return errors


def _one_default_errors(
    node: dict[str, Any], path: str, resource_root: bool, inside_meta: bool
) -> list[FieldError]:
    """One node's default: pruned as written, then its schema, then the CEL rules of the node
    and the nodes under it, with ``self`` the default exactly as written. The defaults of the
    fields inside it are not filled in first (upstream passes ``s.Default.Object`` to
    ``celValidator.Validate`` untouched), so a rule reading one of them finds no such key."""
    default = node["default"]
    where = _child(path, "default")
    errors = []
    if not inside_meta and prune(default, node, resource_root) != default:
        errors.append(invalid(where, default, "must not have unknown fields"))
    schema_errors = value_errors(default, node, where)
    if schema_errors:
        return errors + schema_errors
    # Validate(..., obj=default, oldObj=default): transition rules see oldSelf == self. With
    # CRDValidationRatcheting (on by default in 1.30-1.32) a clean result is checked again
    # without an old object, which only changes optionalOldSelf rules (not emulated).
    return errors + rule_errors(default, node, where, default, resource_root)


# --------------------------------------------------------------------------------------------
# The OpenAPI schema: validation.go's ValidateCustomResourceDefinitionOpenAPISchema, with the
# CEL checks of cel_validation.go's CELSchemaContext.

_OPENAPI_TYPES = ["array", "boolean", "integer", "number", "object", "string"]
_META_FIELDS = ("metadata", "kind", "apiVersion")
_REASONS = ["FieldValueDuplicate", "FieldValueForbidden", "FieldValueInvalid", "FieldValueRequired"]


@dataclass(frozen=True)
class _Ssv:
    """``specStandardValidatorV3``'s state on the way down."""

    allow_defaults: bool = True
    disallow_reason: str = ""
    inside_meta: bool = False
    old_self_forbidden_at: str | None = None  # the nearest list whose items do not correlate


@dataclass
class RuleCost:
    """One rule's estimate: one evaluation, how many times it may run, and their product."""

    path: str
    per_call: int
    cardinality: int
    total: int


@dataclass
class _CelContext:
    """``CELSchemaContext``: the cardinality bound here (None: some enclosing list or map has
    no ``maxItems``/``maxProperties``) and the schema-wide total."""

    max_cardinality: int | None
    total: list[int]
    expensive: list[tuple[int, str]]
    costs: list[RuleCost]

    def child(self, parent: dict[str, Any]) -> _CelContext:
        most = _max_elements(parent)
        bound = None if self.max_cardinality is None or most is None else _mul(self.max_cardinality, most)
        return _CelContext(bound, self.total, self.expensive, self.costs)

    def observe(self, path: str, cost: int) -> None:
        """``TotalCost.ObserveExpressionCost``: the sum, and the four dearest rules over 1%."""
        self.total[0] = _add(self.total[0], cost)
        if cost >= STATIC_ESTIMATED_CRD_COST_LIMIT // 100:
            self.expensive.append((cost, path))
            self.expensive.sort(key=lambda entry: -entry[0])
            del self.expensive[4:]


def _max_elements(node: dict[str, Any]) -> int | None:
    """``extractMaxElements``: how many children a node may have per occurrence."""
    if node.get("type") == "object":
        if node.get("additionalProperties") is not None:
            most = node.get("maxProperties")
            return max(most, 0) if isinstance(most, int) else None
        return 1
    if node.get("type") == "array":
        most = node.get("maxItems")
        return max(most, 0) if isinstance(most, int) else None
    return 1


def cost_error_message(name: str, cost: int, limit: int) -> str:
    """``getCostErrorMessage``."""
    factor = cost / limit
    if factor > 100.0:
        shown = "more than 100x"
    elif factor < 1.5:
        shown = f"{factor:f}x"
    else:
        shown = f"{factor:.1f}x"
    return (
        f"{name} exceeds budget by factor of {shown} (try simplifying the rule, or adding maxItems, "
        "maxProperties, and maxLength where arrays, maps, and strings are declared)"
    )


def openapi_schema_errors(
    node: dict[str, Any], path: str, ssv: _Ssv, is_root: bool, cel: _CelContext | None
) -> tuple[list[FieldError], list[FieldError]]:
    """``ValidateCustomResourceDefinitionOpenAPISchema``: (schema errors, CEL errors). A node's
    rules are compiled only when nothing at or under it has a schema error."""
    schema_errs = _node_errors(node, path, ssv)
    cel_errs: list[FieldError] = []
    for child, child_path, child_ssv, child_cel in _openapi_children(node, path, ssv, is_root, cel):
        more_schema, more_cel = openapi_schema_errors(child, child_path, child_ssv, False, child_cel)
        schema_errs += more_schema
        cel_errs += more_cel
    schema_errs += _list_and_map_errors(node, path)
    if node.get(_X_VALIDATIONS):
        schema_errs += _rule_field_errors(node, path)
        if not schema_errs and cel is not None:
            cel_errs += _rule_compile_errors(node, path, ssv, cel, is_root)
    return schema_errs, cel_errs


def _openapi_children(
    node: dict[str, Any], path: str, ssv: _Ssv, is_root: bool, cel: _CelContext | None
) -> Iterator[tuple[dict[str, Any], str, _Ssv, _CelContext | None]]:
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        sub = ssv
        if ssv.inside_meta:
            sub = _forbid_defaults(ssv, "inside additionalProperties applying to object metadata")
        yield extra, _child(path, "additionalProperties"), sub, cel.child(node) if cel else None
    for name, child in _properties(node).items():
        sub = ssv
        if (is_root or node.get(_EMBEDDED)) and name in _META_FIELDS:
            sub = _Ssv(sub.allow_defaults, sub.disallow_reason, True, sub.old_self_forbidden_at)
            if is_root:
                sub = _forbid_defaults(sub, f"in top-level {name}")
        if isinstance(child, dict):
            yield child, _key(_child(path, "properties"), name), sub, cel.child(node) if cel else None
    if isinstance(node.get("not"), dict):
        yield node["not"], _child(path, "not"), ssv, None
    for junctor in ("allOf", "oneOf", "anyOf"):
        for i, nested in enumerate(node.get(junctor) or []):
            if isinstance(nested, dict):
                yield nested, _key(_child(path, junctor), i), ssv, None
    if isinstance(node.get("items"), dict):
        sub = ssv
        if node.get(_LIST_TYPE) != "map" and ssv.old_self_forbidden_at is None:
            sub = _Ssv(ssv.allow_defaults, ssv.disallow_reason, ssv.inside_meta, path)
        yield node["items"], _child(path, "items"), sub, cel.child(node) if cel else None


def _forbid_defaults(ssv: _Ssv, reason: str) -> _Ssv:
    return _Ssv(False, reason, ssv.inside_meta, ssv.old_self_forbidden_at)


_UNSUPPORTED = (
    ("id", "id is not supported"),
    ("additionalItems", "additionalItems is not supported"),
    ("patternProperties", "patternProperties is not supported"),
    ("definitions", "definitions is not supported"),
    ("dependencies", "dependencies is not supported"),
    ("$ref", "$ref is not supported"),
)


def _node_errors(node: dict[str, Any], path: str, ssv: _Ssv) -> list[FieldError]:
    """``specStandardValidatorV3.validate`` plus ``uniqueItems`` and ``additionalProperties``
    beside ``properties``."""
    errors = []
    kind = node.get("type")
    if kind and kind not in _OPENAPI_TYPES:
        errors.append(not_supported(_child(path, "type"), kind, _OPENAPI_TYPES))
    if "default" in node and not ssv.allow_defaults:
        detail = "must not be set" + (f" {ssv.disallow_reason}" if ssv.disallow_reason else "")
        errors.append(forbidden(_child(path, "default"), detail))
    for key, message in _UNSUPPORTED:
        if node.get(key):
            errors.append(forbidden(_child(path, key), message))
    if kind == "null":
        errors.append(
            forbidden(_child(path, "type"), "type cannot be set to null, use nullable as an alternative")
        )
    if isinstance(node.get("items"), list):
        errors.append(forbidden(_child(path, "items"), "items must be a schema object and not an array"))
    if ssv.inside_meta and node.get(_EMBEDDED):
        errors.append(forbidden(_child(path, _EMBEDDED), "must not be used inside of resource meta"))
    if node.get("uniqueItems") is True:
        errors.append(
            forbidden(
                _child(path, "uniqueItems"),
                "uniqueItems cannot be set to true since the runtime complexity becomes quadratic",
            )
        )
    extra = node.get("additionalProperties")
    if extra is not None and _properties(node) and (extra is False or isinstance(extra, dict)):
        errors.append(
            forbidden(
                _child(path, "additionalProperties"),
                "additionalProperties and properties are mutual exclusive",
            )
        )
    return errors


def _list_and_map_errors(node: dict[str, Any], path: str) -> list[FieldError]:
    """The ``x-kubernetes-preserve-unknown-fields``, map-type and list-type rules."""
    errors = []
    kind = node.get("type", "")
    if node.get(_PRESERVE) is False:
        errors.append(invalid(_child(path, _PRESERVE), False, "must be true or undefined"))
    map_type, list_type = node.get(_MAP_TYPE), node.get(_LIST_TYPE)
    if map_type is not None and kind != "object":
        message = "must be object if x-kubernetes-map-type is specified"
        errors.append(
            invalid(_child(path, "type"), kind, message) if kind else required(_child(path, "type"), message)
        )
    if map_type is not None and map_type not in ("atomic", "granular"):
        errors.append(not_supported(_child(path, _MAP_TYPE), map_type, ["atomic", "granular"]))
    if list_type is not None and kind != "array":
        message = "must be array if x-kubernetes-list-type is specified"
        errors.append(
            invalid(_child(path, "type"), kind, message) if kind else required(_child(path, "type"), message)
        )
    elif list_type == "set" and isinstance(node.get("items"), dict):
        errors += _set_item_errors(node["items"], path)
    if list_type is not None and list_type not in ("atomic", "set", "map"):
        errors.append(not_supported(_child(path, _LIST_TYPE), list_type, ["atomic", "set", "map"]))
    if node.get(_LIST_MAP_KEYS):
        if list_type is None:
            errors.append(
                required(_child(path, _LIST_TYPE), "must be map if x-kubernetes-list-map-keys is non-empty")
            )
        elif list_type != "map":
            errors.append(
                invalid(
                    _child(path, _LIST_TYPE),
                    list_type,
                    "must be map if x-kubernetes-list-map-keys is non-empty",
                )
            )
    if list_type == "map":
        errors += _map_list_errors(node, path)
    errors += _map_list_key_errors(node, path)
    return errors


def _set_item_errors(items: dict[str, Any], path: str) -> list[FieldError]:
    message = "must be atomic as item of a list with x-kubernetes-list-type=set"
    if items.get("type") == "array" and items.get(_LIST_TYPE, "atomic") != "atomic":
        return [invalid(_child(_child(path, "items"), _LIST_TYPE), items.get(_LIST_TYPE), message)]
    if items.get("type") == "object" and items.get(_MAP_TYPE) != "atomic":
        return [invalid(_child(_child(path, "items"), _MAP_TYPE), items.get(_LIST_TYPE), message)]
    return []


def _map_list_errors(node: dict[str, Any], path: str) -> list[FieldError]:
    """A ``x-kubernetes-list-type: map``: keys named, object items, scalar key fields."""
    errors = []
    keys = node.get(_LIST_MAP_KEYS) or []
    items = node.get("items")
    if not keys:
        errors.append(
            required(_child(path, _LIST_MAP_KEYS), "must not be empty if x-kubernetes-list-type is map")
        )
    if items is None:
        errors.append(required(_child(path, "items"), "must have a schema if x-kubernetes-list-type is map"))
    elif not isinstance(items, dict):
        errors.append(
            invalid(
                _child(path, "items"),
                items,
                "must only have a single schema if x-kubernetes-list-type is map",
            )
        )
    elif items.get("type") != "object":
        errors.append(
            invalid(
                _child(_child(path, "items"), "type"),
                items.get("type", ""),
                "must be object if parent array's x-kubernetes-list-type is map",
            )
        )
    else:
        for i, key in enumerate(keys):
            prop = _properties(items).get(key)
            if prop is None:
                errors.append(
                    invalid(
                        _child(path, _LIST_MAP_KEYS), keys, "entries must all be names of item properties"
                    )
                )
            elif prop.get("type") in ("array", "object"):
                errors.append(
                    invalid(
                        _child(_key(_child(_child(path, "items"), "properties"), key), "type"),
                        items.get("type"),
                        "must be a scalar type if parent array's x-kubernetes-list-type is map",
                    )
                )
            if key in keys[:i]:
                errors.append(
                    invalid(_child(path, _LIST_MAP_KEYS), keys, "must not contain duplicate entries")
                )
    return errors


def _map_list_key_errors(node: dict[str, Any], path: str) -> list[FieldError]:
    """``validateMapListKeysMapSet``: set and map items not nullable; map keys required or
    defaulted, and not nullable."""
    items, list_type = node.get("items"), node.get(_LIST_TYPE)
    if not isinstance(items, dict) or list_type not in ("set", "map"):
        return []
    errors = []
    if items.get("nullable"):
        errors.append(
            forbidden(
                _child(_child(path, "items"), "nullable"),
                f"cannot be nullable when x-kubernetes-list-type is {list_type}",
            )
        )
    if list_type == "map":
        needed = set(items.get("required") or [])
        for key in node.get(_LIST_MAP_KEYS) or []:
            prop = _properties(items).get(key)
            if prop is None:
                continue
            key_path = _key(_child(_child(path, "items"), "properties"), key)
            if key not in needed and "default" not in prop:
                errors.append(
                    required(
                        _child(key_path, "default"),
                        "this property is in x-kubernetes-list-map-keys, so it must have a default or be a "
                        "required property",
                    )
                )
            if prop.get("nullable"):
                errors.append(
                    forbidden(
                        _child(key_path, "nullable"),
                        "this property is in x-kubernetes-list-map-keys, so it cannot be nullable",
                    )
                )
    return errors


def _rule_field_errors(node: dict[str, Any], path: str) -> list[FieldError]:
    """The checks of each ``x-kubernetes-validations`` entry's own fields."""
    errors = []
    for i, rule in enumerate(node.get(_X_VALIDATIONS) or []):
        where = _key(_child(path, _X_VALIDATIONS), i)
        text, message = str(rule.get("rule", "")), rule.get("message")
        if not text.strip():
            errors.append(required(_child(where, "rule"), "rule is not specified"))
        elif message is not None and message != "" and not str(message).strip():
            errors.append(
                invalid(_child(where, "message"), message, "message must be non-empty if specified")
            )
        elif message and re.search(r"[\n\r]", str(message).strip()):
            errors.append(invalid(_child(where, "message"), message, "message must not contain line breaks"))
        elif re.search(r"[\n\r]", text.strip()) and not str(message or "").strip():
            errors.append(
                required(_child(where, "message"), "message must be specified if rule contains line breaks")
            )
        expression = rule.get("messageExpression")
        if expression is not None and expression != "" and not str(expression).strip():
            errors.append(
                required(
                    _child(where, "messageExpression"), "messageExpression must be non-empty if specified"
                )
            )
        if rule.get("reason") is not None and rule["reason"] not in _REASONS:
            errors.append(not_supported(_child(where, "reason"), rule["reason"], _REASONS))
        errors += _field_path_errors(node, rule, where)
    return errors


def _field_path_errors(node: dict[str, Any], rule: dict[str, Any], where: str) -> list[FieldError]:
    field_path = rule.get("fieldPath")
    if field_path is None or field_path == "":
        return []
    if not str(field_path).strip():
        return [invalid(_child(where, "fieldPath"), field_path, "fieldPath must be non-empty if specified")]
    if re.search(r"[\n\r]", str(field_path)):
        return [invalid(_child(where, "fieldPath"), field_path, "fieldPath must not contain line breaks")]
    if valid_field_path(str(field_path), node) is None:
        return [invalid(_child(where, "fieldPath"), field_path, "fieldPath must be a valid path")]
    return []


def valid_field_path(
    json_path: str, node: dict[str, Any], allow_brackets: bool = True
) -> dict[str, Any] | None:
    """``ValidFieldPath``: the node a ``.a.b`` or ``['a']`` path leads to, or None."""
    tokens = re.findall(r"\.([^.\[\]]+)|\['((?:[^'\\]|\\.)*)'\]|(.)", json_path)
    if not json_path or not tokens:
        return None
    for dotted, quoted, other in tokens:
        if other or (quoted and not allow_brackets):
            return None
        name = dotted or quoted
        if _properties(node):
            if name not in node["properties"]:
                return None
            node = node["properties"][name]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return None
    return node


def _rule_compile_errors(
    node: dict[str, Any], path: str, ssv: _Ssv, cel: _CelContext, is_root: bool
) -> list[FieldError]:
    """``cel.Compile`` of a node's rules; each rule's cost times the node's cardinality
    (``getExpressionCost``) against ``StaticEstimatedCostLimit``, added to the total."""
    decl = schema_decl(node, is_root or bool(node.get(_EMBEDDED)))
    if decl is None:
        detail = "internal error: failed to retrieve type information for x-kubernetes-validations"
        return [FieldError("Internal error", _child(path, _X_VALIDATIONS), detail=detail)]
    errors = []
    for i, rule in enumerate(node.get(_X_VALIDATIONS) or []):
        where = _key(_child(path, _X_VALIDATIONS), i)
        compiled = compile_rule(rule, decl)
        cardinality = cel.max_cardinality
        if cardinality is None:  # CompilationResult.MaxCardinality: maxCardinality(MinSerializedSize)
            cardinality = MAX_REQUEST_SIZE_BYTES // (decl.min_size + 1)
        cost = _mul(compiled.max_cost, cardinality)
        cel.costs.append(RuleCost(_child(where, "rule"), compiled.max_cost, cardinality, cost))
        if cost > STATIC_ESTIMATED_COST_LIMIT:
            errors.append(
                forbidden(
                    _child(where, "rule"),
                    cost_error_message("estimated rule cost", cost, STATIC_ESTIMATED_COST_LIMIT),
                )
            )
        cel.observe(_child(where, "rule"), cost)
        if compiled.error:
            errors.append(invalid(_child(where, "rule"), _Raw(_rule_value(rule)), compiled.error))
        errors += _message_expression_errors(compiled, rule, where, cel)
        if compiled.uses_old_self and ssv.old_self_forbidden_at is not None:
            detail = (
                "oldSelf cannot be used on the uncorrelatable portion of the schema within "
                f"{ssv.old_self_forbidden_at}"
            )
            errors.append(invalid(_child(where, "rule"), rule.get("rule", ""), detail))
        elif not compiled.uses_old_self and rule.get("optionalOldSelf") is not None and not compiled.error:
            errors.append(
                invalid(
                    _child(where, "optionalOldSelf"),
                    rule["optionalOldSelf"],
                    "may not be set if oldSelf is not used in rule",
                )
            )
    return errors


def _message_expression_errors(
    compiled: CompiledRule, rule: dict[str, Any], where: str, cel: _CelContext
) -> list[FieldError]:
    if compiled.message_error:
        return [invalid(_child(where, "messageExpression"), _Raw(_rule_value(rule)), compiled.message_error)]
    if compiled.message_cost is None:
        return []
    cel.observe(_child(where, "messageExpression"), compiled.message_cost)
    if compiled.message_cost > STATIC_ESTIMATED_COST_LIMIT:
        message = cost_error_message(
            "estimated messageExpression cost", compiled.message_cost, STATIC_ESTIMATED_COST_LIMIT
        )
        return [forbidden(_child(where, "messageExpression"), message)]
    return []


# --------------------------------------------------------------------------------------------
# One schema: validateCustomResourceDefinitionValidation.

# JSONSchemaProps' fields in struct order (JSON name, Go name), for the status-root check.
_SCHEMA_FIELD_ORDER = (
    "id", "$schema", "$ref", "description", "type", "nullable", "format", "title", "default", "maximum",
    "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems",
    "minItems", "uniqueItems", "multipleOf", "enum", "maxProperties", "minProperties", "required", "items",
    "allOf", "oneOf", "anyOf", "not", "properties", "additionalProperties", "patternProperties",
    "dependencies", "additionalItems", "definitions", "externalDocs", "example", _PRESERVE, _EMBEDDED,
    _INT_OR_STRING, _LIST_MAP_KEYS, _LIST_TYPE, _MAP_TYPE, _X_VALIDATIONS,
)  # fmt: skip


def _go_field(key: str) -> str:
    if key.startswith("x-kubernetes-"):
        return "X" + "".join(part.capitalize() for part in key.removeprefix("x-kubernetes-").split("-"))
    return {"id": "ID", "$schema": "Schema", "$ref": "Ref"}.get(key, key[0].upper() + key[1:])


_SCHEMA_FIELDS = [(key, _go_field(key)) for key in _SCHEMA_FIELD_ORDER]
_ROOT_ALLOWED = [
    "Description", "Type", "Format", "Title", "Maximum", "ExclusiveMaximum", "Minimum", "ExclusiveMinimum",
    "MaxLength", "MinLength", "Pattern", "MaxItems", "MinItems", "UniqueItems", "MultipleOf", "Required",
    "Items", "Properties", "ExternalDocs", "Example", "XPreserveUnknownFields", "XValidations",
]  # fmt: skip


def schema_errors(schema: dict[str, Any], path: str, status_enabled: bool) -> list[FieldError]:
    """One ``openAPIV3Schema`` under ``path`` (``spec.validation`` or a version's ``schema``):
    structural first, then defaults, then CEL, each only when the step before found nothing."""
    root = _child(path, "openAPIV3Schema")
    errors = _status_root_errors(schema, path) if status_enabled else []
    if schema.get("nullable"):
        errors.append(forbidden(_child(root, "nullable"), "nullable cannot be true at the root"))
    cel: _CelContext | None = None
    structural = structural_errors(schema, root)
    if structural:
        errors += structural
    else:
        defaults = default_errors(schema, root)
        errors += sorted(defaults, key=lambda e: e.path)
        if not defaults:
            cel = _CelContext(1, [0], [], [])
    schema_errs, cel_errs = openapi_schema_errors(schema, root, _Ssv(), True, cel)
    errors += sorted(schema_errs + cel_errs, key=lambda e: e.path)
    if cel is not None and cel.total[0] > STATIC_ESTIMATED_CRD_COST_LIMIT:
        for _cost, where in cel.expensive:
            detail = (
                "contributed to estimated rule cost total exceeding cost limit for entire OpenAPIv3 schema"
            )
            errors.append(forbidden(where, detail))
        name = "x-kubernetes-validations estimated rule cost total for entire OpenAPIv3 schema"
        errors.append(
            forbidden(root, cost_error_message(name, cel.total[0], STATIC_ESTIMATED_CRD_COST_LIMIT))
        )
    return errors


def _status_root_errors(schema: dict[str, Any], path: str) -> list[FieldError]:
    """With the status subresource, the root may only hold what survives extracting status."""
    for key, name in _SCHEMA_FIELDS:
        if schema.get(key) in (None, False, "", [], {}):
            continue
        if name == "Type":
            if schema["type"] != "object":
                message = (
                    'only "object" is allowed as the type at the root of the schema if the status '
                    "subresource is enabled"
                )
                return [invalid(_child(path, "openAPIV3Schema.type"), schema["type"], message)]
            continue
        if name not in _ROOT_ALLOWED:
            message = (
                f"only [{' '.join(_ROOT_ALLOWED)}] fields are allowed at the root of the schema if the "
                "status subresource is enabled"
            )
            return [
                invalid(_child(path, "openAPIV3Schema"), _Raw("apiextensions.JSONSchemaProps{...}"), message)
            ]
    return []


# --------------------------------------------------------------------------------------------
# The CRD: ValidateCustomResourceDefinition and validateCustomResourceDefinitionSpec.

_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_PRINTER_TYPES = ["boolean", "date", "integer", "number", "string"]
_PRINTER_FORMATS = ["byte", "date", "date-time", "double", "float", "int32", "int64", "password"]


def dns1123_subdomain_errors(value: str) -> list[str]:
    """``IsDNS1123Subdomain``."""
    errors = []
    if len(value) > 253:
        errors.append("must be no more than 253 characters")
    if not _DNS1123_SUBDOMAIN.fullmatch(value):
        errors.append(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
            "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
            "validation is "
            "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
        )
    return errors


def dns1035_label_errors(value: str) -> list[str]:
    """``IsDNS1035Label``."""
    errors = []
    if len(value) > 63:
        errors.append("must be no more than 63 characters")
    if not _DNS1035_LABEL.fullmatch(value):
        errors.append(
            "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
            "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', "
            "regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
        )
    return errors


def crd_errors(crd: dict[str, Any]) -> list[str]:
    """Every reason the API server would refuse to create ``crd`` (a v1 CustomResourceDefinition
    as a dict), as the API server words it; empty if it would accept it."""
    spec = crd.get("spec") or {}
    errors = _crd_metadata_errors(crd, spec)
    errors += _spec_errors(spec)
    return [str(e) for e in errors]


def _crd_metadata_errors(crd: dict[str, Any], spec: dict[str, Any]) -> list[FieldError]:
    meta = crd.get("metadata") or {}
    name = str(meta.get("name", ""))
    names = spec.get("names") or {}
    if not name:
        return [required("metadata.name", "name or generateName is required")]
    problems = dns1123_subdomain_errors(name)
    if name != f"{names.get('plural', '')}.{spec.get('group', '')}":
        problems.append('must be spec.names.plural+"."+spec.group')
    errors = [invalid("metadata.name", name, p) for p in problems]
    group = str(spec.get("group", ""))
    protected = group in ("k8s.io", "kubernetes.io") or group.endswith((".k8s.io", ".kubernetes.io"))
    if protected and "api-approved.kubernetes.io" not in (meta.get("annotations") or {}):
        errors.append(
            required(
                "metadata.annotations[api-approved.kubernetes.io]",
                'protected groups must have approval annotation "api-approved.kubernetes.io", see '
                "https://github.com/kubernetes/enhancements/pull/1111",
            )
        )
    return errors


def _hoisted(versions: list[dict[str, Any]], key: str) -> Any:
    """The v1-to-internal conversion keeps a per-version field every version sets alike at the
    top level (``spec.validation``, ``spec.subresources``...); None when it does not."""
    values = [v.get(key) for v in versions]
    if versions and all(v not in (None, [], {}) for v in values) and all(v == values[0] for v in values):
        return values[0]
    return None


def _spec_errors(spec: dict[str, Any]) -> list[FieldError]:
    errors = _group_scope_errors(spec)
    versions = [v for v in spec.get("versions") or [] if isinstance(v, dict)]
    schema = _hoisted(versions, "schema")
    subresources = _hoisted(versions, "subresources")
    columns = _hoisted(versions, "additionalPrinterColumns")
    if spec.get("preserveUnknownFields"):
        errors.append(
            invalid(
                "spec.preserveUnknownFields",
                True,
                "cannot set to true, set x-kubernetes-preserve-unknown-fields to true in "
                "spec.versions[*].schema instead",
            )
        )
        if any(_has_default(v.get("schema") or {}) for v in versions):
            errors.append(
                invalid(
                    "spec.preserveUnknownFields", True, "must be false in order to use defaults in the schema"
                )
            )
    any_status = any("status" in (v.get("subresources") or {}) for v in versions)
    for i, version in enumerate(versions):
        errors += _version_errors(
            version, f"spec.versions[{i}]", schema is None, subresources is None, columns is None
        )
    names = [str(v.get("name", "")) for v in versions]
    if len(set(names)) != len(names):
        errors.append(invalid("spec.versions", _Raw("[...]"), "must contain unique version names"))
    if sum(bool(v.get("storage")) for v in versions) != 1:
        errors.append(
            invalid("spec.versions", _Raw("[...]"), "must have exactly one version marked as storage version")
        )
    errors += _names_errors(spec.get("names") or {})
    if schema is not None:
        errors += schema_errors(schema.get("openAPIV3Schema") or {}, "spec.validation", any_status)
    if subresources is not None:
        errors += subresource_errors(subresources, "spec.subresources")
    for i, column in enumerate(columns or []):
        errors += printer_column_errors(column, f"spec.additionalPrinterColumns[{i}]")
    errors += _conversion_errors(spec.get("conversion"))
    return errors


def _has_default(node: Any) -> bool:
    if isinstance(node, dict):
        return "default" in node or any(_has_default(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_default(v) for v in node)
    return False


def _group_scope_errors(spec: dict[str, Any]) -> list[FieldError]:
    errors = []
    group = str(spec.get("group", ""))
    if not group:
        errors.append(required("spec.group"))
    elif dns1123_subdomain_errors(group):
        errors.append(invalid("spec.group", group, ",".join(dns1123_subdomain_errors(group))))
    elif "." not in group:
        errors.append(invalid("spec.group", group, "should be a domain with at least one dot"))
    scope = spec.get("scope", "")
    if not scope:
        errors.append(required("spec.scope"))
    elif scope not in ("Cluster", "Namespaced"):
        errors.append(not_supported("spec.scope", scope, ["Cluster", "Namespaced"]))
    return errors


def _version_errors(
    version: dict[str, Any], path: str, own_schema: bool, own_subresources: bool, own_columns: bool
) -> list[FieldError]:
    """``validateCustomResourceDefinitionVersion`` for what stays per version."""
    errors = []
    name = str(version.get("name", ""))
    if dns1035_label_errors(name):
        errors.append(invalid(_child(path, "name"), name, ",".join(dns1035_label_errors(name))))
    warning = version.get("deprecationWarning")
    if warning is not None and not version.get("deprecated"):
        errors.append(
            invalid(_child(path, "deprecationWarning"), warning, "can only be set for deprecated versions")
        )
    schema = (version.get("schema") or {}).get("openAPIV3Schema")
    if own_schema and schema is None:
        errors.append(required(_child(path, "schema.openAPIV3Schema"), "schemas are required"))
    elif own_schema:
        status = "status" in (version.get("subresources") or {})
        errors += schema_errors(schema, _child(path, "schema"), status)
    if own_subresources and version.get("subresources"):
        errors += subresource_errors(version["subresources"], _child(path, "subresources"))
    for i, column in enumerate(version.get("additionalPrinterColumns") or [] if own_columns else []):
        errors += printer_column_errors(column, _key(_child(path, "additionalPrinterColumns"), i))
    fields = version.get("selectableFields") or []
    if fields and schema is not None:
        errors += selectable_field_errors(fields, schema, _child(path, "selectableFields"))
    return errors


def _names_errors(names: dict[str, Any]) -> list[FieldError]:
    """The required names, then ``ValidateCustomResourceDefinitionNames``."""
    errors = [
        required(f"spec.names.{key}")
        for key in ("plural", "singular", "kind", "listKind")
        if not names.get(key)
    ]
    for key in ("plural", "singular"):
        value = str(names.get(key) or "")
        if value and dns1035_label_errors(value):
            errors.append(invalid(f"spec.names.{key}", value, ",".join(dns1035_label_errors(value))))
    for key in ("kind", "listKind"):
        value = str(names.get(key) or "")
        if value and dns1035_label_errors(value.lower()):
            detail = "may have mixed case, but should otherwise match: " + ",".join(
                dns1035_label_errors(value.lower())
            )
            errors.append(invalid(f"spec.names.{key}", value, detail))
    for key in ("shortNames", "categories"):
        for i, value in enumerate(names.get(key) or []):
            if dns1035_label_errors(str(value)):
                errors.append(
                    invalid(f"spec.names.{key}[{i}]", value, ",".join(dns1035_label_errors(str(value))))
                )
    if names.get("kind") and names.get("kind") == names.get("listKind"):
        errors.append(
            invalid("spec.names.listKind", names["listKind"], "kind and listKind may not be the same")
        )
    return errors


def _simple_json_path_errors(value: str, path: str) -> list[FieldError]:
    if not value:
        return [invalid(path, value, "must not be empty")]
    if not value.startswith("."):
        return [invalid(path, value, "must be a simple json path starting with .")]
    return []


def subresource_errors(subresources: dict[str, Any], path: str) -> list[FieldError]:
    """``ValidateCustomResourceDefinitionSubresources``: the scale subresource's paths."""
    scale = subresources.get("scale")
    if scale is None:
        return []
    errors = []
    for key, prefixes, where in (
        ("specReplicasPath", (".spec.",), "should be a json path under .spec"),
        ("statusReplicasPath", (".status.",), "should be a json path under .status"),
        ("labelSelectorPath", (".spec.", ".status."), "should be a json path under either .spec or .status"),
    ):
        value = scale.get(key)
        field_path = _child(path, f"scale.{key}")
        if not value:
            if key != "labelSelectorPath":
                errors.append(required(field_path))
            continue
        problems = _simple_json_path_errors(str(value), field_path)
        errors += problems or ([] if str(value).startswith(prefixes) else [invalid(field_path, value, where)])
    return errors


def printer_column_errors(column: dict[str, Any], path: str) -> list[FieldError]:
    """``ValidateCustomResourceColumnDefinition``."""
    errors = []
    if not column.get("name"):
        errors.append(required(_child(path, "name")))
    kind = column.get("type")
    message = f"must be one of {','.join(_PRINTER_TYPES)}"
    if not kind:
        errors.append(required(_child(path, "type"), message))
    elif kind not in _PRINTER_TYPES:
        errors.append(invalid(_child(path, "type"), kind, message))
    fmt = column.get("format")
    if fmt and fmt not in _PRINTER_FORMATS:
        errors.append(invalid(_child(path, "format"), fmt, f"must be one of {','.join(_PRINTER_FORMATS)}"))
    json_path = column.get("jsonPath")
    if not json_path:
        errors.append(required(_child(path, "JSONPath")))
    else:
        errors += _simple_json_path_errors(str(json_path), _child(path, "JSONPath"))
    return errors


def selectable_field_errors(
    fields: list[dict[str, Any]], schema: dict[str, Any], path: str
) -> list[FieldError]:
    """``ValidateCustomResourceSelectableFields``."""
    errors: list[FieldError] = []
    seen: set[str] = set()
    for i, entry in enumerate(fields):
        where = _child(_key(path, i), "jsonPath")
        json_path = str(entry.get("jsonPath", ""))
        if not json_path:
            errors.append(required(where))
            continue
        found = valid_field_path(json_path, schema, allow_brackets=False)
        if found is None:
            errors.append(invalid(where, json_path, "is an invalid path: does not refer to a valid field"))
            continue
        if json_path.lstrip(".").split(".")[0] == "metadata":
            errors.append(invalid(where, json_path, "must not point to fields in metadata"))
        if found.get("type") not in ("string", "boolean", "integer"):
            detail = (
                "must point to a field of type string, boolean or integer. Enum string fields and strings "
                "with formats are allowed."
            )
            errors.append(invalid(where, json_path, detail))
        if json_path in seen:
            errors.append(FieldError("Duplicate value", where, json_path))
        seen.add(json_path)
    if len(seen) > 8:
        errors.append(FieldError("Too many", path, len(seen), "must have at most 8 items"))
    return errors


def _conversion_errors(conversion: Any) -> list[FieldError]:
    """``validateCustomResourceConversion`` without the webhook's URL and TLS checks."""
    if not isinstance(conversion, dict):
        return []
    strategy = conversion.get("strategy", "")
    if not strategy:
        return [required("spec.conversion.strategy")]
    if strategy not in ("None", "Webhook"):
        return [not_supported("spec.conversion.strategy", strategy, ["None", "Webhook"])]
    webhook = conversion.get("webhook") or {}
    if strategy == "None":
        return (
            [
                forbidden(
                    "spec.conversion.webhookClientConfig",
                    "should not be set when strategy is not set to Webhook",
                )
            ]
            if webhook
            else []
        )
    errors = []
    if not webhook.get("clientConfig"):
        errors.append(
            required("spec.conversion.webhookClientConfig", "required when strategy is set to Webhook")
        )
    review = webhook.get("conversionReviewVersions") or []
    if not review:
        errors.append(required("spec.conversion.conversionReviewVersions"))
    elif not {"v1", "v1beta1"} & set(review):
        errors.append(
            invalid(
                "spec.conversion.conversionReviewVersions", review, "must include at least one of v1, v1beta1"
            )
        )
    return errors


# --------------------------------------------------------------------------------------------
# Beyond refusal: costs, unknown fields, fields that are always pruned, and admission.


def version_schema(crd: dict[str, Any], version: str | None = None) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``version`` (the storage version by default)."""
    versions = crd["spec"]["versions"]
    chosen = next(v for v in versions if (v["name"] == version if version else v.get("storage")))
    schema: dict[str, Any] = chosen["schema"]["openAPIV3Schema"]
    return schema


def cost_report(crd: dict[str, Any]) -> list[RuleCost]:
    """Every rule's estimated cost (as the CEL step of ``crd_errors`` computes it, but whatever
    the earlier steps found): one evaluation, the cardinality, and their product."""
    costs: list[RuleCost] = []
    for i, version in enumerate(crd["spec"]["versions"]):
        schema = (version.get("schema") or {}).get("openAPIV3Schema") or {}
        cel = _CelContext(1, [0], [], [])
        openapi_schema_errors(schema, f"spec.versions[{i}].schema.openAPIV3Schema", _Ssv(), True, cel)
        costs += cel.costs
    return costs


_SCHEMA_KEY_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(["id", "$schema", "$ref", "description", "type", "format", "title", "pattern"], (str,)),
    **dict.fromkeys([_LIST_TYPE, _MAP_TYPE], (str,)),
    **dict.fromkeys(["maximum", "minimum", "multipleOf"], (int, float)),
    **dict.fromkeys(
        ["maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties"], (int,)
    ),
    **dict.fromkeys(["exclusiveMaximum", "exclusiveMinimum", "uniqueItems", "nullable"], (bool,)),
    **dict.fromkeys([_PRESERVE, _EMBEDDED, _INT_OR_STRING], (bool,)),
    **dict.fromkeys(["enum", "required", "allOf", "oneOf", "anyOf", _LIST_MAP_KEYS, _X_VALIDATIONS], (list,)),
    **dict.fromkeys(["not", "properties", "patternProperties", "definitions", "dependencies"], (dict,)),
    **dict.fromkeys(["externalDocs"], (dict,)),
    **dict.fromkeys(["items", "additionalProperties", "additionalItems"], (dict, bool, list)),
    **dict.fromkeys(["default", "example"], (object,)),
}
_RULE_KEYS = {"rule", "message", "messageExpression", "reason", "fieldPath", "optionalOldSelf"}


def decoding_problems(crd: dict[str, Any]) -> list[str]:
    """Schema keys the API server's decoder does not know or cannot decode. With kubectl's
    default (``--validate=strict``) each refuses the CRD (``strict decoding error: unknown
    field ...``); with the server's default for other clients they are dropped with a warning."""
    problems: list[str] = []
    for i, version in enumerate((crd.get("spec") or {}).get("versions") or []):
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if isinstance(schema, dict):
            _decode(schema, f"spec.versions[{i}].schema.openAPIV3Schema", problems)
    return problems


def _decode(node: dict[str, Any], path: str, problems: list[str]) -> None:
    for key, value in node.items():
        allowed = _SCHEMA_KEY_TYPES.get(key)
        if allowed is None:
            problems.append(f'unknown field "{_child(path, key)}"')
            continue
        if not isinstance(value, allowed) or (
            bool not in allowed and isinstance(value, bool) and object not in allowed
        ):
            problems.append(
                f"{_child(path, key)}: cannot decode {_json_type(value)} into "
                + "/".join(t.__name__ for t in allowed)
            )
            continue
        for child_path, child in _schema_children(key, value, path):
            _decode(child, child_path, problems)
        if key == _X_VALIDATIONS:
            for i, rule in enumerate(value):
                for unknown in set(rule) - _RULE_KEYS if isinstance(rule, dict) else ():
                    problems.append(f'unknown field "{_child(_key(_child(path, key), i), unknown)}"')


def _schema_children(key: str, value: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if key in ("properties", "patternProperties", "definitions") and isinstance(value, dict):
        for name, child in value.items():
            if isinstance(child, dict):
                yield _key(_child(path, key), name), child
    elif key in ("items", "additionalProperties", "additionalItems", "not") and isinstance(value, dict):
        yield _child(path, key), value
    elif key in ("allOf", "oneOf", "anyOf") or (key == "items" and isinstance(value, list)):
        for i, child in enumerate(value):
            if isinstance(child, dict):
                yield _key(_child(path, key), i), child


def pruning_hazards(crd: dict[str, Any]) -> list[str]:
    """Objects (other than the root's metadata) with neither ``properties`` nor
    ``additionalProperties`` nor ``x-kubernetes-preserve-unknown-fields``. The API server
    accepts them, but prunes every field written under them, which is rarely what a schema
    means; this is a check of this module's own, not the API server's."""
    hazards: list[str] = []
    for i, version in enumerate(crd["spec"]["versions"]):
        schema = version["schema"]["openAPIV3Schema"]
        root = f"spec.versions[{i}].schema.openAPIV3Schema"
        for name, child in _properties(schema).items():
            if name != "metadata":
                _hazards(child, _key(_child(root, "properties"), name), hazards)
    return hazards


def _hazards(node: dict[str, Any], path: str, hazards: list[str]) -> None:
    if node.get("type") == "object" and not (
        _properties(node) or node.get("additionalProperties") or node.get(_PRESERVE) or node.get(_EMBEDDED)
    ):
        hazards.append(f"{path}: an object without properties: every field under it is pruned")
    for name, child in _properties(node).items():
        _hazards(child, _key(_child(path, "properties"), name), hazards)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            _hazards(node[key], _child(path, key), hazards)


def admit(
    obj: dict[str, Any], crd: dict[str, Any], version: str | None = None
) -> tuple[dict[str, Any], list[str]]:
    """Create ``obj`` as the API server would: drop ``status`` (the status subresource owns it),
    prune unknown fields, apply defaults (each default then gets the defaults under it), drop
    disallowed nulls, then validate against the schema and run every present node's rules.
    Returns what would be stored and the errors (empty: admitted). ``oldSelf`` rules are skipped
    (a create has no old object)."""
    schema = version_schema(crd, version)
    chosen = next(
        v for v in crd["spec"]["versions"] if (v["name"] == version if version else v.get("storage"))
    )
    value = copy.deepcopy(obj)
    if "status" in (chosen.get("subresources") or {}):
        value.pop("status", None)
    value = prune(value, schema, resource_root=True)
    value = prune_nulls(apply_defaults(value, schema), schema)
    errors = value_errors(value, schema, "")
    errors += rule_errors(value, schema, "", resource_root=True)
    return value, [str(e) for e in errors]
