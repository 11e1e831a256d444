"""The InferenceService CustomResourceDefinition, built as a dict (the single source of truth).

`manifests/01-crd.yaml` and `charts/baton/crds/` are generated from `build_crd()` by
`python -m baton.operator.install --write` and a test keeps them in sync. The schema carries the
defaults the operator relies on (`baton.operator.defaults` applies the same ones), enums, bounds and
the CEL rules from `baton.operator.validation`.
"""
from __future__ import annotations

from typing import Any

from baton.fetch.source import SOURCE_PATTERN
from baton.operator import naming
from baton.operator.validation import Scope, rules_for

ROUTER_POLICIES = ["random", "round_robin", "cache_aware", "power_of_two"]
AUTOSCALING_MODES = ("static", "external", "planner")
_QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
             "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"}
_FREE_OBJECT = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


# The engine's --dtype and --kv-cache-dtype choices (the operator does not import the engine;
# tests/operator/test_crd.py checks these agree with baton.engine.server_args).
MODEL_DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e5m2")
# --tool-call-parser / --reasoning-parser choices (baton.engine.parsers; the same check)
TOOL_CALL_PARSERS = ("qwen25", "qwen", "hermes", "llama3", "mistral", "pythonic")
REASONING_PARSERS = ("qwen3", "deepseek-r1")


def _str(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "description": desc, **kw}


def _int(desc: str, minimum: int, maximum: int, default: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "integer", "description": desc, "minimum": minimum, "maximum": maximum}
    if default is not None:
        out["default"] = default
    return out


def _bool(desc: str, default: bool) -> dict[str, Any]:
    return {"type": "boolean", "description": desc, "default": default}


def _validations(scope: Scope) -> list[dict[str, str]]:
    return [{"rule": r.cel, "message": r.message} for r in rules_for(scope)]


def _obj(desc: str, props: dict[str, Any], required: tuple[str, ...] = (),
         scope: Scope | None = None, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "description": desc, "properties": props, **kw}
    if required:
        out["required"] = list(required)
    if scope is not None:
        out["x-kubernetes-validations"] = _validations(scope)
    return out


def _list(desc: str, items: dict[str, Any], max_items: int, scope: Scope | None = None,
          **kw: Any) -> dict[str, Any]:
    out = {"type": "array", "description": desc, "items": items, "maxItems": max_items, **kw}
    if scope is not None:
        out["x-kubernetes-validations"] = _validations(scope)
    return out


def _string_map(desc: str) -> dict[str, Any]:
    return {"type": "object", "description": desc, "additionalProperties": {"type": "string"}}


def _resources() -> dict[str, Any]:
    quantities = {"type": "object", "additionalProperties": _QUANTITY}
    return _obj("Kubernetes resource requests/limits of the container (GPUs: use `gpus`).",
                {"requests": quantities, "limits": quantities})


def _env() -> dict[str, Any]:
    free = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    value_from = {**free, "properties": {"secretKeyRef": free}}  # declared: CEL sees declared fields only
    item = {"type": "object", "required": ["name"], "x-kubernetes-preserve-unknown-fields": True,
            "properties": {"name": {"type": "string", "maxLength": 256}, "value": {"type": "string"},
                           "valueFrom": value_from},
            "x-kubernetes-validations": _validations(Scope.ENV_VAR)}
    return _list("Extra environment variables (Kubernetes EnvVar objects).", item, 64)


def _disruption_budget(what: str) -> dict[str, Any]:
    # minimum applies to a number, pattern to a string (inside anyOf the API server allows only types)
    count = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
             "minimum": 0, "pattern": r"^[0-9]+%$", "default": 1,
             "description": f"{what} pods a voluntary eviction (kubectl drain, a node upgrade) may take at "
                            "once: a count or a percentage; 0 blocks drains."}
    return _obj(f"The PodDisruptionBudget of the {what} pods (pods that are not Ready never block a drain).",
                {"maxUnavailable": count}, default={})


