"""The CRD: generated files in sync, a structural schema, samples valid, wrong specs refused.

What the API server does on `kubectl apply` is reproduced here without one: defaults are applied from
the schema (baton.operator.defaults), the OpenAPI schema is checked with `jsonschema`, and every CEL rule
(`x-kubernetes-validations`) is evaluated with `cel-python` (celpy), walking the schema like the API
server does. The CEL rules and the operator's Python twins must agree on every case.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml

from baton.operator.crd import build_crd, openapi_schema
from baton.operator.defaults import apply_defaults
from baton.operator.install import generated_files
from baton_testing.kube.objects import for_create, isvc_body
from baton.operator.validation import RULES, Scope, rules_for, validate

_ENV = celpy.Environment()


def cel(rule: str, value: Any) -> bool:
    result = _ENV.program(_ENV.compile(rule)).evaluate({"self": celpy.json_to_cel(value)})
    assert not isinstance(result, celpy.CELEvalError), f"{rule!r} failed to evaluate: {result}"
    return bool(result)


def cel_violations(schema: dict[str, Any], value: Any, path: str = "") -> set[tuple[str, str]]:
    """(path, message) of every CEL rule `value` breaks, like the API server's validation."""
    out = {(path or "metadata.name", r["message"]) for r in schema.get("x-kubernetes-validations", [])
           if not cel(r["rule"], value)}
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                out |= cel_violations(sub, value[key], f"{path}.{key}" if path else key)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            out |= cel_violations(schema["items"], item, path)
    return out


def api_server_refusals(obj: dict[str, Any]) -> list[str]:
    """Messages `kubectl apply` would show for `obj` (schema errors first, then CEL)."""
    schema = openapi_schema()
    obj = apply_defaults(schema, obj)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(schema).iter_errors(obj)]
    return errors or [f"{p}: {m}" for p, m in sorted(cel_violations(schema, obj))]


def test_generated_files_are_in_sync(repo: Path):
    stale = [path for path, text in generated_files(str(repo)).items()
             if not Path(path).exists() or Path(path).read_text() != text]
    assert not stale, f"run `python -m baton.operator.install --write`; stale: {stale}"


def _walk(schema: dict[str, Any], path: str = "root"):
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural_and_cel_costs_are_bounded():
    for path, node in _walk(openapi_schema()):
        if not node.get("x-kubernetes-int-or-string"):
            assert "type" in node, f"{path} has no type (not a structural schema)"
        assert not ("properties" in node and "additionalProperties" in node), path
        if node.get("type") == "array":
            assert "items" in node, path
        if node.get("x-kubernetes-validations") and node.get("type") == "array":
            assert "maxItems" in node and "maxLength" in node["items"], f"{path}: unbounded CEL cost"
        for rule in node.get("x-kubernetes-validations", []):
            assert rule["message"] and _ENV.compile(rule["rule"]) is not None


def test_crd_has_status_subresource_and_printer_columns():
    version = build_crd()["spec"]["versions"][0]
    # scale: kubectl scale bisvc gets the CEL rule's advice (spec.replicas is refused) instead of a NotFound
    assert version["subresources"] == {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                               "statusReplicasPath": ".status.replicas"}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert {"Prefill", "Decode", "Router", "Endpoint", "Age"} <= set(columns)


def test_samples_pass_the_api_server_checks_and_the_operator(samples):
    assert {"cpu-smollm2.yaml", "gpu-rdma.yaml", "cpu-colocated.yaml"} <= set(samples)
    for name, body in samples.items():
        assert api_server_refusals(body) == [], name
        assert validate(apply_defaults(openapi_schema(), body)) == [], name


