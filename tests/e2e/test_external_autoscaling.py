"""spec.autoscaling.mode external on the real control plane: a decode Deployment scaled through its scale
subresource (what an HPA or KEDA does) keeps its replicas through a spec change the operator applies, and
the status counts them; back in static mode the spec's count returns."""
from __future__ import annotations

import json

from e2e_support import create_namespace, get_json, isvc_condition, sample, wait_for

from baton_testing.kube.controlplane import ControlPlane

NS = "e2e-autoscaling"
NAME = "smollm2"


def decode(cp: ControlPlane) -> dict:
    return get_json(cp, "deployment", f"{NAME}-decode", "-n", NS)


def test_the_autoscaler_owns_engine_replicas(control_plane: ControlPlane, operator):
    create_namespace(control_plane, NS)
    control_plane.apply([sample("cpu-smollm2.yaml", NS, autoscaling={"mode": "external"})])
    isvc_condition(control_plane, NS, NAME, "Ready", "True", timeout=120)
    assert decode(control_plane)["metadata"]["annotations"]["baton.dev/replicas"] == "external"

    control_plane.kubectl("scale", "deployment", f"{NAME}-decode", "-n", NS, "--replicas=3")  # as an HPA does
    patch = {"spec": {"decode": {"replicas": 1, "extraArgs": ["--max-running-requests", "8"]}}}
    control_plane.kubectl("patch", "inferenceservice", NAME, "-n", NS, "--type", "merge", "-p", json.dumps(patch))
    wait_for(lambda: decode(control_plane)["spec"]["template"]["spec"]["containers"][0]["args"][-1] == "8",
             "the spec change applied to the decode Deployment")
    assert decode(control_plane)["spec"]["replicas"] == 3
    wait_for(lambda: get_json(control_plane, "inferenceservice", NAME, "-n", NS)["status"]["decode"]["summary"] == "3/3",
             "the status counting the autoscaler's 3 decode pods")

    control_plane.kubectl("patch", "inferenceservice", NAME, "-n", NS, "--type", "merge",
                          "-p", json.dumps({"spec": {"autoscaling": {"mode": "static"}}}))
    wait_for(lambda: decode(control_plane)["spec"]["replicas"] == 1, "spec.decode.replicas applied again")
    assert "baton.dev/replicas" not in (decode(control_plane)["metadata"].get("annotations") or {})
    control_plane.kubectl("delete", "inferenceservice", NAME, "-n", NS, "--wait=false")
