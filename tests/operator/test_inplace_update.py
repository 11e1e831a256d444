"""spec.model.updateStrategy InPlace: a new spec.model.source reaches the running engines as a weight
update through the router, with no pod restart; pods started later load the version the others serve.

The spec rule, the pod template (the served version comes from the model ConfigMap, so it does not change
with the source), the weights Job, the reconcile steps against an in-memory API (the Job created, its
success moving the ConfigMap, its failure leaving the old version and saying why) and the Job's last step,
the router call, against a fake router."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from baton.operator import handlers, naming, weights_job
from baton.operator.builders.engine import engine_deployment
from baton.operator.builders.weights import SOURCE_ENV, weights_job as build_weights_job
from baton.operator.naming import Role
from baton.operator.spec import InvalidSpec, parse
from baton_testing.kube.fake_client import LOGGER, FakeClient, memo_for
from baton_testing.kube.objects import isvc_body

OLD, NEW = "hf://Qwen/Qwen3-0.6B@c0ffee", "hf://Qwen/Qwen3-0.6B@beef00"
MODEL = {"name": "qwen", "source": OLD, "cache": {"claimName": "model-cache"}, "updateStrategy": "InPlace",
         "fetch": {"secretName": "hf-token"}}
ROUTER = {"apiKeySecretRef": {"name": "router-key", "key": "key"}}


def body(source: str = OLD, generation: int = 1, **model) -> dict:
    b = isvc_body(model={**MODEL, "source": source, **model}, router=ROUTER)
    b["metadata"]["generation"] = generation
    return b


def conditions(obj: dict) -> dict[str, dict]:
    return {c["type"]: c for c in obj["status"]["conditions"]}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# -- the spec --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", [
    {"name": "m", "source": OLD, "cache": {"emptyDir": {}}, "updateStrategy": "InPlace"},
    {"name": "m", "path": "/models/m", "updateStrategy": "InPlace"},
    {"name": "m", "source": "pvc://models/qwen", "updateStrategy": "InPlace"},
])
def test_in_place_needs_a_fetched_source_in_a_shared_cache_claim(model):
    with pytest.raises(InvalidSpec) as e:
        parse(isvc_body(model=model))
    assert "updateStrategy InPlace" in str(e.value) and "cache.claimName" in str(e.value)
    assert "use updateStrategy Restart" in str(e.value)


def test_restart_is_the_default_and_keeps_the_source_in_the_template():
    isvc = parse(isvc_body(model={k: v for k, v in MODEL.items() if k != "updateStrategy"}))
    assert isvc.spec.model.update_strategy == "Restart" and not isvc.spec.model.in_place
    pod = engine_deployment(isvc, Role.PREFILL)["spec"]["template"]["spec"]
    assert flag(pod["containers"][0]["args"], "--model-path") == "/model-cache/hf/Qwen/Qwen3-0.6B/c0ffee"
    assert flag(pod["initContainers"][0]["args"], "--source") == OLD


# -- the builders ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_the_pod_template_reads_the_served_version_and_does_not_change_with_the_source(role):
    dep = engine_deployment(parse(body()), role)
    pod = dep["spec"]["template"]["spec"]
    engine, [init] = pod["containers"][0], pod["initContainers"]
    assert flag(engine["args"], "--model-path") == "$(BATON_MODEL_PATH)"
    assert flag(engine["args"], "--weight-version") == "$(BATON_WEIGHT_VERSION)"
    cm = naming.model_config("demo")
    env = {e["name"]: e for e in engine["env"]}
    assert env["BATON_MODEL_PATH"]["valueFrom"] == {"configMapKeyRef": {"name": cm, "key": "modelPath"}}
    assert env["BATON_WEIGHT_VERSION"]["valueFrom"] == {"configMapKeyRef": {"name": cm, "key": "weightVersion"}}
    assert flag(init["args"], "--source") == f"$({SOURCE_ENV})"
    assert {e["name"]: e for e in init["env"]}[SOURCE_ENV]["valueFrom"]["configMapKeyRef"]["key"] == "source"
    assert OLD not in json.dumps(dep)
    # a new source: the same Deployment, so no rollout
    assert engine_deployment(parse(body(NEW, generation=2)), role) == dep


def test_the_weights_job_fetches_into_the_shared_cache_then_calls_the_router():
    job = build_weights_job(parse(body(NEW)))
    assert job["kind"] == "Job" and job["metadata"]["name"] == naming.weights_job("demo", NEW)
    assert job["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    [fetch], [update] = pod["initContainers"], pod["containers"]
    # the engine pods' fetch, for the new source, writing the claim the engines mount
    assert fetch["command"] == ["baton", "fetch-model"] and fetch["image"] == "ghcr.io/baton-llm/baton:test"
    assert fetch["args"][:4] == ["--source", NEW, "--cache-dir", "/model-cache"]
    assert fetch["volumeMounts"] == [{"name": "model-cache", "mountPath": "/model-cache"}]
    assert pod["volumes"] == [{"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}}]
    assert fetch["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    # then the router's fleet update, with the router's key, which only this container sees
    assert update["command"] == ["python", "-m", "baton.operator.weights_job"]
    assert flag(update["args"], "--url") == "http://demo-router.default.svc:8000/update_weights_from_disk"
    assert flag(update["args"], "--model-path") == "/model-cache/hf/Qwen/Qwen3-0.6B/beef00"
    assert flag(update["args"], "--weight-version") == NEW
    assert update["env"] == [{"name": "BATON_ROUTER_API_KEY",
                              "valueFrom": {"secretKeyRef": {"name": "router-key", "key": "key"}}}]
    assert "envFrom" not in update and "router-key" not in json.dumps(fetch)


# -- the reconcile steps ---------------------------------------------------------------------------------

def deployments(client: FakeClient) -> dict[str, dict]:
    return {name: o["spec"] for (kind, _, name), o in client.objects.items() if kind == "Deployment"}


def served(client: FakeClient) -> dict[str, str]:
    return client.find("ConfigMap", "default", naming.model_config("demo"))["data"]


async def change_source(client: FakeClient, memo, source: str) -> dict:
    client.put({**client.find("InferenceService", "default", "demo"),
                "spec": body(source)["spec"], "metadata": {**body()["metadata"], "generation": 2}})
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "update")
    return client.find("InferenceService", "default", "demo")


def finish_job(client: FakeClient, source: str, outcome: str) -> dict:
    job = client.find("Job", "default", naming.weights_job("demo", source))
    job["status"] = {"conditions": [{"type": outcome, "status": "True", "reason": "BackoffLimitExceeded",
                                     "message": "Job has reached the specified backoff limit"}]}
    return client.put(job)


async def started(client: FakeClient):
    memo = memo_for(client)
    client.put(body())
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "create")
    return memo


async def test_a_new_service_serves_its_source_from_the_model_config_map():
    client = FakeClient()
    await started(client)
    assert served(client) == {"source": OLD, "modelPath": "/model-cache/hf/Qwen/Qwen3-0.6B/c0ffee",
                              "weightVersion": OLD}
    isvc = client.find("InferenceService", "default", "demo")
    c = conditions(isvc)["WeightsUpdated"]
    assert (c["status"], c["reason"]) == ("True", "Serving")
    assert isvc["status"]["model"] == {"source": OLD, "weightVersion": OLD}
    assert not [k for k in client.objects if k[0] == "Job"]


async def test_a_source_change_runs_the_job_and_its_success_moves_the_served_version():
    client = FakeClient()
    memo = await started(client)
    before = deployments(client)
    isvc = await change_source(client, memo, NEW)
    # the Job fetches and updates; nothing else moved: no pod template changed, the old version serves
    job = client.find("Job", "default", naming.weights_job("demo", NEW))
    assert job is not None and deployments(client) == before
    assert served(client)["source"] == OLD
    c = conditions(isvc)["WeightsUpdated"]
    assert (c["status"], c["reason"]) == ("False", "Updating") and f"serve {OLD} until then" in c["message"]
    assert isvc["status"]["model"]["source"] == OLD
    # the Job succeeded: its event records it at once
    done = finish_job(client, NEW, "Complete")
    await handlers.weights_job_event(event={"type": "MODIFIED", "object": done}, body=done, memo=memo, logger=LOGGER)
    assert served(client) == {"source": NEW, "modelPath": "/model-cache/hf/Qwen/Qwen3-0.6B/beef00",
                              "weightVersion": NEW}
    isvc = client.find("InferenceService", "default", "demo")
    c = conditions(isvc)["WeightsUpdated"]
    assert (c["status"], c["reason"]) == ("True", "Updated") and NEW in c["message"]
    assert isvc["status"]["model"] == {"source": NEW, "weightVersion": NEW}
    assert deployments(client) == before
    assert client.find("Job", "default", naming.weights_job("demo", NEW)) is None  # one Job, one update
    # a status refresh between reconciles keeps it
    dep = client.find("Deployment", "default", "demo-prefill")
    await handlers.child_deployment_event(event={"type": "MODIFIED", "object": dep}, body=dep, memo=memo,
                                          logger=LOGGER)
    assert conditions(client.find("InferenceService", "default", "demo"))["WeightsUpdated"]["reason"] == "Updated"


async def test_a_failed_job_leaves_the_old_version_and_says_why():
    client = FakeClient()
    memo = await started(client)
    await change_source(client, memo, NEW)
    finish_job(client, NEW, "Failed")
    client.put({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "demo-weights-x", "namespace": "default", "creationTimestamp": "2026-01-01T00:00:00Z",
        "labels": {"job-name": naming.weights_job("demo", NEW)}},
        "status": {"containerStatuses": [{"name": "update-weights", "state": {"terminated": {
            "exitCode": 1, "message": "the router answered 502: update_weights_from_disk failed on 1 of 2 "
                                      "workers: decode http://d0:30000: 400: shape mismatch"}}}]}})
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "resync")
    isvc = client.find("InferenceService", "default", "demo")
    c = conditions(isvc)["WeightsUpdated"]
    assert (c["status"], c["reason"]) == ("False", "UpdateFailed")
    assert "update-weights: the router answered 502" in c["message"] and "shape mismatch" in c["message"]
    assert f"the engines still serve {OLD}" in c["message"]
    assert served(client)["source"] == OLD and isvc["status"]["model"]["source"] == OLD
    # a failed Job stays (its logs): setting the source back serves the old version again
    isvc = await change_source(client, memo, OLD)
    assert conditions(isvc)["WeightsUpdated"]["reason"] == "Serving"


async def test_a_fetch_failure_without_a_message_names_the_jobs_condition():
    client = FakeClient()
    memo = await started(client)
    await change_source(client, memo, NEW)
    finish_job(client, NEW, "Failed")
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "resync")
    c = conditions(client.find("InferenceService", "default", "demo"))["WeightsUpdated"]
    assert c["reason"] == "UpdateFailed" and "BackoffLimitExceeded" in c["message"]


async def test_switching_back_to_restart_prunes_the_model_config_map():
    client = FakeClient()
    memo = await started(client)
    b = client.find("InferenceService", "default", "demo")
    b["spec"]["model"]["updateStrategy"] = "Restart"
    client.put(b)
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "update")
    assert client.find("ConfigMap", "default", naming.model_config("demo")) is None
    isvc = client.find("InferenceService", "default", "demo")
    assert "WeightsUpdated" not in conditions(isvc) and "model" not in isvc["status"]


# -- the Job's router call -------------------------------------------------------------------------------

class FakeRouter(BaseHTTPRequestHandler):
    answer: tuple[int, dict] = (200, {"success": True, "message": "updated 2 workers"})
    calls: list[tuple[str, dict, str | None]] = []

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).calls.append((self.path, json.loads(raw), self.headers.get("Authorization")))
        status, payload = self.answer
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def router():
    FakeRouter.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeRouter)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/update_weights_from_disk"
    server.shutdown()
    server.server_close()


def test_the_job_posts_the_update_to_the_router_with_its_key(router, monkeypatch, tmp_path: Path):
    monkeypatch.setenv("BATON_ROUTER_API_KEY", "sk-router")
    FakeRouter.answer = (200, {"success": True, "message": "updated 2 workers"})
    rc = weights_job.main(["--url", router, "--model-path", "/model-cache/hf/Qwen/Qwen3-0.6B/beef00",
                           "--weight-version", NEW, "--termination-log", str(tmp_path / "log")])
    assert rc == 0
    assert FakeRouter.calls == [("/update_weights_from_disk",
                                 {"model_path": "/model-cache/hf/Qwen/Qwen3-0.6B/beef00", "weight_version": NEW},
                                 "Bearer sk-router")]
    assert not (tmp_path / "log").exists()


def test_a_refused_update_fails_the_job_with_the_routers_reason(router, monkeypatch, tmp_path: Path):
    monkeypatch.delenv("BATON_ROUTER_API_KEY", raising=False)
    FakeRouter.answer = (502, {"success": False, "message": "update_weights_from_disk failed on 1 of 2 workers"})
    rc = weights_job.main(["--url", router, "--model-path", "/m", "--weight-version", "v2",
                           "--termination-log", str(tmp_path / "log")])
    assert rc == 1 and FakeRouter.calls[0][2] is None
    said = (tmp_path / "log").read_text()
    assert said == "updating the weights to v2 failed: the router answered 502: update_weights_from_disk failed " \
                   "on 1 of 2 workers"


def test_an_unreachable_router_is_a_failure():
    ok, said = weights_job.update("http://127.0.0.1:9/update_weights_from_disk", "/m", "v2", timeout=5)
    assert not ok and said.startswith("cannot reach the router at http://127.0.0.1:9")