BAD_SCHEMA = [  # refused by the OpenAPI schema: (spec override, expected words in the message)
    ({"kvTransfer": {"protocol": "udp"}}, "'udp' is not one of ['tcp', 'rdma']"),
    ({"prefill": {"replicas": -1}}, "-1 is less than the minimum of 0"),
    ({"decode": {"terminationGracePeriodSeconds": 90000}}, "90000 is greater than the maximum of 86400"),
    ({"decode": {"tp": 0}}, "0 is less than the minimum of 1"),
    ({"router": {"decodePolicy": "fastest"}}, "'fastest' is not one of"),
    ({"router": {"service": {"port": 70000}}}, "70000 is greater than the maximum of 65535"),
    ({"model": {"name": "m", "path": "relative/path"}}, "does not match '^/'"),
    ({"mode": "split"}, "'split' is not one of ['disaggregated', 'colocated']"),
    ({"model": {"name": "m", "path": "/m", "kvCacheDtype": "fp8_e4m3"}}, "'fp8_e4m3' is not one of"),
    ({"model": {"name": "m", "path": "/m", "dtype": "float64"}}, "'float64' is not one of"),
    ({"model": {"name": "m", "path": "/m", "toolCallParser": "gpt"}}, "'gpt' is not one of"),
    ({"autoscaling": {"mode": "hpa"}}, "'hpa' is not one of ['static', 'external', 'planner']"),
    ({"model": {"name": "m", "source": "ftp://x/y"}}, "does not match"),
]


@pytest.mark.parametrize("spec, words", BAD_SCHEMA)
def test_schema_refuses_wrong_values_with_a_readable_message(spec, words):
    refusals = api_server_refusals(for_create(isvc_body(**spec)))
    assert any(words in r for r in refusals), refusals