def _placement() -> dict[str, Any]:
    return {
        "nodeSelector": _string_map("Node labels the pods must run on."),
        "tolerations": _list("Kubernetes tolerations of the pods.", _FREE_OBJECT, 32),
        "affinity": {**_FREE_OBJECT, "description": "Kubernetes affinity of the pods."},
        "topologySpreadConstraints": _list(
            "Kubernetes topology spread constraints of the pods. Unset: spread over nodes (maxSkew 1 on "
            "kubernetes.io/hostname, ScheduleAnyway), so a node drain takes few pods of the role; [] for none.",
            _FREE_OBJECT, 8),
    }


def _rolling_update(what: str) -> dict[str, Any]:
    count = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True,
             "minimum": 0, "pattern": r"^[0-9]+%$"}
    return _obj(f"How a spec change replaces the {what} pods. The default starts a new pod and waits until "
                "it is Ready before an old one goes (the service keeps answering); where no spare GPU is free "
                "for that pod, set maxSurge 0 and maxUnavailable 1 (one pod at a time is replaced in place).", {
        "maxSurge": {**count, "default": 1, "description": "Pods over replicas during a rollout."},
        "maxUnavailable": {**count, "default": 0, "description": "Pods below replicas during a rollout."},
    }, default={})


def role_schema(what: str) -> dict[str, Any]:
    """Schema of one engine role; `what` is prefill, decode or colocated."""
    args = _list(f"Extra `baton serve` arguments of {what} pods.", _str("", maxLength=256), 64,
                 scope=Scope.ENGINE_ARGS, default=[])
    return _obj(f"{what.capitalize()} engine pods: one pod runs one `baton serve` with tp*dp ranks.", {
        "replicas": _int("Number of engine pods.", 0, 1024, 1),
        "tp": _int("Tensor-parallel size (--tp-size): GPUs one model replica is sharded over. Prefill and "
                   "decode may differ when one divides the other (each decode TP rank receives its KV heads "
                   "from the prefill TP ranks that hold them).",
                   1, 64, 1),
        "dp": _int("Data-parallel size (--dp-size): model replicas in the pod, tp GPUs each.", 1, 64, 1),
        "gpus": _int("GPUs per pod: 0 runs on CPU, otherwise tp*dp.", 0, 64, 0),
        "gpuResourceName": _str("Extended resource of one GPU.", default="nvidia.com/gpu", maxLength=253),
        "shmSize": {**_QUANTITY, "description": "Size of the /dev/shm memory volume that pods with more than "
                                                "one rank (tp*dp > 1) get for NCCL, gloo and the CPU TP all-reduce "
                                                "(unset: no limit); set, every pod of the role gets the volume."},
        "terminationGracePeriodSeconds": _int(
            "Seconds a stopping pod gets to finish the requests it runs (it accepts no new ones) before it "
            "is killed; raise it for long generations.", 0, 86400, 60),
        "resources": _resources(), "extraArgs": args, "env": _env(), **_placement(),
        "disruptionBudget": _disruption_budget(what), "rollingUpdate": _rolling_update(what),
    }, scope=Scope.ROLE)


def _number(desc: str, minimum: float, maximum: float, default: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "number", "description": desc, "minimum": minimum, "maximum": maximum}
    if default is not None:
        out["default"] = default
    return out


def _planner_role(what: str) -> dict[str, Any]:
    return _obj(f"How the planner scales the {what} pods (a role left out keeps spec.<role>.replicas). "
                "Set at least one target; the role gets as many pods as the target that needs most asks for.", {
        "minReplicas": _int("Fewest pods.", 1, 1024, 1),
        "maxReplicas": _int("Most pods.", 1, 1024, 4),
        "targetQueuedTokens": _number("Prompt tokens waiting per pod (baton_num_queued_tokens): prefill work "
                                      "queued. A prefill signal.", 1, 1e9),
        "targetTTFTSeconds": _number("Mean time to first token of the window's requests. A prefill signal.",
                                     0.001, 3600),
        "targetKVUsage": _number("Mean fraction of the KV pool in use (baton_token_usage), 0-1. A decode signal.",
                                 0.01, 1),
        "targetITLSeconds": _number("Mean inter-token latency of the window's tokens. A decode signal.",
                                    0.0001, 60),
    }, scope=Scope.AUTOSCALING_ROLE)


