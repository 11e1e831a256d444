"""PodDisruptionBudgets: one per role, so a drain or a node upgrade takes few pods of a role at once."""
from __future__ import annotations

from typing import Any

from baton.operator import naming
from baton.operator.builders.common import metadata
from baton.operator.naming import Role
from baton.operator.spec import InferenceService


def disruption_budget(isvc: InferenceService, role: Role) -> dict[str, Any]:
    """At most the role's `disruptionBudget.maxUnavailable` pods evicted at a time (default 1)."""
    spec = isvc.spec.router if role is Role.ROUTER else isvc.spec.roles[role]
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": metadata(isvc, naming.child_name(isvc.name, role), role),
        "spec": {"maxUnavailable": spec.max_unavailable,
                 "selector": {"matchLabels": naming.selector_labels(isvc.name, role)},
                 # a pod that is not Ready (loading, crash-looping) serves nothing: evicting it costs
                 # nothing, and counting it would block every drain
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"},
    }
