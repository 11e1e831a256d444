"""Wrong InferenceServices are refused by the real API server, with the CRD's own messages: every CEL
rule of `baton.operator.validation` and some OpenAPI schema checks (enum, required, bounds, pattern)."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from e2e_support import create_namespace, get_or_none

from baton_testing.kube.controlplane import ControlPlane
from baton.operator.validation import RULES, Scope, rules_for

NS = "e2e-invalid"
BASE = {"apiVersion": "baton.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "bad", "namespace": NS},
        "spec": {"image": "ghcr.io/baton-llm/baton:test", "model": {"name": "m", "path": "/models/m"}}}


def body(name: str = "bad", **spec: Any) -> dict[str, Any]:
    out = copy.deepcopy(BASE)
    out["metadata"]["name"] = name
    out["spec"].update(spec)
    return out


# One violation per CEL rule, in the order of validation.RULES.
CEL_CASES = [
    body(name="a" * 46),
    body(name="9lives"),
    body(mode="colocated", prefill={"replicas": 1}),
    body(model={"name": "m", "path": "/m", "pvc": {"claimName": "c"}, "hostPath": {"path": "/data"}}),
    body(model={"name": "m", "path": "/m", "hostPath": {"path": "/"}}),
    body(model={"name": "m"}),
    body(model={"name": "m", "source": "hf://only-a-name", "cache": {"claimName": "c"}}),
    body(model={"name": "m", "source": "pvc://c/x", "pvc": {"claimName": "c"}}),
    body(model={"name": "m", "source": "hf://a/b", "path": "/m", "cache": {"claimName": "c"}}),
    body(model={"name": "m", "source": "s3://bucket/x"}),
    body(model={"name": "m", "path": "/m", "cache": {"claimName": "c"}}),
    body(model={"name": "m", "path": "/m", "updateStrategy": "InPlace"}),
    body(model={"name": "m", "source": "hf://a/b", "cache": {"claimName": "c", "emptyDir": {}}}),
    body(decode={"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}),
    body(prefill={"env": [{"name": "BATON_API_KEY", "value": ""}]}),
    body(prefill={"dp": 2, "gpus": 1}),
    body(prefill={"tp": 2, "gpus": 2}, decode={"tp": 3, "gpus": 3}),
    body(decode={"extraArgs": ["--enable-mixed-chunk"]}),
    body(replicas=2),
    body(autoscaling={"mode": "planner", "engine": {"targetKVUsage": 0.7}}),
    body(decode={"extraArgs": ["--port=1"]}),
    body(router={"extraArgs": ["--policy", "random"]}),
    body(decode={"extraArgs": ["--kv-cache-dtyp", "fp8_e5m2"]}),  # an abbreviation argparse would have taken
    body(router={"extraArgs": ["--no-such-flag=1"]}),
    body(kvTransfer={"protocol": "tcp", "ibDevices": ["mlx5_0"]}),
    body(kvTransfer={"protocol": "tcp", "rdmaResourceName": "rdma/hca"}),
    body(autoscaling={"mode": "planner", "prefillDecodeRatio": {"min": 2, "max": 1}}),
    body(autoscaling={"mode": "planner", "decode": {"minReplicas": 5, "targetKVUsage": 0.7}}),
    body(autoscaling={"mode": "planner", "decode": {"maxReplicas": 2}}),
]
SCHEMA_CASES = [
    (body(mode="both"), 'spec.mode: Unsupported value: "both"'),
    ({**body(), "spec": {"image": "x"}}, "spec.model: Required value"),
    (body(prefill={"replicas": -1}), "spec.prefill.replicas: Invalid value: -1"),
    (body(model={"name": "m", "path": "relative/path"}), "spec.model.path: Invalid value"),
    (body(model={"name": "m", "path": "/m", "kvCacheDtype": "fp8_e4m3"}),
     'spec.model.kvCacheDtype: Unsupported value: "fp8_e4m3"'),
]


@pytest.fixture(scope="module")
def namespace(control_plane: ControlPlane, operator) -> str:
    return create_namespace(control_plane, NS)


def refused(cp: ControlPlane, obj: dict[str, Any]) -> str:
    """`kubectl apply` of `obj`: must fail (exit 1) with an Invalid error and create nothing."""
    result = cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj), check=False)
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert f'The InferenceService "{obj["metadata"]["name"]}" is invalid' in result.stderr, result.stderr
    assert get_or_none(cp, "inferenceservice", obj["metadata"]["name"], "-n", NS) is None
    return result.stderr


def test_there_is_one_case_per_rule():
    assert len(CEL_CASES) == len(RULES)


@pytest.mark.parametrize(("index", "obj"), list(enumerate(CEL_CASES)), ids=[r.scope.value + str(i) for i, r in enumerate(RULES)])
def test_cel_rules_are_enforced_with_their_message(control_plane: ControlPlane, namespace: str, index: int,
                                                   obj: dict[str, Any]):
    stderr = refused(control_plane, obj)
    assert RULES[index].message in stderr, stderr


@pytest.mark.parametrize(("obj", "message"), SCHEMA_CASES, ids=["enum", "required", "minimum", "pattern", "kv-cache-dtype"])
def test_schema_is_enforced(control_plane: ControlPlane, namespace: str, obj: dict[str, Any], message: str):
    stderr = refused(control_plane, obj)
    assert message in stderr, stderr


def test_per_role_dtype_flags_are_refused(control_plane: ControlPlane, namespace: str):
    """A prefill and a decode pool of different dtypes cannot pair: the dtypes are spec.model fields."""
    for args in (["--kv-cache-dtype", "fp8_e5m2"], ["--dtype=bfloat16"]):
        stderr = refused(control_plane, body(decode={"extraArgs": args}))
        assert "spec.model.kvCacheDtype" in stderr, stderr


def test_a_valid_spec_is_accepted(control_plane: ControlPlane, namespace: str):
    """The cases above differ from this one only in the broken field."""
    result = control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(body()))
    assert "inferenceservice.baton.dev/bad created (server dry run)" in result.stdout


def test_tensor_parallelism_is_accepted_when_one_size_divides_the_other(control_plane: ControlPlane,
                                                                        namespace: str):
    """A decode TP rank takes its KV heads from whichever prefill TP ranks hold them: equal sizes and
    sizes that divide one another apply; others are refused with the rule's message."""
    for ok in (body(mode="colocated", engine={"tp": 2, "gpus": 2}),
               body(prefill={"tp": 2, "gpus": 2}, decode={"tp": 2, "gpus": 2}),
               body(prefill={"tp": 2, "gpus": 2}), body(prefill={"tp": 2, "gpus": 2}, decode={"tp": 4, "gpus": 4})):
        result = control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(ok))
        assert "inferenceservice.baton.dev/bad created (server dry run)" in result.stdout
    [tp_rule] = [r for r in rules_for(Scope.SPEC) if "tp must divide one another" in r.message]
    stderr = refused(control_plane, body(prefill={"tp": 2, "gpus": 2}, decode={"tp": 3, "gpus": 3}))
    assert tp_rule.message in stderr, stderr