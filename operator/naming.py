"""Names, labels, ports and annotations shared by the CRD, the builders and the handlers.

These are contracts: the router selects engine pods by ROLE_LABEL/SERVICE_LABEL, sglang-router reads
BOOTSTRAP_PORT_ANNOTATION, and the operator finds its children by `child_name`.
"""
from __future__ import annotations

import enum
import hashlib

GROUP = "baton.dev"
VERSION = "v1alpha1"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
KIND = "InferenceService"
SHORT_NAMES = ("bisvc",)  # not "isvc": KServe's InferenceService has it
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"

OPERATOR_NAME = "baton-operator"
FIELD_MANAGER = OPERATOR_NAME

# Labels the router selects on (`--prefill-selector` etc.) and the operator's event handlers filter on.
SERVICE_LABEL = f"{GROUP}/inference-service"
ROLE_LABEL = f"{GROUP}/role"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"

# Annotations.
BOOTSTRAP_PORT_ANNOTATION = "sglang.ai/bootstrap-port"  # read by sglang-router and our router
SPEC_HASH_ANNOTATION = f"{GROUP}/spec-hash"  # hash of the desired child; a change means "patch it"
# On a Deployment whose replicas an HPA or KEDA sets (spec.autoscaling.mode external), or the planner
# (mode planner): reconciles set replicas when they create it, and never again.
REPLICAS_ANNOTATION = f"{GROUP}/replicas"
EXTERNAL_REPLICAS = "external"
PLANNER_REPLICAS = "planner"  # spec.autoscaling.mode planner: the operator's planner sets them
KOPF_PREFIX = GROUP  # kopf's progress/diff-base annotations live under this prefix

# Ports (fixed inside the pod; the router Service port is configurable).
ENGINE_PORT = 30000
ROUTER_PORT = 8000
DEFAULT_BOOTSTRAP_PORT = 8998

# Names the operator reserves in a namespace for one InferenceService: NAME + longest suffix <= 63.
MAX_NAME_LENGTH = 45
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"  # Secret and PersistentVolumeClaim names
# Where engine pods see the model cache an hf:// or s3:// source is fetched into (the model in a folder
# under it named by the source), and where a pvc:// source's claim is mounted unless spec.model.path says.
MODEL_CACHE_MOUNT = "/model-cache"
PVC_MODEL_MOUNT = "/models/model"
FETCH_CONTAINER = "fetch-model"  # the init container's name (the status reads its state)
INTERNAL_KEY_FIELD = "api-key"  # the key of the internal key Secret's one entry


class Role(str, enum.Enum):
    """A Deployment of one InferenceService. The value is the `baton.dev/role` label."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    ROUTER = "router"

    @property
    def suffix(self) -> str:
        """Child-name suffix: the colocated engine is `NAME-engine`, the others `NAME-ROLE`."""
        return "engine" if self is Role.COLOCATED else self.value

    @property
    def spec_key(self) -> str:
        """Where the role is configured in the InferenceService spec."""
        return "engine" if self is Role.COLOCATED else self.value


ENGINE_ROLES = (Role.PREFILL, Role.DECODE, Role.COLOCATED)


def child_name(service: str, role: Role) -> str:
    return f"{service}-{role.suffix}"


def selector_labels(service: str, role: Role) -> dict[str, str]:
    """The immutable Deployment selector and the router's discovery selector for one role."""
    return {SERVICE_LABEL: service, ROLE_LABEL: role.value}


def common_labels(service: str, role: Role | None = None) -> dict[str, str]:
    """Kubernetes' recommended labels plus ours, on every child object and pod."""
    labels = {
        "app.kubernetes.io/name": "baton",
        "app.kubernetes.io/instance": service,
        "app.kubernetes.io/part-of": "baton",
        MANAGED_BY_LABEL: OPERATOR_NAME,
        SERVICE_LABEL: service,
    }
    if role is not None:
        labels["app.kubernetes.io/component"] = role.suffix
        labels[ROLE_LABEL] = role.value
    return labels


def engine_network_policy(service: str) -> str:
    return f"{service}-engines"


def internal_key_secret(service: str, uid: str) -> str:
    """The Secret of the key the router and the engines share. The operator only creates Secrets (it may not
    read them), so the name carries the owner's uid: a service deleted and created again under the same name
    never takes its predecessor's Secret, still there until garbage collection, for its own."""
    assert uid, "an InferenceService read back from the API server has a uid"
    return f"{service}-internal-key-{uid[:8]}"


def router_service_host(service: str, namespace: str) -> str:
    return f"{child_name(service, Role.ROUTER)}.{namespace}.svc"


def model_config(service: str) -> str:
    """The ConfigMap of the model version the engines serve (spec.model.updateStrategy InPlace)."""
    return f"{service}-model"


def weights_job(service: str, source_uri: str) -> str:
    """The Job that fetches one source and updates the engines to it: one name per source, so a spec
    changed back and forth finds the Job it already ran."""
    return f"{service}-weights-{hashlib.sha256(source_uri.encode()).hexdigest()[:8]}"
