"""The InferenceCluster CRD passes the checks a Kubernetes 1.32 API server applies on create.

``apiserver_crd`` reproduces those checks (structural schema, every default against its node's
schema and CEL rules, rule compilation, estimated rule costs) because a unit test cannot start
an API server, and a refused CRD is otherwise found only when the chart is installed. The tests
of the checker itself show each check refusing what the API server refuses.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from shoal_operator import crd as crd_module
from tests.unit.apiserver_crd import (
    PER_CALL_LIMIT,
    STATIC_ESTIMATED_COST_LIMIT,
    admit,
    compile_rule,
    cost_report,
    crd_errors,
    decoding_problems,
    go_float,
    pruning_hazards,
    schema_decl,
)

ROOT = "spec.validation.openAPIV3Schema"
SPEC = f"{ROOT}.properties[spec]"


def chart_crd() -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load(crd_module.CRD_PATH.read_text())
    return manifest


def make_crd(
    spec: dict[str, Any], *, status: bool = False, root_rules: list[dict[str, str]] | None = None
) -> dict[str, Any]:
    """A one-version CRD whose ``spec`` field has the schema ``spec``."""
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
        },
    }
    if root_rules:
        schema["x-kubernetes-validations"] = root_rules
    version: dict[str, Any] = {
        "name": "v1",
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
    }
    if status:
        version["subresources"] = {"status": {}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {
            "group": "example.com",
            "scope": "Namespaced",
            "names": {"kind": "Widget", "listKind": "WidgetList", "plural": "widgets", "singular": "widget"},
            "versions": [version],
        },
    }


def obj(properties: dict[str, Any], **rest: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, **rest}


RANGE_RULES = [
    {"rule": "self.low <= self.high", "message": "low must be <= high"},
]
INT = {"type": "integer"}


# --------------------------------------------------------------------------------------------
# The chart's CRD.


def test_the_chart_crd_is_accepted() -> None:
    # Each object's default must already hold every field its rules read: the API server checks
    # a default as written, without filling in the defaults of the fields inside it.
    assert crd_errors(chart_crd()) == []


def test_the_chart_crd_has_no_unknown_or_undecodable_schema_keys() -> None:
    assert decoding_problems(chart_crd()) == []


def test_no_object_in_the_chart_crd_prunes_all_it_holds() -> None:
    assert pruning_hazards(chart_crd()) == []


def test_every_rule_of_the_chart_crd_is_within_the_static_cost_limit() -> None:
    report = cost_report(chart_crd())
    assert report, "the CRD has CEL rules"
    assert all(cost.total <= STATIC_ESTIMATED_COST_LIMIT for cost in report), report


def test_a_minimal_cluster_is_admitted_with_its_defaults() -> None:
    cluster = {
        "apiVersion": "shoal.dev/v1alpha1",
        "kind": "InferenceCluster",
        "metadata": {"name": "demo"},
        "spec": {"model": {"source": "Qwen/Qwen2.5-0.5B-Instruct", "servedName": "qwen"}},
    }
    stored, errors = admit(cluster, chart_crd())
    assert errors == []
    assert isinstance(stored["spec"]["engine"]["replicas"], int)  # the scale subresource's path


# --------------------------------------------------------------------------------------------
# Defaults: checked as written, against their node's schema and rules.

# The fields and rules of the CRD the API server refused: object defaults of {} under rules that
# read the objects' fields.
REFUSED_SPEC = obj(
    {
        "engine": obj(
            {
                "replicas": {"type": "integer", "default": 2},
                "minReplicas": {"type": "integer", "default": 1},
                "maxReplicas": {"type": "integer", "default": 8},
                "gpus": {"type": "integer", "default": 0},
                "kvTransport": {"type": "string", "enum": ["tcp", "gloo", "nccl"], "default": "tcp"},
            },
            default={},
            **{
                "x-kubernetes-validations": [
                    {
                        "rule": "self.minReplicas <= self.maxReplicas",
                        "message": "engine.minReplicas must be <= engine.maxReplicas",
                    },
                    {
                        "rule": "self.replicas >= self.minReplicas && self.replicas <= self.maxReplicas",
                        "message": "engine.replicas must lie between engine.minReplicas and "
                        "engine.maxReplicas",
                    },
                    {
                        "rule": "self.kvTransport != 'nccl' || self.gpus > 0",
                        "message": "engine.kvTransport nccl needs engine.gpus > 0",
                    },
                ]
            },
        ),
        "redis": obj(
            {
                "mode": {"type": "string", "enum": ["managed", "external"], "default": "managed"},
                "url": {"type": "string", "maxLength": 1024},
                "urlSecret": obj({"name": {"type": "string"}}),
            },
            default={},
            **{
                "x-kubernetes-validations": [
                    {
                        "rule": "self.mode == 'managed' || has(self.url) || has(self.urlSecret)",
                        "message": "redis.mode external needs redis.url or redis.urlSecret",
                    },
                    {
                        "rule": "!(has(self.url) && has(self.urlSecret))",
                        "message": "set only one of redis.url and redis.urlSecret",
                    },
                ]
            },
        ),
        "autoscaling": obj(
            {
                "metric": {"type": "string", "enum": ["kvUsage", "queueLength"], "default": "kvUsage"},
                "target": {"type": "number", "default": 0.7, "minimum": 0, "exclusiveMinimum": True},
            },
            default={},
            **{
                "x-kubernetes-validations": [
                    {
                        "rule": "self.metric != 'kvUsage' || self.target <= 1.0",
                        "message": "autoscaling.target is a fraction (<= 1) for metric kvUsage",
                    }
                ]
            },
        ),
    }
)


def test_object_defaults_of_nothing_under_rules_are_refused_as_the_api_server_refused_them() -> None:
    # Every field these rules read has a default of its own: they are not filled into {} first.
    got = crd_errors(make_crd(REFUSED_SPEC, status=True))
    assert got == [
        f'{SPEC}.properties[autoscaling].default: Invalid value: "object": '
        "no such key: metric evaluating rule: "
        "autoscaling.target is a fraction (<= 1) for metric kvUsage",
        f'{SPEC}.properties[engine].default: Invalid value: "object": '
        "no such key: minReplicas evaluating rule: "
        "engine.minReplicas must be <= engine.maxReplicas",
        f'{SPEC}.properties[engine].default: Invalid value: "object": '
        "no such key: replicas evaluating rule: "
        "engine.replicas must lie between engine.minReplicas and engine.maxReplicas",
        f'{SPEC}.properties[engine].default: Invalid value: "object": '
        "no such key: kvTransport evaluating rule: "
        "engine.kvTransport nccl needs engine.gpus > 0",
        f'{SPEC}.properties[redis].default: Invalid value: "object": '
        "no such key: mode evaluating rule: "
        "redis.mode external needs redis.url or redis.urlSecret",
    ]


def test_whole_object_defaults_satisfy_the_same_rules() -> None:
    spec = copy.deepcopy(REFUSED_SPEC)
    props = spec["properties"]
    props["engine"]["default"] = {
        "replicas": 2,
        "minReplicas": 1,
        "maxReplicas": 8,
        "gpus": 0,
        "kvTransport": "tcp",
    }
    props["redis"]["default"] = {"mode": "managed"}
    props["autoscaling"]["default"] = {"metric": "kvUsage", "target": 0.7}
    assert crd_errors(make_crd(spec)) == []


def test_the_rules_of_a_field_a_default_holds_run_on_it() -> None:
    inner = obj({"low": INT, "high": INT}, **{"x-kubernetes-validations": RANGE_RULES})
    spec = obj({"range": inner}, default={"range": {"low": 3, "high": 1}})
    assert crd_errors(make_crd(spec)) == [
        f'{SPEC}.default.range: Invalid value: "object": low must be <= high'
    ]


def test_a_default_breaking_its_rule_gets_the_rule_message() -> None:
    spec = obj(
        {"low": INT, "high": INT}, default={"low": 5, "high": 1}, **{"x-kubernetes-validations": RANGE_RULES}
    )
    assert crd_errors(make_crd(spec)) == [f'{SPEC}.default: Invalid value: "object": low must be <= high']


@pytest.mark.parametrize(
    ("field", "expected"),
    [
        (
            {"type": "string", "pattern": "^[a-z]+$", "default": "Abc"},
            f"{SPEC}.properties[f].default: Invalid value: \"Abc\":  in body should match '^[a-z]+$'",
        ),
        (
            {"type": "string", "enum": ["a", "b"], "default": "c"},
            f'{SPEC}.properties[f].default: Unsupported value: "c": supported values: "a", "b"',
        ),
        (
            {"type": "integer", "minimum": 1, "default": 0},
            f"{SPEC}.properties[f].default: Invalid value: 0:  in body should be greater than or equal to 1",
        ),
        (
            {"type": "number", "minimum": 0, "exclusiveMinimum": True, "default": 0.0},
            f"{SPEC}.properties[f].default: Invalid value: 0:  in body should be greater than 0",
        ),
        (
            {"type": "string", "maxLength": 2, "default": "abc"},
            f"{SPEC}.properties[f].default: Too long: may not be longer than 2",
        ),
        (
            {"type": "integer", "default": "3"},
            f'{SPEC}.properties[f].default: Invalid value: "string": '
            ' in body must be of type integer: "string"',
        ),
        (
            obj({"name": {"type": "string"}}, required=["name"], default={}),
            f"{SPEC}.properties[f].default.name: Required value",
        ),
        (
            obj({"name": {"type": "string"}}, default={"nmae": "x"}),
            f"{SPEC}.properties[f].default: Invalid value: "
            'map[string]interface {}{"nmae":"x"}: must not have unknown fields',
        ),
    ],
)
def test_a_default_is_checked_against_its_node_schema(field: dict[str, Any], expected: str) -> None:
    assert crd_errors(make_crd(obj({"f": field}))) == [expected]


def test_a_default_is_checked_against_the_fields_under_it() -> None:
    spec = obj({"size": {"type": "integer", "maximum": 4}}, default={"size": 5})
    assert crd_errors(make_crd(spec)) == [
        f"{SPEC}.default.size: Invalid value: 5: size in body should be less than or equal to 4"
    ]


def test_a_default_that_fails_its_schema_is_not_run_through_its_rules() -> None:
    spec = obj(
        {"low": {"type": "integer", "minimum": 0}, "high": INT},
        default={"low": -1},
        **{"x-kubernetes-validations": RANGE_RULES},
    )
    assert crd_errors(make_crd(spec)) == [
        f"{SPEC}.default.low: Invalid value: -1: low in body should be greater than or equal to 0"
    ]


def test_defaults_are_forbidden_in_top_level_metadata() -> None:
    crd = make_crd(obj({}))
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["metadata"]["default"] = {}
    assert (
        f"{ROOT}.properties[metadata].default: Forbidden: must not be set in top-level metadata"
        in crd_errors(crd)
    )


# --------------------------------------------------------------------------------------------
# Structural schemas.


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            obj({"f": {"description": "no type"}}),
            f"{SPEC}.properties[f].type: Required value: must not be empty for specified object fields",
        ),
        ({"type": "array"}, f"{SPEC}.items: Required value: must be specified"),
        (
            {"type": "array", "items": {"maxLength": 3}},
            f"{SPEC}.items.type: Required value: must not be empty for specified array items",
        ),
        (
            obj({"f": {"type": "string"}}, allOf=[{"type": "string"}]),
            f"{SPEC}.allOf[0].type: Forbidden: must be empty to be structural",
        ),
        (
            obj({"f": {"type": "string"}}, anyOf=[{"description": "x", "required": ["f"]}]),
            f"{SPEC}.anyOf[0].description: Forbidden: must be empty to be structural",
        ),
        (
            obj({"f": {"type": "string"}}, oneOf=[{"default": {}}]),
            f"{SPEC}.oneOf[0].default: Forbidden: must be undefined to be structural",
        ),
        (
            obj({"f": {"type": "string"}}, additionalProperties={"type": "string"}),
            f"{SPEC}.additionalProperties: Forbidden: "
            "additionalProperties and properties are mutual exclusive",
        ),
        (
            obj({"f": {"type": "string", "pattern": "(?=a)"}}),
            f'{SPEC}.properties[f].pattern: Invalid value: "(?=a)": must be a valid regular expression, but '
            "isn't: error parsing regexp: invalid or unsupported Perl syntax: `(?=`",
        ),
    ],
)
def test_a_non_structural_schema_is_refused(spec: dict[str, Any], expected: str) -> None:
    assert expected in crd_errors(make_crd(spec))


def test_metadata_may_only_restrict_name_and_generate_name() -> None:
    crd = make_crd(obj({}))
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    root["properties"]["metadata"] = obj({"name": {"type": "string", "maxLength": 10}})
    assert crd_errors(crd) == []
    root["properties"]["metadata"] = obj(
        {"labels": {"type": "object", "additionalProperties": {"type": "string"}}}
    )
    assert crd_errors(crd) == [
        f"{ROOT}.properties[metadata]: Forbidden: "
        "must not specify anything other than name and generateName, "
        "but metadata is implicitly specified"
    ]


def test_a_structural_error_stops_the_default_and_rule_checks() -> None:
    spec = obj(
        {"f": {"description": "no type"}},
        default={"unknown": 1},
        **{"x-kubernetes-validations": [{"rule": "self.x"}]},
    )
    assert crd_errors(make_crd(spec)) == [
        f"{SPEC}.properties[f].type: Required value: must not be empty for specified object fields"
    ]


def test_an_int_or_string_field_needs_no_type() -> None:
    spec = obj(
        {"port": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}}
    )
    assert crd_errors(make_crd(spec)) == []


def test_the_root_may_only_hold_some_fields_with_the_status_subresource() -> None:
    crd = make_crd(obj({}), status=True)
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["enum"] = [{}]
    assert any(
        "fields are allowed at the root of the schema if the status subresource is enabled" in e
        for e in crd_errors(crd)
    )


# --------------------------------------------------------------------------------------------
# CEL rules: compilation.


@pytest.mark.parametrize(
    ("rule", "detail"),
    [
        ("self.low <=", "compilation failed: ERROR: <input>:1:10: Syntax error"),
        ("self.lwo <= self.high", "compilation failed: ERROR: <input>: undefined field 'lwo'"),
        ("self.low + self.high", "cel expression must evaluate to a bool"),
        (
            "self.low.isPrime()",
            "compilation failed: ERROR: <input>: undeclared reference to 'isPrime' (in container '')",
        ),
        (
            "other.low == 1",
            "compilation failed: ERROR: <input>: undeclared reference to 'other' (in container '')",
        ),
    ],
)
def test_a_rule_that_does_not_compile_is_refused(rule: str, detail: str) -> None:
    spec = obj({"low": INT, "high": INT}, **{"x-kubernetes-validations": [{"rule": rule, "message": "m"}]})
    errors = crd_errors(make_crd(spec))
    assert len(errors) == 1
    assert errors[0].startswith(
        f"{SPEC}.x-kubernetes-validations[0].rule: Invalid value: apiextensions.ValidationRule{{"
    )
    assert detail in errors[0]


def test_a_message_expression_must_compile_to_a_string() -> None:
    rules = [{"rule": "self.low <= self.high", "messageExpression": "self.low"}]
    errors = crd_errors(make_crd(obj({"low": INT, "high": INT}, **{"x-kubernetes-validations": rules})))
    assert len(errors) == 1 and errors[0].startswith(
        f"{SPEC}.x-kubernetes-validations[0].messageExpression: Invalid value"
    )
    assert errors[0].endswith("messageExpression must evaluate to a string")


def test_a_message_built_with_string_conversion_exceeds_the_cost_budget() -> None:
    # string(x) has no size bound, so the concatenation is costed as unbounded (as upstream).
    rules = [{"rule": "self.low <= self.high", "messageExpression": "'low is ' + string(self.low)"}]
    errors = crd_errors(make_crd(obj({"low": INT, "high": INT}, **{"x-kubernetes-validations": rules})))
    where = f"{SPEC}.x-kubernetes-validations[0].messageExpression"
    assert errors == [
        f"{where}: Forbidden: estimated messageExpression cost exceeds budget by factor of more than 100x "
        "(try simplifying the rule, or adding maxItems, maxProperties, and maxLength where arrays, maps, "
        "and strings are declared)",
        f"{where}: Forbidden: contributed to estimated rule cost total exceeding cost limit for entire "
        "OpenAPIv3 schema",
        f"{ROOT}: Forbidden: x-kubernetes-validations estimated rule cost total for entire OpenAPIv3 schema "
        "exceeds budget by factor of more than 100x (try simplifying the rule, or adding maxItems, "
        "maxProperties, and maxLength where arrays, maps, and strings are declared)",
    ]


def test_rule_fields_are_checked() -> None:
    rules = [
        {"rule": " "},
        {"rule": "self.low > 0", "message": "a\nb"},
        {"rule": "self.low > 0", "reason": "Bad"},
    ]
    errors = crd_errors(make_crd(obj({"low": INT}, **{"x-kubernetes-validations": rules})))
    assert errors == [
        f"{SPEC}.x-kubernetes-validations[0].rule: Required value: rule is not specified",
        f'{SPEC}.x-kubernetes-validations[1].message: Invalid value: "a\\nb": '
        "message must not contain line breaks",
        f'{SPEC}.x-kubernetes-validations[2].reason: Unsupported value: "Bad": supported values: '
        '"FieldValueDuplicate", "FieldValueForbidden", "FieldValueInvalid", "FieldValueRequired"',
    ]


def test_old_self_is_refused_under_a_list_whose_items_do_not_correlate() -> None:
    item = obj(
        {"name": {"type": "string", "maxLength": 10}},
        **{"x-kubernetes-validations": [{"rule": "self == oldSelf"}]},
    )
    errors = crd_errors(make_crd(obj({"items": {"type": "array", "maxItems": 4, "items": item}})))
    assert errors == [
        f'{SPEC}.properties[items].items.x-kubernetes-validations[0].rule: Invalid value: "self == oldSelf": '
        f"oldSelf cannot be used on the uncorrelatable portion of the schema within {SPEC}.properties[items]"
    ]
    correlated = obj(
        {"items": {"type": "array", "maxItems": 4, "items": item, "x-kubernetes-list-type": "map"}}
    )
    correlated["properties"]["items"]["x-kubernetes-list-map-keys"] = ["name"]
    item["required"] = ["name"]
    assert crd_errors(make_crd(correlated)) == []


# --------------------------------------------------------------------------------------------
# CEL rules: estimated cost.

NAMES_RULE = [{"rule": "self.names.all(n, n.matches('^[a-z][a-z0-9-]*$'))", "message": "bad name"}]


def test_iterating_an_unbounded_list_of_unbounded_strings_exceeds_the_cost_budget() -> None:
    spec = obj(
        {"names": {"type": "array", "items": {"type": "string"}}}, **{"x-kubernetes-validations": NAMES_RULE}
    )
    errors = crd_errors(make_crd(spec))
    assert errors[0].startswith(
        f"{SPEC}.x-kubernetes-validations[0].rule: Forbidden: "
        "estimated rule cost exceeds budget by factor of more than 100x"
    )
    assert "adding maxItems, maxProperties, and maxLength" in errors[0]


def test_bounds_on_the_list_and_its_strings_bring_the_cost_within_budget() -> None:
    names = {"type": "array", "maxItems": 32, "items": {"type": "string", "maxLength": 63}}
    spec = obj({"names": names}, **{"x-kubernetes-validations": NAMES_RULE})
    assert crd_errors(make_crd(spec)) == []
    (cost,) = cost_report(make_crd(spec))
    assert cost.per_call < PER_CALL_LIMIT


def test_a_rule_under_a_list_costs_once_per_item_the_list_may_hold() -> None:
    item = obj(
        {"name": {"type": "string", "maxLength": 4096}},
        **{"x-kubernetes-validations": [{"rule": "self.name.matches('^[a-z][a-z0-9-]*[a-z0-9]$')"}]},
    )
    bounded = obj({"items": {"type": "array", "maxItems": 8, "items": item}})
    assert crd_errors(make_crd(bounded)) == []
    (cost,) = cost_report(make_crd(bounded))
    assert cost.cardinality == 8 and cost.total == 8 * cost.per_call
    # Without maxItems the API server assumes as many items as a 3 MiB request can hold.
    unbounded = obj({"items": {"type": "array", "items": item}})
    errors = crd_errors(make_crd(unbounded))
    rule = f"{SPEC}.properties[items].items.x-kubernetes-validations[0].rule"
    assert errors[0].startswith(
        f"{rule}: Forbidden: estimated rule cost exceeds budget by factor of more than 100x"
    )
    assert errors[1] == (
        f"{rule}: Forbidden: "
        "contributed to estimated rule cost total exceeding cost limit for entire OpenAPIv3 schema"
    )
    assert errors[2].startswith(f"{ROOT}: Forbidden: x-kubernetes-validations estimated rule cost total")
    assert len(errors) == 3


def test_rules_within_budget_alone_can_exceed_the_budget_of_the_whole_schema() -> None:
    # 7 million characters at most (maxLength counts runes of up to 4 bytes), a 40-character
    # regular expression: 1 + 700,001 * 10 per rule, under the 10M limit; 16 of them make
    # 112,000,176, over the 100M of the whole schema.
    field = {"type": "string", "maxLength": 1_750_000}
    rule = {"rule": f"self.matches('^{'a' * 38}$')"}
    spec = obj({f"f{i:02}": {**field, "x-kubernetes-validations": [rule]} for i in range(16)})
    report = cost_report(make_crd(spec))
    assert all(STATIC_ESTIMATED_COST_LIMIT > cost.total > 7_000_000 for cost in report)
    errors = crd_errors(make_crd(spec))
    assert errors[-1] == (
        f"{ROOT}: Forbidden: x-kubernetes-validations estimated rule cost total for entire OpenAPIv3 schema "
        "exceeds budget by factor of 1.120002x (try simplifying the rule, or adding maxItems, maxProperties, "
        "and maxLength where arrays, maps, and strings are declared)"
    )
    assert sum("contributed to estimated rule cost total" in e for e in errors) == 4
    assert len(errors) == 5


def test_cost_estimates_follow_cel_go() -> None:
    decl = schema_decl(obj({"s": {"type": "string", "maxLength": 10}, "n": INT}))
    assert decl is not None
    # self.s.startsWith('ab'): select 2 + ident-free literal 0 + ceil(2 * 0.1) = 3
    assert compile_rule({"rule": "self.s.startsWith('ab')"}, decl).max_cost == 3
    # self.n > 1 && self.s == 'x': (2 + 1) + (2 + ceil(1 * 0.1))
    assert compile_rule({"rule": "self.n > 1 && self.s == 'x'"}, decl).max_cost == 6


# --------------------------------------------------------------------------------------------
# The CRD's other fields, and admission of objects.


def test_the_crd_name_must_be_plural_dot_group() -> None:
    crd = make_crd(obj({}))
    crd["metadata"]["name"] = "widget.example.com"
    assert crd_errors(crd) == [
        'metadata.name: Invalid value: "widget.example.com": must be spec.names.plural+"."+spec.group'
    ]


def test_printer_columns_and_scale_paths_are_checked() -> None:
    crd = make_crd(obj({"replicas": INT}), status=True)
    version = crd["spec"]["versions"][0]
    version["subresources"]["scale"] = {
        "specReplicasPath": ".status.replicas",
        "statusReplicasPath": ".status.replicas",
    }
    version["additionalPrinterColumns"] = [{"name": "Replicas", "type": "int", "jsonPath": ".spec.replicas"}]
    assert crd_errors(crd) == [
        'spec.subresources.scale.specReplicasPath: Invalid value: ".status.replicas": '
        "should be a json path under .spec",
        'spec.additionalPrinterColumns[0].type: Invalid value: "int": '
        "must be one of boolean,date,integer,number,string",
    ]


def test_admission_fills_in_nested_defaults_before_the_rules_run() -> None:
    engine = REFUSED_SPEC["properties"]["engine"]
    crd = make_crd(obj({"engine": engine}))
    stored, errors = admit({"spec": {}}, crd)
    assert errors == []
    assert stored["spec"]["engine"] == {
        "replicas": 2,
        "minReplicas": 1,
        "maxReplicas": 8,
        "gpus": 0,
        "kvTransport": "tcp",
    }
    _, errors = admit({"spec": {"engine": {"minReplicas": 9}, "unknown": 1}}, crd)
    assert errors == [
        'spec.engine: Invalid value: "object": engine.minReplicas must be <= engine.maxReplicas',
        'spec.engine: Invalid value: "object": '
        "engine.replicas must lie between engine.minReplicas and engine.maxReplicas",
    ]


def test_admission_checks_the_schema_and_treats_numbers_as_doubles() -> None:
    autoscaling = REFUSED_SPEC["properties"]["autoscaling"]
    crd = make_crd(obj({"autoscaling": autoscaling}))
    _, errors = admit({"spec": {"autoscaling": {"target": 2}}}, crd)  # 2 is a double to CEL
    assert errors == [
        'spec.autoscaling: Invalid value: "object": '
        "autoscaling.target is a fraction (<= 1) for metric kvUsage"
    ]
    _, errors = admit({"spec": {"autoscaling": {"metric": "other"}}}, crd)
    assert errors == [
        'spec.autoscaling.metric: Unsupported value: "other": supported values: "kvUsage", "queueLength"'
    ]


def test_a_rule_at_the_root_sees_the_resource_name() -> None:
    crd = make_crd(obj({}), root_rules=[{"rule": "self.metadata.name.size() <= 5", "message": "short names"}])
    assert crd_errors(crd) == []
    _, errors = admit({"metadata": {"name": "abc"}, "spec": {}}, crd)
    assert errors == []
    _, errors = admit({"metadata": {"name": "abcdef"}, "spec": {}}, crd)
    assert errors == ['<nil>: Invalid value: "object": short names']  # the root's path is nil


def test_floats_print_as_go_prints_them() -> None:
    assert [go_float(x) for x in (0.7, 2.0, 123456.0, 1e6, 1048576.0, 1e21, 0.00001, -1.5)] == [
        "0.7",
        "2",
        "123456",
        "1e+06",
        "1.048576e+06",
        "1e+21",
        "1e-05",
        "-1.5",
    ]