BAD_RULES = [  # refused by CEL rules (and by the operator's Python twins)
    {"mode": "colocated", "prefill": {}},
    {"engine": {}},
    {"prefill": {"tp": 2, "gpus": 1}},
    {"decode": {"dp": 2, "tp": 2, "gpus": 2}},
    {"prefill": {"tp": 2, "gpus": 2}, "decode": {"tp": 3, "gpus": 3}},  # neither TP size divides the other
    {"decode": {"extraArgs": ["--enable-mixed-chunk"]}},  # mixed chunk: colocated only
    {"prefill": {"tp": 4}, "decode": {"tp": 6}},
    {"mode": "colocated", "engine": {"tp": 2, "gpus": 1}},  # gpus == tp * dp applies to TP too
    {"prefill": {"extraArgs": ["--tp-size=4"]}},
    {"decode": {"extraArgs": ["--disaggregation-mode", "prefill"]}},
    {"router": {"extraArgs": ["--api-key", "x"]}},
    {"decode": {"extraArgs": ["--kv-cache-dtype", "fp8_e5m2"]}},  # spec.model.kvCacheDtype: both roles
    {"prefill": {"extraArgs": ["--tool-call-parser=qwen25"]}},  # spec.model.toolCallParser: both roles
    {"prefill": {"extraArgs": ["--dtype=bfloat16"]}},
    {"decode": {"extraArgs": ["--kv-cache-dtyp", "fp8_e5m2"]}},  # an abbreviation: not a flag of baton serve
    {"router": {"extraArgs": ["--request-timeout", "30"]}},  # nor of baton router
    {"kvTransfer": {"ibDevices": ["mlx5_0"]}},
    {"kvTransfer": {"rdmaResourceName": "rdma/x"}},
    {"model": {"name": "m", "path": "/m", "pvc": {"claimName": "c"}, "hostPath": {"path": "/h"}}},
    {"model": {"name": "m", "path": "/m", "hostPath": {"path": "/"}}},  # the node's root
    {"model": {"name": "m", "path": "/m", "hostPath": {"path": "/etc/kubernetes"}}},
    {"model": {"name": "m", "path": "/m", "hostPath": {"path": "/var/lib/kubelet/pods"}}},
    {"model": {"name": "m", "path": "/m", "hostPath": {"path": "/var"}}},  # holds /var/lib/kubelet
    {"model": {"name": "m", "path": "/m", "hostPath": {"path": "/models/../etc"}}},
    {"model": {"name": "m", "path": "/m", "hostPath": {"path": "//etc"}}},
    {"decode": {"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "any", "key": "k"}}}]}},
    {"router": {"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "any", "key": "k"}}}]}},
    {"decode": {"env": [{"name": "BATON_API_KEY", "value": ""}]}},  # would turn the internal key off
    {"router": {"env": [{"name": "BATON_ENGINE_API_KEY", "value": "guess"}]}},
    {"router": {"extraArgs": ["--engine-api-key", "guess"]}},
    # spec.model.source
    {"model": {"name": "m"}},  # neither source nor path
    {"model": {"name": "m", "source": "hf://just-a-name", "cache": {"claimName": "c"}}},
    {"model": {"name": "m", "source": "hf://org/name@../x", "cache": {"claimName": "c"}}},
    {"model": {"name": "m", "source": "s3://Bad_Bucket/x", "cache": {"claimName": "c"}}},
    {"model": {"name": "m", "source": "pvc://claim//x"}},
    {"model": {"name": "m", "source": "/models/../etc"}},
    {"model": {"name": "m", "source": "pvc://claim/x", "pvc": {"claimName": "c"}}},
    {"model": {"name": "m", "source": "/models/x", "hostPath": {"path": "/data"}}},
    {"model": {"name": "m", "source": "hf://org/name", "path": "/m", "cache": {"claimName": "c"}}},
    {"model": {"name": "m", "source": "s3://bucket/prefix"}},  # no cache
    {"model": {"name": "m", "path": "/m", "cache": {"claimName": "c"}}},  # a cache without a fetched source
    {"model": {"name": "m", "source": "pvc://claim/x", "fetch": {"secretName": "s"}}},
    {"model": {"name": "m", "source": "hf://org/name", "cache": {"claimName": "c", "emptyDir": {}}}},
    {"model": {"name": "m", "source": "hf://org/name", "cache": {}}},
    # spec.model.updateStrategy InPlace: a shared cache claim only
    {"model": {"name": "m", "source": "hf://org/name", "cache": {"emptyDir": {}}, "updateStrategy": "InPlace"}},
    {"model": {"name": "m", "path": "/m", "updateStrategy": "InPlace"}},
    {"model": {"name": "m", "source": "pvc://claim/x", "updateStrategy": "InPlace"}},
    # kubectl scale bisvc writes spec.replicas through the scale subresource
    {"replicas": 2},
    # spec.autoscaling
    {"mode": "colocated", "autoscaling": {"mode": "planner", "decode": {"targetKVUsage": 0.7}}},
    {"autoscaling": {"mode": "planner", "engine": {"targetKVUsage": 0.7}}},
    {"autoscaling": {"mode": "planner", "prefillDecodeRatio": {"min": 2, "max": 1}}},
    {"autoscaling": {"mode": "planner", "decode": {"minReplicas": 5, "targetKVUsage": 0.7}}},
    {"autoscaling": {"mode": "planner", "prefill": {"maxReplicas": 2}}},
]


@pytest.mark.parametrize("spec", BAD_RULES)
def test_cel_rules_refuse_and_agree_with_the_operator(spec):
    obj = apply_defaults(openapi_schema(), for_create(isvc_body(**spec)))
    by_cel = {f"{p}: {m}" for p, m in cel_violations(openapi_schema(), obj)}
    assert by_cel, "the API server would accept this"
    assert by_cel == set(validate(obj))


@pytest.mark.parametrize("name, ok", [("demo", True), ("a" * 45, True), ("a" * 46, False),
                                      ("Demo", False), ("9lives", False), ("demo-", False)])
def test_name_rules(name, ok):
    obj = for_create(isvc_body(name=name))
    assert (api_server_refusals(obj) == []) is ok
    assert (validate(apply_defaults(openapi_schema(), obj)) == []) is ok


def test_good_variants_pass_both(samples):
    good = [{"prefill": {"dp": 4, "gpus": 4}}, {"kvTransfer": {"protocol": "rdma", "ibDevices": ["mlx5_0"]}},
            {"mode": "colocated"}, {"decode": {"extraArgs": ["--max-running-requests", "1", "--mem-fraction-static=0.8"]}},
            {"mode": "colocated", "engine": {"tp": 2, "gpus": 2}}, {"mode": "colocated", "engine": {"tp": 4, "dp": 2}},
            {"model": {"name": "m", "source": "hf://Qwen/Qwen3-0.6B@main", "cache": {"claimName": "models"},
                       "fetch": {"secretName": "hf-token", "endpoint": "http://hub-mirror:8080", "include": ["*.json"]}}},
            {"model": {"name": "m", "source": "s3://models/qwen3", "cache": {"emptyDir": {"sizeLimit": "20Gi"}},
                       "fetch": {"region": "eu-west-1"}}},
            {"model": {"name": "m", "source": "pvc://models/qwen3"}}, {"model": {"name": "m", "source": "/models/x"}},
            {"model": {"name": "m", "source": "pvc://models/qwen3", "path": "/weights"}},
            {"autoscaling": {"mode": "planner", "prefillDecodeRatio": {"min": 0.25, "max": 1},
                             "prefill": {"targetTTFTSeconds": 0.5, "targetQueuedTokens": 8192, "maxReplicas": 2},
                             "decode": {"targetKVUsage": 0.7, "targetITLSeconds": 0.04, "maxReplicas": 8}}},
            {"mode": "colocated", "autoscaling": {"mode": "planner", "engine": {"targetKVUsage": 0.7}}}]
    for spec in good:
        obj = for_create(isvc_body(**spec))
        assert api_server_refusals(obj) == [], spec
        assert validate(apply_defaults(openapi_schema(), obj)) == [], spec


def test_pd_roles_take_their_own_tp_when_one_divides_the_other():
    [tp_rule] = [r for r in rules_for(Scope.SPEC) if "tp must divide one another" in r.message]
    spec = openapi_schema()["properties"]["spec"]
    assert tp_rule.cel in [r["rule"] for r in spec["x-kubernetes-validations"]]
    for good in ({"prefill": {"tp": 2, "gpus": 2}, "decode": {"tp": 2, "gpus": 2}},
                 {"prefill": {"tp": 2, "dp": 2, "gpus": 4}, "decode": {"tp": 2}},
                 {"decode": {"tp": 2, "gpus": 2}}, {"prefill": {"tp": 4}, "decode": {"tp": 2}},
                 {"prefill": {"tp": 2}, "decode": {"tp": 8}}, {"decode": {"tp": 3, "gpus": 3}}):
        obj = apply_defaults(openapi_schema(), for_create(isvc_body(**good)))
        assert cel_violations(openapi_schema(), obj) == set() and validate(obj) == [], good
    for bad in ({"prefill": {"tp": 2}, "decode": {"tp": 3, "gpus": 3}}, {"prefill": {"tp": 4}, "decode": {"tp": 6}},
                {"prefill": {"tp": 3}, "decode": {"tp": 2}}):
        obj = apply_defaults(openapi_schema(), for_create(isvc_body(**bad)))
        assert cel_violations(openapi_schema(), obj) == {("spec", tp_rule.message)}, bad
        assert validate(obj) == [f"spec: {tp_rule.message}"], bad


def test_dtype_enums_are_the_engines_choices():
    from baton.engine.parsers import REASONING_PARSERS, TOOL_PARSERS
    from baton.engine.server_args import KV_CACHE_DTYPES, MODEL_DTYPES

    model = openapi_schema()["properties"]["spec"]["properties"]["model"]["properties"]
    assert model["dtype"]["enum"] == list(MODEL_DTYPES)
    assert model["kvCacheDtype"]["enum"] == list(KV_CACHE_DTYPES)
    assert model["toolCallParser"]["enum"] == list(TOOL_PARSERS)
    assert model["reasoningParser"]["enum"] == list(REASONING_PARSERS)
    defaulted = apply_defaults(openapi_schema(), for_create(isvc_body()))["spec"]["model"]
    assert (defaulted["dtype"], defaulted["kvCacheDtype"]) == ("auto", "auto")


def test_model_folders_and_env_from_the_downward_api_pass():
    for path in ("/models", "/mnt/models/llama", "/var/models", "/etcetera", "/data/run"):
        obj = apply_defaults(openapi_schema(), for_create(isvc_body(
            model={"name": "m", "path": "/m", "hostPath": {"path": path}},
            decode={"env": [{"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]})))
        assert cel_violations(openapi_schema(), obj) == set() and validate(obj) == [], path


def test_every_rule_is_exercised():
    hit = set()
    for spec in BAD_RULES:
        obj = apply_defaults(openapi_schema(), for_create(isvc_body(**spec)))
        hit |= {m for _, m in cel_violations(openapi_schema(), obj)}
    hit |= {m for _, m in cel_violations(openapi_schema(), apply_defaults(openapi_schema(),
                                                                           for_create(isvc_body(name="X" * 50))))}
    assert hit == {r.message for r in RULES}


def test_defaults_match_the_schema_round_trip():
    once = apply_defaults(openapi_schema(), for_create(isvc_body()))
    assert apply_defaults(openapi_schema(), copy.deepcopy(once)) == once
    assert yaml.safe_load(yaml.safe_dump(once)) == once


def test_mixed_chunk_is_taken_by_the_colocated_engine_only():
    """An engine of a PD pair refuses --enable-mixed-chunk at start-up: the CRD refuses it there."""
    [rule] = [r for r in rules_for(Scope.SPEC) if "--enable-mixed-chunk" in r.message]
    spec = openapi_schema()["properties"]["spec"]
    assert rule.cel in [r["rule"] for r in spec["x-kubernetes-validations"]]
    for good in ({"mode": "colocated", "engine": {"extraArgs": ["--enable-mixed-chunk"]}},
                 {"prefill": {"extraArgs": ["--chunked-prefill-size", "4096"]}, "decode": {}}):
        obj = apply_defaults(openapi_schema(), for_create(isvc_body(**good)))
        assert cel_violations(openapi_schema(), obj) == set() and validate(obj) == [], good
    for bad in ({"prefill": {"extraArgs": ["--enable-mixed-chunk"]}},
                {"decode": {"extraArgs": ["--log-level", "info", "--enable-mixed-chunk"]}}):
        obj = apply_defaults(openapi_schema(), for_create(isvc_body(**bad)))
        assert cel_violations(openapi_schema(), obj) == {("spec", rule.message)}, bad
        assert validate(obj) == [f"spec: {rule.message}"], bad


SOURCES = ["hf://Qwen/Qwen3-0.6B", "hf://Qwen/Qwen3-0.6B@main", "hf://a/b@refs/pr/1", "hf://a/b@0123abc",
           "hf://org/name@v1.0", "hf://a", "hf://a/b/c", "hf://-a/b", "hf://a/b@", "hf://a/b@x..y", "hf://a/b@./x",
           "hf://a/b@x//y", "s3://bucket", "s3://bucket/", "s3://bucket/a/b", "s3://my.bucket-1/p=1/x+y",
           "s3://B/x", "s3://ab", "s3://bucket/a/../b", "s3://bucket//a", "s3://bucket/a b", "pvc://c",
           "pvc://cache/models/x", "pvc://Cache/x", "pvc://c/./x", "/models/x", "/", "/a//b", "/a/..", "/a b",
           "http://x/y", "hf:/a/b", "models/x", "/m@v1"]


@pytest.mark.parametrize("uri", SOURCES)
def test_model_source_rule_agrees_with_the_fetcher_parser(uri):
    """The CRD's CEL rule and `baton.fetch.source.parse_source` (the operator and `baton fetch-model`) accept
    the same sources."""
    from baton.fetch.source import is_valid

    model = {"name": "m", "source": uri}
    if uri.startswith(("hf://", "s3://")):
        model["cache"] = {"emptyDir": {}}
    obj = apply_defaults(openapi_schema(), for_create(isvc_body(model=model)))
    refused = [m for p, m in cel_violations(openapi_schema(), obj) if p == "spec.model"]
    assert (not refused) is is_valid(uri), refused
    assert bool(validate(obj)) is bool(refused)
