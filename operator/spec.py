"""The InferenceService spec as frozen dataclasses, parsed from the (defaulted) custom resource.

`parse()` applies the CRD's defaults (`baton.operator.defaults`) and the CRD's semantic rules
(`baton.operator.validation`) before building the dataclasses, so the builders never see a spec the
API server would have refused. Kubernetes pass-through fields (resources, env, tolerations, affinity)
stay plain dicts: the builders copy them into pod specs as they are.
"""
from __future__ import annotations

import enum
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from baton.fetch.source import ModelSource, Scheme, parse_source
from baton.operator import naming
from baton.operator.crd import openapi_schema
from baton.operator.defaults import apply_defaults
from baton.operator.naming import Role
from baton.operator.planner import ITL, KV_USAGE, QUEUED_TOKENS, TTFT, PlannerConfig, RoleTargets
from baton.operator.validation import validate


class InvalidSpec(ValueError):
    """The spec breaks a rule; `errors` says what to change."""

    def __init__(self, errors: list[str]):
        super().__init__("; ".join(errors))
        self.errors = errors


class Mode(str, enum.Enum):
    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str  # --model-path: the image path, a pvc:// mount, or the source's folder in the cache
    pvc_claim: str | None = None
    pvc_sub_path: str | None = None
    host_path: str | None = None
    dtype: str = "auto"  # --dtype of every engine role
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype of every engine role
    tool_call_parser: str | None = None  # --tool-call-parser of every engine role
    reasoning_parser: str | None = None  # --reasoning-parser of every engine role
    source: ModelSource | None = None  # spec.model.source as given (None: path/pvc/hostPath as before)
    fetch_endpoint: str | None = None
    fetch_region: str | None = None
    fetch_secret: str | None = None  # Secret name: its keys are the fetch container's env
    fetch_include: tuple[str, ...] = ()
    cache_claim: str | None = None  # the cache: a shared PVC, or (None) an emptyDir per pod
    cache_size_limit: str | int | None = None  # of the emptyDir
    update_strategy: str = "Restart"  # a new source: Restart (new pods) or InPlace (a weight update)

    @property
    def in_place(self) -> bool:
        """A new source reaches the running engines as a weight update, not as new pods."""
        return self.update_strategy == "InPlace" and self.fetched

    @property
    def fetched(self) -> bool:
        """An init container fetches the model into the cache volume before the engine starts."""
        return self.source is not None and self.source.scheme.fetched


@dataclass(frozen=True)
class Placement:
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    affinity: dict[str, Any] | None = None
    topology_spread: list[dict[str, Any]] | None = None  # None: the builders' default (spread over nodes)


@dataclass(frozen=True)
class RoleSpec:
    replicas: int = 1
    tp: int = 1
    dp: int = 1
    gpus: int = 0
    gpu_resource_name: str = "nvidia.com/gpu"
    shm_size: str | int | None = None
    resources: dict[str, Any] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    env: list[dict[str, Any]] = field(default_factory=list)
    placement: Placement = field(default_factory=Placement)
    # SIGTERM -> SIGKILL: how long a stopping pod's running requests have to finish
    termination_grace_seconds: int = 60
    max_unavailable: int | str = 1  # of the role's PodDisruptionBudget: a count or "N%"
    rollout_max_surge: int | str = 1  # of the Deployment's RollingUpdate strategy
    rollout_max_unavailable: int | str = 0

    def __post_init__(self) -> None:
        assert self.gpus == 0 or self.gpus == self.ranks, "validated before parsing"

    @property
    def ranks(self) -> int:
        """Engine processes of one pod (one GPU each on CUDA)."""
        return self.tp * self.dp

    @property
    def device(self) -> str:
        return "cuda" if self.gpus > 0 else "cpu"


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class RouterSpec:
    replicas: int = 1
    image: str | None = None  # None: spec.image
    prefill_policy: str = "cache_aware"
    decode_policy: str = "round_robin"
    policy: str = "cache_aware"
    service_type: str = "ClusterIP"
    service_port: int = 8000
    api_key: SecretKeyRef | None = None
    extra_args: tuple[str, ...] = ()
    resources: dict[str, Any] = field(default_factory=dict)
    env: list[dict[str, Any]] = field(default_factory=list)
    placement: Placement = field(default_factory=Placement)
    max_unavailable: int | str = 1  # of the router's PodDisruptionBudget


@dataclass(frozen=True)
class KvTransferSpec:
    backend: str = "mooncake"
    protocol: str = "tcp"
    ib_devices: tuple[str, ...] = ()
    rdma_resource_name: str | None = None
    rdma_resource_count: int = 1
    host_network: bool = False
    bootstrap_port: int = 8998

    @property
    def rdma(self) -> bool:
        return self.protocol == "rdma"


@dataclass(frozen=True)
class MonitoringSpec:
    pod_monitor: bool = False
    service_monitor: bool = False
    interval: str = "15s"
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class NetworkPolicySpec:
    enabled: bool = True
    metrics_from: list[dict[str, Any]] | None = None  # None: the builders' default (Prometheus, with monitoring)