def _autoscaling() -> dict[str, Any]:
    return _obj("Who sets the engine Deployments' replicas.", {
        "mode": {"type": "string", "enum": list(AUTOSCALING_MODES), "default": "static",
                 "description": "static: the operator keeps each engine Deployment at spec.<role>.replicas. "
                                "external: an HPA or KEDA scales the engine Deployments (<name>-prefill, "
                                "-decode or -engine, through their scale subresource); the operator sets "
                                "replicas only when it creates one (spec.<role>.replicas is the initial "
                                "count) and never resets them. planner: the operator's planner scales the "
                                "roles listed here from the engines' own metrics (it scrapes the pods' "
                                "/metrics), keeping prefillDecodeRatio. The router keeps router.replicas."},
        "intervalSeconds": _int("planner: seconds between two scrapes and decisions.", 1, 600, 15),
        "windowSeconds": _int("planner: the metrics are averaged over this much of the recent past.", 1, 3600, 60),
        "scaleUpStabilizationSeconds": _int(
            "planner: a role grows to the lowest recommendation of this window (0: at once).", 0, 3600, 0),
        "scaleDownStabilizationSeconds": _int(
            "planner: a role shrinks to the highest recommendation of this window, so a burst that passes "
            "does not cost a pod that took minutes to load.", 0, 86400, 300),
        "prefillDecodeRatio": _obj("planner: bounds of prefill pods / decode pods; the short side is raised.", {
            "min": _number("Fewest prefill pods per decode pod.", 0, 1024),
            "max": _number("Most prefill pods per decode pod.", 0.001, 1024),
        }),
        "prefill": _planner_role("prefill"), "decode": _planner_role("decode"),
        "engine": _planner_role("colocated engine"),
    }, scope=Scope.AUTOSCALING, default={})


