"""spec.autoscaling.mode planner on the real control plane, scraping real engines: a prefill and a decode
`baton serve` (tiny model, CPU, real Mooncake TCP) run on 127.0.0.1, and the planner reads their own
/metrics for the kwok pods of the service (kwok pods run no process, so the operator's metrics_url maps
the first decode pod and every prefill pod to those engines; a pod it cannot read counts as no sample,
as a starting pod does). A load step fills the decode's KV pool: the planner adds a decode pod; a quiet
period removes it after the scale-down window. The status and Events say why each time. `kubectl scale`
of the InferenceService is refused with per-role advice (the CRD's scale subresource and a CEL rule)."""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from e2e_support import create_namespace, get_json, wait_for

from baton.engine.bench.launcher import EngineProcess, engine_command, free_port
from baton.operator.config import OperatorConfig
from baton.operator.validation import RULES
from baton_testing.kube.cluster import real_cluster
from baton_testing.kube.controlplane import ControlPlane
from baton_testing.kube.runner import run_operator

NS = "planner-e2e"  # not one the package's operator process watches
NAME = "planned"
STARTUP_S = 300
COMMON = ["--disaggregation-transfer-backend", "mooncake", "--disaggregation-protocol", "tcp",
          "--page-size", "4", "--max-total-tokens", "1024"]


def service() -> dict:
    return {"apiVersion": "baton.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": NAME, "namespace": NS},
            "spec": {"image": "ghcr.io/baton-llm/baton:test", "model": {"name": "m", "path": "/models/m"},
                     "autoscaling": {"mode": "planner", "intervalSeconds": 1, "windowSeconds": 3,
                                     "scaleDownStabilizationSeconds": 8,
                                     "prefill": {"maxReplicas": 1, "targetQueuedTokens": 100000},
                                     "decode": {"maxReplicas": 2, "targetKVUsage": 0.15}}}}


class EngineMap:
    """metrics_url for kwok pods: prefill pods -> the prefill engine, the first decode pod -> the decode engine."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.urls = {"prefill": prefill + "/metrics", "decode": decode + "/metrics"}
        self.first_decode: str | None = None

    def __call__(self, pod: dict) -> str | None:
        role, name = pod["metadata"]["labels"]["baton.dev/role"], pod["metadata"]["name"]
        if role == "decode":
            self.first_decode = self.first_decode or name
            return self.urls["decode"] if name == self.first_decode else None
        return self.urls.get(role)


async def _pd_request(client: httpx.AsyncClient, prefill: str, bootstrap: int, decode: str, i: int) -> int:
    body = {"input_ids": [(7 * i + j) % 300 + 6 for j in range(40)], "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap, "bootstrap_room": random.randrange(1 << 63),
            "sampling_params": {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}}
    _, d = await asyncio.gather(client.post(f"{prefill}/generate", json=body), client.post(f"{decode}/generate", json=body))
    return d.status_code


def decode_replicas(cp: ControlPlane) -> int:
    return get_json(cp, "deployment", f"{NAME}-decode", "-n", NS)["spec"]["replicas"]


def events(cp: ControlPlane) -> dict[str, list[str]]:
    items = get_json(cp, "events", "-n", NS, "--field-selector", f"involvedObject.name={NAME}")["items"]
    out: dict[str, list[str]] = {}
    for e in items:
        out.setdefault(e["reason"], []).append(e["message"])
    return out


@pytest.fixture(scope="module")
def engines(tiny_model_factory):
    model = tiny_model_factory("llama")
    bootstrap, p_port, d_port = free_port(), free_port(), free_port()
    prefill = EngineProcess(engine_command(model, p_port, ["--disaggregation-mode", "prefill",
                                                           "--disaggregation-bootstrap-port", str(bootstrap), *COMMON]), p_port)
    decode = EngineProcess(engine_command(model, d_port, ["--disaggregation-mode", "decode", *COMMON]), d_port)
    with prefill, decode:
        prefill.wait_healthy(STARTUP_S)
        decode.wait_healthy(STARTUP_S)
        yield prefill, bootstrap, decode


async def test_a_load_step_adds_a_decode_pod_and_a_quiet_period_removes_it(control_plane: ControlPlane,
                                                                            installed: str, engines):
    prefill, bootstrap, decode = engines
    create_namespace(control_plane, NS)
    operator_kubeconfig = control_plane.service_account_kubeconfig("baton-system", "baton-operator")
    config = OperatorConfig(resync_seconds=30, retry_seconds=0.5, metrics_port=None,
                            metrics_url=EngineMap(prefill.base_url, decode.base_url))
    async with real_cluster(control_plane.kubeconfig, operator_kubeconfig, (NS,)) as cluster, \
            run_operator(cluster, config):
        control_plane.apply([service()])
        await asyncio.to_thread(wait_for, lambda: get_json(control_plane, "inferenceservice", NAME, "-n", NS)
                                .get("status", {}).get("autoscaling", {}).get("decode"), "a first planner decision")
        assert decode_replicas(control_plane) == 1

        # kubectl scale of the InferenceService: refused, saying which fields scale what
        scaled = control_plane.kubectl("scale", "inferenceservice", NAME, "-n", NS, "--replicas=3", check=False)
        [scale_rule] = [r for r in RULES if "kubectl scale does not apply" in r.message]
        assert scaled.returncode != 0 and "spec.decode.replicas" in scaled.stderr, scaled.stderr
        assert scale_rule.message.split(":")[0] in scaled.stderr

        async with httpx.AsyncClient(timeout=120) as client:
            statuses: list[int] = []

            async def load() -> None:  # 6 long generations at a time until the planner answers
                i = 0
                while decode_replicas(control_plane) < 2:
                    statuses.extend(await asyncio.gather(*(_pd_request(client, prefill.base_url, bootstrap,
                                                                       decode.base_url, i + k) for k in range(6))))
                    i += 6
            await asyncio.wait_for(load(), 240)
        assert statuses and set(statuses) == {200}
        up = get_json(control_plane, "inferenceservice", NAME, "-n", NS)["status"]["autoscaling"]["decode"]
        # the status holds the latest decision (it may already say why 2 stays); the Event says why it changed
        assert up["replicas"] == 2 and "lastScaleTime" in up and "KV usage" in up["reason"], up
        assert up["observed"]["kvUsage"] > 0

        await asyncio.to_thread(wait_for, lambda: decode_replicas(control_plane) == 1, "the quiet period's scale-down", 120)
        down = get_json(control_plane, "inferenceservice", NAME, "-n", NS)["status"]["autoscaling"]["decode"]
        assert down["replicas"] == 1 and "< target 0.15" in down["reason"], down
        said = await asyncio.to_thread(wait_for, lambda: (lambda e: e if "ScaledDown" in e else None)(events(control_plane)),
                                       "the ScaledUp and ScaledDown Events")
        assert any("decode 1 -> 2: KV usage" in m for m in said["ScaledUp"]), said
        assert any("decode 2 -> 1" in m and "< target 0.15 for 8s" in m for m in said["ScaledDown"]), said
        assert json.dumps(said).count("prefill 1 ->") == 0  # the prefill had no queue: never scaled
    control_plane.kubectl("delete", "inferenceservice", NAME, "-n", NS, "--wait=false")
