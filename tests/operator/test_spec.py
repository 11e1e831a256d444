"""Parsing and defaulting of the InferenceService spec; semantic rules in Python."""
from __future__ import annotations

import pytest
from baton.operator.naming import Role
from baton.operator.spec import InvalidSpec, Mode, parse
from baton_testing.kube.objects import isvc_body
from baton.operator.validation import Scope, rules_for


def test_defaults_fill_an_omitted_role_and_every_section():
    isvc = parse(isvc_body())
    spec = isvc.spec
    assert spec.mode is Mode.DISAGGREGATED
    assert set(spec.roles) == {Role.PREFILL, Role.DECODE}
    assert spec.roles[Role.PREFILL].replicas == 1 and spec.roles[Role.DECODE].device == "cpu"
    assert spec.kv_transfer.protocol == "tcp" and spec.kv_transfer.bootstrap_port == 8998
    assert spec.router.service_port == 8000 and spec.router.prefill_policy == "cache_aware"
    assert spec.pod_security.run_as_non_root and spec.image_pull_policy == "IfNotPresent"


def test_colocated_mode_has_one_engine_role():
    isvc = parse(isvc_body(mode="colocated", engine={"replicas": 3}))
    assert list(isvc.spec.roles) == [Role.COLOCATED]
    assert isvc.spec.roles[Role.COLOCATED].replicas == 3


def test_tensor_parallelism_on_every_role_with_prefill_and_decode_sizes_that_divide_one_another():
    r = parse(isvc_body(mode="colocated", engine={"tp": 4, "dp": 2, "gpus": 8})).spec.roles[Role.COLOCATED]
    assert (r.tp, r.dp, r.ranks, r.device) == (4, 2, 8, "cuda")
    with pytest.raises(InvalidSpec) as info:  # gpus == tp * dp still holds
        parse(isvc_body(mode="colocated", engine={"tp": 2, "gpus": 1}))
    assert [e.split(":")[0] for e in info.value.errors] == ["spec.engine"]
    roles = parse(isvc_body(prefill={"tp": 2, "gpus": 2}, decode={"tp": 2, "dp": 2, "gpus": 4})).spec.roles
    assert [(roles[role].tp, roles[role].ranks) for role in (Role.PREFILL, Role.DECODE)] == [(2, 2), (2, 4)]
    roles = parse(isvc_body(prefill={"tp": 1}, decode={"tp": 4, "gpus": 4})).spec.roles
    assert [roles[role].tp for role in (Role.PREFILL, Role.DECODE)] == [1, 4]
    [tp_rule] = [r for r in rules_for(Scope.SPEC) if "tp must divide one another" in r.message]
    with pytest.raises(InvalidSpec) as info:
        parse(isvc_body(prefill={"tp": 2, "gpus": 2}, decode={"tp": 3, "gpus": 3}))
    assert info.value.errors == [f"spec: {tp_rule.message}"]


@pytest.mark.parametrize("spec, fragment", [
    ({"mode": "colocated", "prefill": {}}, "mode colocated runs spec.engine only"),
    ({"engine": {}}, "remove spec.engine"),
    ({"prefill": {"dp": 2, "gpus": 1}}, "gpus must be 0 (run on CPU) or equal tp * dp"),
    ({"prefill": {"tp": 2}, "decode": {"tp": 3}}, "spec.prefill.tp and spec.decode.tp must divide one another"),
    ({"prefill": {"tp": 6}, "decode": {"tp": 4}}, "from the prefill TP ranks that hold them"),
    ({"decode": {"extraArgs": ["--port", "1"]}}, "extraArgs must not set flags the operator manages"),
    ({"prefill": {"extraArgs": ["--enable-mixed-chunk"]}}, "not in spec.prefill or spec.decode"),
    ({"router": {"extraArgs": ["--prefill-policy=random"]}}, "router.extraArgs must not set flags"),
    ({"kvTransfer": {"ibDevices": ["mlx5_0"]}}, "ibDevices is only used with protocol: rdma"),
    ({"kvTransfer": {"rdmaResourceName": "rdma/x"}}, "rdmaResourceName is only used with protocol: rdma"),
    ({"model": {"name": "m", "path": "/m", "pvc": {"claimName": "c"}, "hostPath": {"path": "/x"}}},
     "at most one of spec.model.pvc and spec.model.hostPath"),
])
def test_invalid_specs_are_refused_with_a_message_saying_what_to_change(spec, fragment):
    with pytest.raises(InvalidSpec) as info:
        parse(isvc_body(**spec))
    assert any(fragment in e for e in info.value.errors), info.value.errors


def test_missing_required_fields_and_bad_name():
    body = isvc_body(name="x" * 50)
    del body["spec"]["image"]
    with pytest.raises(InvalidSpec) as info:
        parse(body)
    assert "spec.image: required" in info.value.errors
    body = isvc_body(name="Bad_Name")
    with pytest.raises(InvalidSpec) as info:
        parse(body)
    assert any("DNS-1035" in e for e in info.value.errors)
    body = isvc_body(name="a" * 46)
    with pytest.raises(InvalidSpec) as info:
        parse(body)
    assert any("at most 45 characters" in e for e in info.value.errors)


def test_parse_does_not_modify_its_input():
    body = isvc_body()
    before = repr(body)
    parse(body)
    assert repr(body) == before