def _model() -> dict[str, Any]:
    pvc = _obj("Mount this PersistentVolumeClaim (read-only) at `path`.", {
        "claimName": _str("Claim name.", minLength=1, maxLength=253),
        "subPath": _str("Folder inside the volume holding the model.", maxLength=1024),
    }, required=("claimName",))
    host = _obj("Mount this node folder (read-only) at `path`.", {
        "path": _str("Absolute folder on the node.", pattern="^/", maxLength=1024),
    }, required=("path",))
    fetch = _obj("How the init container fetches an hf:// or s3:// source.", {
        "endpoint": _str("The Hub (HF_ENDPOINT, default https://huggingface.co) or S3 endpoint "
                         "(AWS_ENDPOINT_URL, default https://s3.<region>.amazonaws.com).",
                         pattern="^https?://[^\\s]+$", maxLength=512),
        "region": _str("S3 region (AWS_REGION, default us-east-1).", pattern="^[a-z0-9-]+$", maxLength=64),
        "secretName": _str("Secret whose keys become the fetch container's environment (only it sees them): "
                           "HF_TOKEN for hf://; AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and "
                           "AWS_SESSION_TOKEN) for s3://.", minLength=1, maxLength=253,
                           pattern=naming.DNS_SUBDOMAIN_PATTERN),
        "include": _list("Glob patterns of the files to fetch, e.g. ['*.json', '*.safetensors'] (default: all).",
                         _str("", minLength=1, maxLength=256), 32),
    })
    cache = _obj("The volume an hf:// or s3:// source is fetched into (read-only for the engines); exactly one "
                 "of claimName and emptyDir.", {
        "claimName": _str("A PersistentVolumeClaim the service's pods share (ReadWriteMany when they run on "
                          "several nodes): fetched once, kept across restarts and rollouts.",
                          minLength=1, maxLength=253, pattern=naming.DNS_SUBDOMAIN_PATTERN),
        "emptyDir": _obj("Each pod fetches its own copy into an emptyDir (node-local, gone with the pod).",
                         {"sizeLimit": {**_QUANTITY, "description": "Most the copy may take on the node."}}),
    })
    return _obj("Where the weights are and the name clients use.", {
        "name": _str("Served model name (--served-model-name): the `model` clients send.",
                     minLength=1, maxLength=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"),
        "source": _str("Where the weights come from: hf://org/name[@revision] (the Hugging Face Hub; revision "
                       "default main, pin a commit to be reproducible), s3://bucket/prefix, pvc://claim/path, or "
                       "an absolute path in the image. hf:// and s3:// are fetched once by an init container "
                       "into spec.model.cache, and the engines start from there.", minLength=1, maxLength=1100,
                       pattern=SOURCE_PATTERN),
        "path": _str("Model folder inside the container (--model-path); with neither pvc nor "
                     "hostPath the weights are expected in the image at this path. With a pvc:// source: "
                     f"where the claim is mounted (default {naming.PVC_MODEL_MOUNT}).",
                     pattern="^/", maxLength=1024),
        "fetch": fetch, "cache": cache,
        "updateStrategy": {"type": "string", "enum": ["Restart", "InPlace"], "default": "Restart",
                           "description": "What a new hf:// or s3:// source does. Restart: new engine pods "
                                          "fetch and load it (a rollout). InPlace: a Job fetches it into the "
                                          "shared cache (cache.claimName), then the router updates every "
                                          "engine's weights from disk; no pod restarts, and pods started "
                                          "later load the version in use."},
        "pvc": pvc, "hostPath": host,
        # Set once for every engine role: a prefill and a decode pod whose KV pages differ in dtype
        # cannot pair, so these are not per-role extraArgs.
        "dtype": {"type": "string", "enum": list(MODEL_DTYPES), "default": "auto",
                  "description": "Weights and activations of every engine (--dtype); auto: the checkpoint's."},
        "kvCacheDtype": {"type": "string", "enum": list(KV_CACHE_DTYPES), "default": "auto",
                         "description": "KV cache of every engine (--kv-cache-dtype); auto: the model's dtype. "
                                        "fp8_e5m2 holds 2x the tokens of bfloat16, rounding the cached K/V."},
        # the chat route of both PD roles must agree: the prefill refuses tool_choice auto without one
        "toolCallParser": {"type": "string", "enum": list(TOOL_CALL_PARSERS),
                           "description": "The model's tool-call format (--tool-call-parser of every engine): "
                                          "chat requests with tools get tool_calls. Unset: only tool_choice "
                                          "required or a named function (constrained) are served."},
        "reasoningParser": {"type": "string", "enum": list(REASONING_PARSERS),
                            "description": "Split the model's <think> block into reasoning_content "
                                           "(--reasoning-parser of every engine)."},
    }, required=("name",), scope=Scope.MODEL)


def _router() -> dict[str, Any]:
    policy = {"type": "string", "enum": ROUTER_POLICIES}
    return _obj("The router: OpenAI-compatible entry point that pairs prefill and decode pods.", {
        "replicas": _int("Number of router pods.", 0, 100, 1),
        "image": _str("Router image (default: spec.image).", maxLength=512),
        "prefillPolicy": {**policy, "default": "cache_aware", "description": "How to pick a prefill pod."},
        "decodePolicy": {**policy, "default": "round_robin", "description": "How to pick a decode pod."},
        "policy": {**policy, "default": "cache_aware", "description": "How to pick a pod (colocated mode)."},
        "service": _obj("The Service clients connect to.", {
            "type": {"type": "string", "enum": ["ClusterIP", "NodePort", "LoadBalancer"], "default": "ClusterIP"},
            "port": _int("Service port.", 1, 65535, naming.ROUTER_PORT),
        }, default={}),
        "apiKeySecretRef": _obj("Secret key holding the API key clients must send (BATON_API_KEY).", {
            "name": _str("Secret name.", minLength=1, maxLength=253),
            "key": _str("Key in the Secret.", default="api-key", minLength=1, maxLength=253),
        }, required=("name",)),
        "extraArgs": _list("Extra `baton router` arguments.", _str("", maxLength=256), 64,
                           scope=Scope.ROUTER_ARGS, default=[]),
        "resources": _resources(), "env": _env(), **_placement(),
        "disruptionBudget": _disruption_budget("router"),
    }, default={})


def _kv_transfer() -> dict[str, Any]:
    return _obj("How decode pods receive the KV cache from prefill pods.", {
        "backend": {"type": "string", "enum": ["mooncake"], "default": "mooncake"},
        "protocol": {"type": "string", "enum": ["tcp", "rdma"], "default": "tcp",
                     "description": "rdma for production, tcp where there is no RDMA NIC."},
        "ibDevices": _list("RDMA devices (--disaggregation-ib-device), e.g. [mlx5_0, mlx5_1].",
                           _str("", pattern=r"^[A-Za-z0-9_.:-]+$", maxLength=64), 16, default=[]),
        "rdmaResourceName": _str("Extended resource of the RDMA device plugin, requested per engine "
                                 "pod, e.g. rdma/hca_shared_devices_a.", maxLength=253),
        "rdmaResourceCount": _int("How many of rdmaResourceName each engine pod requests.", 1, 64, 1),
        "hostNetwork": _bool("Run engine pods in the node's network namespace (RoCE setups).", False),
        "bootstrapPort": _int("Prefill bootstrap port.", 1024, 65535, naming.DEFAULT_BOOTSTRAP_PORT),
    }, scope=Scope.KV_TRANSFER, default={})


def _monitoring() -> dict[str, Any]:
    return _obj("Prometheus Operator objects for the engines and the router.", {
        "podMonitor": _bool("Create a PodMonitor scraping /metrics of every pod.", False),
        "serviceMonitor": _bool("Create a ServiceMonitor scraping /metrics through the Services.", False),
        "interval": _str("Scrape interval.", default="15s", pattern=r"^[0-9]+(ms|s|m)$"),
        "labels": _string_map("Extra labels on the monitors (e.g. release: prometheus)."),
    }, default={})


def _network_policy() -> dict[str, Any]:
    return _obj("A NetworkPolicy that lets only the service's own pods reach its engine pods (docs/operator.md, "
                "\"Who may reach the engines\").", {
        "enabled": _bool("Create it. Turn it off where the cluster's network plugin does not enforce "
                         "NetworkPolicies, or where you manage your own.", True),
        "metricsFrom": _list(
            "NetworkPolicy peers (podSelector, namespaceSelector, ipBlock) that may scrape the engines' /metrics "
            "(the engine port). Unset: with spec.monitoring on, the Prometheus Operator's Prometheus pods "
            "(label app.kubernetes.io/name: prometheus) of any namespace, else none; [] for none.",
            _FREE_OBJECT, 16),
    }, default={})


def spec_schema() -> dict[str, Any]:
    return _obj("Desired state of one served model.", {
        "mode": {"type": "string", "enum": ["disaggregated", "colocated"], "default": "disaggregated",
                 "description": "disaggregated: prefill + decode pods; colocated: one engine role."},
        "image": _str("Image with the `baton` command.", minLength=1, maxLength=512),
        "imagePullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"], "default": "IfNotPresent"},
        "imagePullSecrets": _list("Names of image pull Secrets.", _str("", maxLength=253), 8),
        "model": _model(),
        "prefill": role_schema("prefill"), "decode": role_schema("decode"), "engine": role_schema("colocated"),
        "router": _router(), "kvTransfer": _kv_transfer(), "monitoring": _monitoring(),
        "networkPolicy": _network_policy(), "autoscaling": _autoscaling(),
        "replicas": {"type": "integer", "description": "Not used: each role has its own (spec.prefill.replicas, "
                     "spec.decode.replicas, spec.engine.replicas, spec.router.replicas). `kubectl scale` writes "
                     "here and is refused with that advice."},
        "podSecurity": _obj("Pod security of engines and router.", {
            "runAsNonRoot": _bool("Run as a non-root user (set false if the image needs root).", True),
            "runAsUser": _int("User id.", 0, 2147483647, 1000),
            "fsGroup": _int("Group owning mounted volumes.", 0, 2147483647, 1000),
        }, default={}),
    }, required=("image", "model"), scope=Scope.SPEC)


