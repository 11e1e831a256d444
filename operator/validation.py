"""Semantic rules of an InferenceService, written once and enforced twice.

Each rule carries a CEL expression (placed in the CRD as `x-kubernetes-validations`, so that
`kubectl apply` refuses a wrong spec) and the same predicate in Python (so that the operator refuses it
too, on clusters where the CRD's CEL is not enforced, e.g. an emulated API server or an old CRD).
tests/operator/test_crd.py evaluates both on the same specs and checks they agree.
"""
from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from baton.fetch import source as model_source
from baton.operator import known_flags
from baton.operator.naming import MAX_NAME_LENGTH, NAME_PATTERN


class Scope(str, enum.Enum):
    """Where in the object a rule sits (its CEL `self`)."""

    ROOT = "root"  # the whole object; only metadata.name is visible to CEL there
    SPEC = "spec"
    MODEL = "spec.model"
    ROLE = "spec.<role>"  # each of spec.prefill, spec.decode, spec.engine
    ENGINE_ARGS = "spec.<role>.extraArgs"
    ROUTER_ARGS = "spec.router.extraArgs"
    KV_TRANSFER = "spec.kvTransfer"
    ENV_VAR = "spec.<role>.env[*]"  # each env item of every engine role and of the router
    AUTOSCALING = "spec.autoscaling"
    AUTOSCALING_ROLE = "spec.autoscaling.<role>"  # each of its prefill, decode, engine


@dataclass(frozen=True)
class Rule:
    scope: Scope
    cel: str
    message: str
    check: Callable[[Any], bool]  # Python twin of `cel`: True when the value is acceptable


ENGINE_MANAGED_FLAGS = ("host", "port", "model-path", "served-model-name", "device", "tp-size",
                        "dp-size", "disaggregation-[a-z-]+", "api-key", "dtype", "kv-cache-dtype",
                        "tool-call-parser", "reasoning-parser")
ROUTER_MANAGED_FLAGS = ("host", "port", "pd-disaggregation", "service-discovery[a-z-]*",
                        "prefill-selector", "decode-selector", "selector", "prefill-policy",
                        "decode-policy", "policy", "api-key", "engine-api-key", "shutdown-timeout-secs")


def _tp_pair_ok(prefill_tp: int, decode_tp: int) -> bool:
    return max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp) == 0


def _flags_regex(flags: tuple[str, ...]) -> str:
    return "^--(" + "|".join(flags) + ")(=.*)?$"


ENGINE_FLAGS_RE = _flags_regex(ENGINE_MANAGED_FLAGS)
ROUTER_FLAGS_RE = _flags_regex(ROUTER_MANAGED_FLAGS)


# Node folders a model hostPath may not be, be inside or contain: the node's root, its configuration,
# kernel interfaces, and the kubelet's and container runtimes' state (other pods' secrets and volumes).
NODE_SYSTEM_DIRS = ("etc", "proc", "sys", "dev", "run", "boot", "root", "var/run", "var/lib/kubelet",
                    "var/lib/containerd", "var/lib/docker", "var/lib/etcd")
HOST_PATH_SYSTEM_RE = "^/((" + "|".join(NODE_SYSTEM_DIRS) + ")(/.*)?|var(/lib)?/?)?$"
HOST_PATH_UNCLEAN_RE = "//|(^|/)[.][.]?(/|$)"  # `//`, `.` or `..` segments: a path says where it is


_FETCHED_CEL = "(self.source.startsWith('hf://') || self.source.startsWith('s3://'))"
_SOURCE_CEL = " || ".join(f"self.source.matches('{p}')" for p in (
    model_source.HF_PATTERN, model_source.S3_PATTERN, model_source.PVC_PATTERN, model_source.IMAGE_PATTERN))


def _fetched(m: Mapping[str, Any]) -> bool:
    return str(m.get("source", "")).startswith(("hf://", "s3://"))


def _no_managed_flag(pattern: str) -> Callable[[Any], bool]:
    return lambda args: not any(re.search(pattern, a) for a in args)


def _only_known(pattern: str) -> Callable[[Any], bool]:
    return lambda args: all(not a.startswith("--") or re.search(pattern, a) for a in args)