@dataclass(frozen=True)
class PodSecuritySpec:
    run_as_non_root: bool = True
    run_as_user: int = 1000
    fs_group: int = 1000


@dataclass(frozen=True)
class InferenceServiceSpec:
    image: str
    model: ModelSpec
    mode: Mode = Mode.DISAGGREGATED
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    roles: dict[Role, RoleSpec] = field(default_factory=dict)  # engine roles only
    router: RouterSpec = field(default_factory=RouterSpec)
    kv_transfer: KvTransferSpec = field(default_factory=KvTransferSpec)
    monitoring: MonitoringSpec = field(default_factory=MonitoringSpec)
    network_policy: NetworkPolicySpec = field(default_factory=NetworkPolicySpec)
    pod_security: PodSecuritySpec = field(default_factory=PodSecuritySpec)
    external_replicas: bool = False  # spec.autoscaling.mode external: an HPA/KEDA owns engine replicas
    planner: PlannerConfig | None = None  # spec.autoscaling.mode planner: it owns the replicas of its roles

    def __post_init__(self) -> None:
        assert set(self.roles) == set(engine_roles(self.mode)), "one RoleSpec per engine role of the mode"

    @property
    def disaggregated(self) -> bool:
        return self.mode is Mode.DISAGGREGATED

    def replicas_owner(self, role: Role) -> str | None:
        """Who sets this engine role's replicas after creation: naming.EXTERNAL_REPLICAS (an HPA, KEDA),
        naming.PLANNER_REPLICAS (the operator's planner), or None (spec.<role>.replicas)."""
        if self.external_replicas:
            return naming.EXTERNAL_REPLICAS
        if self.planner is not None and role in self.planner.roles:
            return naming.PLANNER_REPLICAS
        return None

    def initial_replicas(self, role: Role) -> int:
        """The replicas an engine Deployment is created with (a planned role: within its bounds)."""
        n = self.roles[role].replicas
        if self.planner is not None and role in self.planner.roles:
            bounds = self.planner.roles[role]
            n = min(max(n, bounds.min_replicas), bounds.max_replicas)
        return n


@dataclass(frozen=True)
class InferenceService:
    """The parts of the custom resource the builders need."""

    name: str
    namespace: str
    uid: str
    spec: InferenceServiceSpec
    generation: int = 1


def engine_roles(mode: Mode) -> tuple[Role, ...]:
    return (Role.PREFILL, Role.DECODE) if mode is Mode.DISAGGREGATED else (Role.COLOCATED,)


def _placement(d: Mapping[str, Any]) -> Placement:
    spread = d.get("topologySpreadConstraints")
    return Placement(dict(d.get("nodeSelector", {})), list(d.get("tolerations", [])), d.get("affinity"),
                     None if spread is None else list(spread))


def _role(d: Mapping[str, Any]) -> RoleSpec:
    return RoleSpec(
        replicas=d["replicas"], tp=d["tp"], dp=d["dp"], gpus=d["gpus"],
        gpu_resource_name=d["gpuResourceName"], shm_size=d.get("shmSize"),
        resources=dict(d.get("resources", {})), extra_args=tuple(d["extraArgs"]),
        env=list(d.get("env", [])), placement=_placement(d),
        termination_grace_seconds=d["terminationGracePeriodSeconds"],
        max_unavailable=d["disruptionBudget"]["maxUnavailable"],
        rollout_max_surge=d["rollingUpdate"]["maxSurge"],
        rollout_max_unavailable=d["rollingUpdate"]["maxUnavailable"])


def _router(d: Mapping[str, Any]) -> RouterSpec:
    ref = d.get("apiKeySecretRef")
    return RouterSpec(
        replicas=d["replicas"], image=d.get("image"), prefill_policy=d["prefillPolicy"],
        decode_policy=d["decodePolicy"], policy=d["policy"], service_type=d["service"]["type"],
        service_port=d["service"]["port"],
        api_key=SecretKeyRef(ref["name"], ref["key"]) if ref else None,
        extra_args=tuple(d["extraArgs"]), resources=dict(d.get("resources", {})),
        env=list(d.get("env", [])), placement=_placement(d),
        max_unavailable=d["disruptionBudget"]["maxUnavailable"])