def _role_status() -> dict[str, Any]:
    count = {"type": "integer", "minimum": 0}
    return {"type": "object", "properties": {
        "desiredReplicas": count, "readyReplicas": count, "updatedReplicas": count,
        "availableReplicas": count, "summary": {"type": "string", "description": "ready/desired"}}}


def _autoscaling_status() -> dict[str, Any]:
    role = {"type": "object", "properties": {
        "replicas": {"type": "integer", "minimum": 0}, "reason": {"type": "string"},
        "observed": {"type": "object", "additionalProperties": {"type": "number"},
                     "description": "The signals over the window (targetX without the prefix)."},
        "lastScaleTime": {"type": "string", "format": "date-time"}}}
    recommendation = {"type": "object", "properties": {
        "role": {"type": "string"}, "at": {"type": "string", "format": "date-time"},
        "replicas": {"type": "integer", "minimum": 0}}}
    return {"type": "object", "description": "The planner's last decision per role and why.", "properties": {
        "lastDecisionTime": {"type": "string", "format": "date-time"},
        "recommendations": {"type": "array", "items": recommendation,
                            "description": "Each step's recommendation per role over the scale windows: the "
                                           "stabilisation memory a restarted operator takes back."},
        "prefill": role, "decode": role, "engine": role}}


def status_schema() -> dict[str, Any]:
    condition = {"type": "object", "required": ["type", "status"], "properties": {
        "type": {"type": "string"}, "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"}, "message": {"type": "string"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer"}}}
    return {"type": "object", "properties": {
        "observedGeneration": {"type": "integer"}, "mode": {"type": "string"},
        "endpoint": {"type": "string", "description": "URL clients use: a LoadBalancer router Service's address "
                                                   "(<pending> until it has one), else the router inside the cluster."},
        "clusterEndpoint": {"type": "string", "description": "URL of the router inside the cluster."},
        "prefill": _role_status(), "decode": _role_status(), "engine": _role_status(),
        "router": _role_status(),
        "replicas": {"type": "integer", "description": "Not used (the scale subresource's; see spec.replicas)."},
        "autoscaling": _autoscaling_status(),
        "model": {"type": "object", "description": "spec.model.updateStrategy InPlace: what the engines serve.",
                  "properties": {
                      "source": {"type": "string", "description": "The source the engines serve (and pods "
                                                                  "started now load)."},
                      "weightVersion": {"type": "string", "description": "The engines' weight version "
                                                                         "(/get_weight_version)."}}},
        "conditions": {"type": "array", "items": condition, "x-kubernetes-list-type": "map",
                       "x-kubernetes-list-map-keys": ["type"]},
    }}


def _column(name: str, path: str, kind: str = "string", priority: int = 0, desc: str = "") -> dict[str, Any]:
    col = {"name": name, "type": kind, "jsonPath": path, "description": desc}
    if priority:
        col["priority"] = priority
    return col


PRINTER_COLUMNS = [
    _column("Ready", '.status.conditions[?(@.type=="Ready")].status', desc="The router can serve."),
    _column("Prefill", ".status.prefill.summary", desc="Ready/desired prefill pods."),
    _column("Decode", ".status.decode.summary", desc="Ready/desired decode pods."),
    _column("Engine", ".status.engine.summary", priority=1, desc="Ready/desired colocated pods."),
    _column("Router", ".status.router.summary", desc="Ready/desired router pods."),
    _column("Mode", ".spec.mode", priority=1),
    _column("Model", ".spec.model.name", priority=1),
    _column("Endpoint", ".status.endpoint"),
    _column("Age", ".metadata.creationTimestamp", kind="date"),
]


def openapi_schema() -> dict[str, Any]:
    root = _obj("A model served by Baton with prefill/decode disaggregation.", {
        "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
        "spec": spec_schema(), "status": status_schema(),
    }, required=("spec",), scope=Scope.ROOT)
    return root


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": naming.CRD_NAME, "labels": {"app.kubernetes.io/part-of": "baton"}},
        "spec": {
            "group": naming.GROUP,
            "scope": "Namespaced",
            "names": {"plural": naming.PLURAL, "singular": naming.SINGULAR, "kind": naming.KIND,
                      "shortNames": list(naming.SHORT_NAMES), "categories": ["baton"]},
            "versions": [{
                "name": naming.VERSION, "served": True, "storage": True,
                # scale: `kubectl scale bisvc` (or an HPA aimed at it) writes spec.replicas, which a CEL
                # rule refuses saying which per-role field to change, instead of a 404 NotFound
                "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                         "statusReplicasPath": ".status.replicas"}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": openapi_schema()},
            }],
        },
    }