ENGINE_KNOWN_RE = _flags_regex(known_flags.ENGINE_FLAGS)
ROUTER_KNOWN_RE = _flags_regex(known_flags.ROUTER_FLAGS)


RULES: tuple[Rule, ...] = (
    Rule(Scope.ROOT, f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
         f"metadata.name must be at most {MAX_NAME_LENGTH} characters: the operator appends "
         "-prefill/-decode/-router to it for Deployments and Services (63 characters at most)",
         lambda o: len(o.get("metadata", {}).get("name", "")) <= MAX_NAME_LENGTH),
    Rule(Scope.ROOT, f"self.metadata.name.matches('{NAME_PATTERN}')",
         "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting "
         "with a letter): it names the router Service",
         lambda o: re.search(NAME_PATTERN, o.get("metadata", {}).get("name", "")) is not None),
    Rule(Scope.SPEC,
         "self.mode == 'colocated' ? (!has(self.prefill) && !has(self.decode)) : !has(self.engine)",
         "mode colocated runs spec.engine only: remove spec.prefill and spec.decode; "
         "mode disaggregated runs spec.prefill and spec.decode: remove spec.engine",
         lambda s: (("prefill" not in s and "decode" not in s) if s.get("mode") == "colocated"
                    else "engine" not in s)),
    Rule(Scope.MODEL, "!(has(self.pvc) && has(self.hostPath))",
         "set at most one of spec.model.pvc and spec.model.hostPath (set neither when the weights "
         "are inside the image at spec.model.path)",
         lambda m: not ("pvc" in m and "hostPath" in m)),
    Rule(Scope.MODEL,
         f"!has(self.hostPath) || (!self.hostPath.path.matches('{HOST_PATH_SYSTEM_RE}') && "
         f"!self.hostPath.path.matches('{HOST_PATH_UNCLEAN_RE}'))",
         "spec.model.hostPath.path must be a model folder on the node: not /, nor a system folder "
         f"({', '.join('/' + d for d in NODE_SYSTEM_DIRS)}) or one holding them, and without //, . or "
         ".. segments",
         lambda m: "hostPath" not in m or not (re.search(HOST_PATH_SYSTEM_RE, m["hostPath"].get("path", ""))
                                               or re.search(HOST_PATH_UNCLEAN_RE, m["hostPath"].get("path", "")))),
    Rule(Scope.MODEL, "has(self.path) || has(self.source)",
         "set spec.model.source (hf://org/name@revision, s3://bucket/prefix, pvc://claim/path) or "
         "spec.model.path (the model folder in the image)",
         lambda m: "path" in m or "source" in m),
    Rule(Scope.MODEL,
         f"!has(self.source) || (({_SOURCE_CEL}) && !self.source.matches('{model_source.UNCLEAN_PATTERN}'))",
         "spec.model.source must be hf://org/name[@revision], s3://bucket/prefix, pvc://claim/path or an "
         "absolute path in the image, without '.', '..' or empty path segments",
         lambda m: "source" not in m or model_source.is_valid(m["source"])),
    Rule(Scope.MODEL, "!has(self.source) || (!has(self.pvc) && !has(self.hostPath))",
         "spec.model.source replaces spec.model.pvc and spec.model.hostPath: set one of them "
         "(pvc://claim/path is pvc as a source)",
         lambda m: "source" not in m or not ("pvc" in m or "hostPath" in m)),
    Rule(Scope.MODEL, "!has(self.source) || !has(self.path) || self.source.startsWith('pvc://')",
         "spec.model.path is where a pvc:// source is mounted; with an hf:// or s3:// source the engines read "
         "the model from the cache, and a path source is the path: remove spec.model.path",
         lambda m: "source" not in m or "path" not in m or m["source"].startswith("pvc://")),
    Rule(Scope.MODEL, f"!has(self.source) || !{_FETCHED_CEL} || has(self.cache)",
         "an hf:// or s3:// source is fetched into spec.model.cache: set cache.claimName (a "
         "PersistentVolumeClaim the service's pods share, fetched once) or cache.emptyDir: {} (each pod "
         "fetches its own copy)",
         lambda m: not _fetched(m) or "cache" in m),
    Rule(Scope.MODEL, f"(!has(self.cache) && !has(self.fetch)) || (has(self.source) && {_FETCHED_CEL})",
         "spec.model.cache and spec.model.fetch are for hf:// and s3:// sources only: remove them or set "
         "such a source",
         lambda m: ("cache" not in m and "fetch" not in m) or _fetched(m)),
    Rule(Scope.MODEL,
         "!has(self.updateStrategy) || self.updateStrategy != 'InPlace' || "
         f"(has(self.source) && {_FETCHED_CEL} && has(self.cache) && has(self.cache.claimName))",
         "spec.model.updateStrategy InPlace updates the running engines from a shared cache: it needs an "
         "hf:// or s3:// source and spec.model.cache.claimName (a ReadWriteMany PersistentVolumeClaim every "
         "engine pod mounts); with model.path, a pvc:// source or an emptyDir cache use updateStrategy Restart",
         lambda m: m.get("updateStrategy", "Restart") != "InPlace"
         or (_fetched(m) and "claimName" in (m.get("cache") or {}))),
    Rule(Scope.MODEL, "!has(self.cache) || (has(self.cache.claimName) != has(self.cache.emptyDir))",
         "spec.model.cache: set exactly one of claimName and emptyDir",
         lambda m: "cache" not in m or (("claimName" in m["cache"]) != ("emptyDir" in m["cache"]))),
    Rule(Scope.ENV_VAR, "!has(self.valueFrom) || !has(self.valueFrom.secretKeyRef)",
         "env must not read Secrets (valueFrom.secretKeyRef): the operator would hand any Secret of the "
         "namespace to the pods of whoever may create an InferenceService; the router's API key goes in "
         "spec.router.apiKeySecretRef",
         lambda e: "secretKeyRef" not in (e.get("valueFrom") or {})),
    Rule(Scope.ENV_VAR, "self.name != 'BATON_API_KEY' && self.name != 'BATON_ENGINE_API_KEY'",
         "env must not set BATON_API_KEY or BATON_ENGINE_API_KEY: the operator sets them, from the service's "
         "internal key (what the router and the engines share) and from spec.router.apiKeySecretRef (what "
         "clients send); an empty value would turn the engines' key off",
         lambda e: e.get("name") not in ("BATON_API_KEY", "BATON_ENGINE_API_KEY")),
    Rule(Scope.ROLE, "self.gpus == 0 || self.gpus == self.tp * self.dp",
         "gpus must be 0 (run on CPU) or equal tp * dp (one GPU per rank); "
         "fix gpus, tp or dp in this role",
         lambda r: r.get("gpus", 0) == 0 or r.get("gpus") == r.get("tp", 1) * r.get("dp", 1)),
    # With TP each rank holds a shard of the KV heads; a decode TP rank takes its heads' slices from
    # whichever prefill TP ranks hold them (engine/disaggregation/head_slices.py), so the sizes may
    # differ. Each engine checks at start that its own tp splits the model's heads (the model is not
    # known here); one size dividing the other keeps every KV head on whole ranks of both sides, as
    # the head counts of the models served (powers of two) need anyway. A role left out runs with
    # tp 1. (has(): see the kvTransfer rules below.)
    Rule(Scope.SPEC,
         "(has(self.prefill) && has(self.prefill.tp) ? self.prefill.tp : 1) >= "
         "(has(self.decode) && has(self.decode.tp) ? self.decode.tp : 1) ? "
         "(has(self.prefill) && has(self.prefill.tp) ? self.prefill.tp : 1) % "
         "(has(self.decode) && has(self.decode.tp) ? self.decode.tp : 1) == 0 : "
         "(has(self.decode) && has(self.decode.tp) ? self.decode.tp : 1) % "
         "(has(self.prefill) && has(self.prefill.tp) ? self.prefill.tp : 1) == 0",
         "spec.prefill.tp and spec.decode.tp must divide one another (e.g. 1 and 2, 4 and 2, 2 and 2): "
         "each decode TP rank receives its KV heads from the prefill TP ranks that hold them",
         lambda s: _tp_pair_ok(s.get("prefill", {}).get("tp", 1), s.get("decode", {}).get("tp", 1))),
    # A PD engine refuses --enable-mixed-chunk at start-up (it runs prefills or decodes, not both):
    # refused here, before a pod crash-loops on it.
    Rule(Scope.SPEC,
         "(!has(self.prefill) || !has(self.prefill.extraArgs) || "
         "!self.prefill.extraArgs.exists(a, a == '--enable-mixed-chunk')) && "
         "(!has(self.decode) || !has(self.decode.extraArgs) || "
         "!self.decode.extraArgs.exists(a, a == '--enable-mixed-chunk'))",
         "--enable-mixed-chunk mixes prefills with decode steps of one engine: set it in "
         "spec.engine.extraArgs (mode colocated), not in spec.prefill or spec.decode",
         lambda s: all("--enable-mixed-chunk" not in s.get(role, {}).get("extraArgs", [])
                       for role in ("prefill", "decode"))),
    # the CRD's scale subresource writes spec.replicas (kubectl scale bisvc NAME --replicas=N)
    Rule(Scope.SPEC, "!has(self.replicas)",
         "an InferenceService has no single replica count (kubectl scale does not apply): set "
         "spec.prefill.replicas, spec.decode.replicas (spec.engine.replicas in mode colocated) or "
         "spec.router.replicas, e.g. kubectl patch bisvc NAME --type merge -p "
         "'{\"spec\":{\"decode\":{\"replicas\":2}}}'; or let spec.autoscaling (planner, or external with "
         "kubectl scale deployment NAME-decode) scale them",
         lambda s: "replicas" not in s),
    Rule(Scope.SPEC,
         "!has(self.autoscaling) || (self.mode == 'colocated' ? "
         "(!has(self.autoscaling.prefill) && !has(self.autoscaling.decode)) : !has(self.autoscaling.engine))",
         "spec.autoscaling.engine is for mode colocated, spec.autoscaling.prefill and .decode for mode "
         "disaggregated: scale the roles the mode runs",
         lambda s: (("prefill" not in s.get("autoscaling", {}) and "decode" not in s.get("autoscaling", {}))
                    if s.get("mode") == "colocated" else "engine" not in s.get("autoscaling", {}))),
    Rule(Scope.ENGINE_ARGS, f"self.all(a, !a.matches('{ENGINE_FLAGS_RE}'))",
         "extraArgs must not set flags the operator manages (--host, --port, --model-path, "
         "--served-model-name, --device, --tp-size, --dp-size, --disaggregation-*, --api-key, --dtype, "
         "--kv-cache-dtype, --tool-call-parser, --reasoning-parser): use the matching spec fields "
         "(spec.model, spec.model.dtype, spec.model.kvCacheDtype, spec.model.toolCallParser, "
         "spec.model.reasoningParser, tp, dp, gpus, kvTransfer, router.apiKeySecretRef)",
         _no_managed_flag(ENGINE_FLAGS_RE)),
    Rule(Scope.ROUTER_ARGS, f"self.all(a, !a.matches('{ROUTER_FLAGS_RE}'))",
         "router.extraArgs must not set flags the operator manages (--host, --port, "
         "--service-discovery*, --*selector, --*policy, --pd-disaggregation, --api-key, --engine-api-key, "
         "--shutdown-timeout-secs): use spec.router.prefillPolicy/decodePolicy/policy, router.apiKeySecretRef "
         "and the engine roles' terminationGracePeriodSeconds (the engines' key is the service's internal key)",
         _no_managed_flag(ROUTER_FLAGS_RE)),
    # the real parsers' flags (known_flags.py, generated from them): an unknown or abbreviated flag would
    # otherwise only show as a crash-looping pod
    Rule(Scope.ENGINE_ARGS, f"self.all(a, !a.startsWith('--') || a.matches('{ENGINE_KNOWN_RE}'))",
         "extraArgs has a flag `baton serve` does not have: write each flag in full, as `baton serve --help` "
         "lists it (abbreviations are refused)",
         _only_known(ENGINE_KNOWN_RE)),
    Rule(Scope.ROUTER_ARGS, f"self.all(a, !a.startsWith('--') || a.matches('{ROUTER_KNOWN_RE}'))",
         "router.extraArgs has a flag `baton router` does not have: write each flag in full, as "
         "`baton router --help` lists it (abbreviations are refused)",
         _only_known(ROUTER_KNOWN_RE)),
    # has(): the API server also checks the CRD's `default: {}` of kvTransfer against these rules,
    # before (without) the nested defaults, so a field may be missing there.
    Rule(Scope.KV_TRANSFER,
         "(has(self.protocol) && self.protocol == 'rdma') || !has(self.ibDevices) || size(self.ibDevices) == 0",
         "kvTransfer.ibDevices is only used with protocol: rdma; set protocol: rdma or remove it",
         lambda k: k.get("protocol") == "rdma" or not k.get("ibDevices")),
    Rule(Scope.KV_TRANSFER, "(has(self.protocol) && self.protocol == 'rdma') || !has(self.rdmaResourceName)",
         "kvTransfer.rdmaResourceName is only used with protocol: rdma; "
         "set protocol: rdma or remove it",
         lambda k: k.get("protocol") == "rdma" or "rdmaResourceName" not in k),
    Rule(Scope.AUTOSCALING,
         "!has(self.prefillDecodeRatio) || !has(self.prefillDecodeRatio.min) || "
         "!has(self.prefillDecodeRatio.max) || self.prefillDecodeRatio.min <= self.prefillDecodeRatio.max",
         "spec.autoscaling.prefillDecodeRatio: min must not exceed max",
         lambda a: not ("min" in a.get("prefillDecodeRatio", {}) and "max" in a.get("prefillDecodeRatio", {}))
         or a["prefillDecodeRatio"]["min"] <= a["prefillDecodeRatio"]["max"]),
    Rule(Scope.AUTOSCALING_ROLE,
         "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
         "minReplicas must not exceed maxReplicas",
         lambda r: r.get("minReplicas", 1) <= r.get("maxReplicas", 4)),
    Rule(Scope.AUTOSCALING_ROLE,
         "has(self.targetQueuedTokens) || has(self.targetTTFTSeconds) || has(self.targetKVUsage) || "
         "has(self.targetITLSeconds)",
         "set at least one target the planner scales this role by: targetQueuedTokens or targetTTFTSeconds "
         "(prefill), targetKVUsage or targetITLSeconds (decode)",
         lambda r: any(k in r for k in ("targetQueuedTokens", "targetTTFTSeconds", "targetKVUsage",
                                        "targetITLSeconds"))),
)