def _model(d: Mapping[str, Any]) -> ModelSpec:
    pvc = d.get("pvc") or {}
    claim, sub_path, path = pvc.get("claimName"), pvc.get("subPath"), d.get("path")
    src = parse_source(d["source"]) if "source" in d else None
    if src is not None and src.scheme is Scheme.PVC:
        claim, sub_path, path = src.location, src.path or None, path or naming.PVC_MODEL_MOUNT
    elif src is not None and src.scheme is Scheme.IMAGE:
        path = src.location
    elif src is not None:  # fetched: the engines read the source's folder in the cache
        path = posixpath.join(naming.MODEL_CACHE_MOUNT, src.cache_key)
    fetch, cache = d.get("fetch") or {}, d.get("cache") or {}
    return ModelSpec(name=d["name"], path=path, pvc_claim=claim,
                     pvc_sub_path=sub_path, host_path=(d.get("hostPath") or {}).get("path"),
                     dtype=d["dtype"], kv_cache_dtype=d["kvCacheDtype"],
                     tool_call_parser=d.get("toolCallParser"), reasoning_parser=d.get("reasoningParser"),
                     source=src, fetch_endpoint=fetch.get("endpoint"), fetch_region=fetch.get("region"),
                     fetch_secret=fetch.get("secretName"), fetch_include=tuple(fetch.get("include", [])),
                     cache_claim=cache.get("claimName"), cache_size_limit=(cache.get("emptyDir") or {}).get("sizeLimit"),
                     update_strategy=d.get("updateStrategy", "Restart"))


_TARGET_FIELDS = {"targetQueuedTokens": QUEUED_TOKENS.key, "targetTTFTSeconds": TTFT.key,
                  "targetKVUsage": KV_USAGE.key, "targetITLSeconds": ITL.key}


def _planner(a: Mapping[str, Any], mode: Mode) -> PlannerConfig | None:
    if a["mode"] != "planner":
        return None
    roles = {}
    for role in engine_roles(mode):
        r = a.get(role.spec_key)
        if r is not None:
            roles[role] = RoleTargets(r["minReplicas"], r["maxReplicas"],
                                      {key: float(r[f]) for f, key in _TARGET_FIELDS.items() if f in r})
    ratio = a.get("prefillDecodeRatio") or {}
    return PlannerConfig(roles=roles, min_ratio=ratio.get("min"), max_ratio=ratio.get("max"),
                         interval_seconds=a["intervalSeconds"], window_seconds=a["windowSeconds"],
                         scale_up_seconds=a["scaleUpStabilizationSeconds"],
                         scale_down_seconds=a["scaleDownStabilizationSeconds"])


def defaulted(body: Mapping[str, Any]) -> dict[str, Any]:
    """The custom resource with the CRD's defaults applied, including to engine roles left out."""
    obj = apply_defaults(openapi_schema(), {k: v for k, v in body.items() if k != "status"})
    spec = obj.setdefault("spec", {})
    mode = Mode(spec.get("mode", Mode.DISAGGREGATED.value))
    role_schema = openapi_schema()["properties"]["spec"]["properties"]["prefill"]
    others = ("engine",) if mode is Mode.DISAGGREGATED else ("prefill", "decode")
    if not any(k in spec for k in others):  # else validation says which to remove
        for role in engine_roles(mode):  # an omitted role means "one pod with the defaults"
            spec[role.spec_key] = apply_defaults(role_schema, spec.get(role.spec_key, {}))
    return obj


def _missing(obj: Mapping[str, Any]) -> list[str]:
    spec = obj.get("spec", {})
    out = [f"spec.{k}: required" for k in ("image", "model") if k not in spec]
    out += [f"spec.model.{k}: required" for k in ("name",) if k not in spec.get("model", {"name": 1})]
    return out


def parse(body: Mapping[str, Any]) -> InferenceService:
    """Custom resource (as the API server returns it) -> InferenceService. Raises InvalidSpec."""
    obj = defaulted(body)
    errors = _missing(obj) or validate(obj)
    if errors:
        raise InvalidSpec(errors)
    s, meta = obj["spec"], obj["metadata"]
    mode = Mode(s["mode"])
    kv = s["kvTransfer"]
    mon = s["monitoring"]
    net = s["networkPolicy"]
    sec = s["podSecurity"]
    spec = InferenceServiceSpec(
        image=s["image"], model=_model(s["model"]), mode=mode,
        image_pull_policy=s["imagePullPolicy"], image_pull_secrets=tuple(s.get("imagePullSecrets", [])),
        roles={role: _role(s[role.spec_key]) for role in engine_roles(mode)},
        router=_router(s["router"]),
        kv_transfer=KvTransferSpec(
            backend=kv["backend"], protocol=kv["protocol"], ib_devices=tuple(kv["ibDevices"]),
            rdma_resource_name=kv.get("rdmaResourceName"), rdma_resource_count=kv["rdmaResourceCount"],
            host_network=kv["hostNetwork"], bootstrap_port=kv["bootstrapPort"]),
        monitoring=MonitoringSpec(mon["podMonitor"], mon["serviceMonitor"], mon["interval"],
                                  dict(mon.get("labels", {}))),
        network_policy=NetworkPolicySpec(net["enabled"], None if "metricsFrom" not in net else list(net["metricsFrom"])),
        pod_security=PodSecuritySpec(sec["runAsNonRoot"], sec["runAsUser"], sec["fsGroup"]),
        external_replicas=s["autoscaling"]["mode"] == "external",
        planner=_planner(s["autoscaling"], mode),
    )
    return InferenceService(name=meta["name"], namespace=meta.get("namespace", "default"),
                            uid=meta.get("uid", ""), spec=spec, generation=meta.get("generation", 1))