def rules_for(scope: Scope) -> list[Rule]:
    return [r for r in RULES if r.scope is scope]


def _targets(obj: Mapping[str, Any]) -> list[tuple[str, Scope, Any]]:
    """(path, scope, value) for every place a rule applies in a defaulted object."""
    spec = obj.get("spec", {})
    out: list[tuple[str, Scope, Any]] = [("", Scope.ROOT, obj), ("spec", Scope.SPEC, spec)]
    if "model" in spec:
        out.append(("spec.model", Scope.MODEL, spec["model"]))
    for key in ("prefill", "decode", "engine"):
        if key in spec:
            out.append((f"spec.{key}", Scope.ROLE, spec[key]))
            out.append((f"spec.{key}.extraArgs", Scope.ENGINE_ARGS, spec[key].get("extraArgs", [])))
            out += [(f"spec.{key}.env", Scope.ENV_VAR, e) for e in spec[key].get("env", [])]
    router = spec.get("router", {})
    out.append(("spec.router.extraArgs", Scope.ROUTER_ARGS, router.get("extraArgs", [])))
    out += [("spec.router.env", Scope.ENV_VAR, e) for e in router.get("env", [])]
    if "kvTransfer" in spec:
        out.append(("spec.kvTransfer", Scope.KV_TRANSFER, spec["kvTransfer"]))
    if "autoscaling" in spec:
        out.append(("spec.autoscaling", Scope.AUTOSCALING, spec["autoscaling"]))
        out += [(f"spec.autoscaling.{k}", Scope.AUTOSCALING_ROLE, spec["autoscaling"][k])
                for k in ("prefill", "decode", "engine") if k in spec["autoscaling"]]
    return out


def validate(obj: Mapping[str, Any]) -> list[str]:
    """Messages of every rule the (defaulted) object breaks, each prefixed with where it broke."""
    errors = []
    for path, scope, value in _targets(obj):
        for rule in rules_for(scope):
            if not rule.check(value):
                errors.append(f"{path or 'metadata.name'}: {rule.message}")
    return errors
