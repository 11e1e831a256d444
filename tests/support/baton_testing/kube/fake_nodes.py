"""The fake nodes of the e2e control plane: kwok keeps them Ready and runs their pods (no kubelet).

A CPU node, and a GPU node shaped like the one `manifests/samples/gpu-rdma.yaml` asks for (GPU and RDMA
resources, the H100 product label, the `nvidia.com/gpu` taint), so every sample schedules as written.
"""
from __future__ import annotations

from typing import Any

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"


def fake_node(name: str, capacity: dict[str, str], labels: dict[str, str] | None = None,
              taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                     "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                "kubernetes.io/arch": "amd64", "type": "kwok", **(labels or {})}},
        "spec": {"taints": taints or []},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


FAKE_NODES = [
    fake_node("kwok-cpu-0", {"cpu": "64", "memory": "256Gi", "pods": "110"}),
    fake_node("kwok-gpu-0", {"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": "8",
                             "rdma/hca_shared_devices_a": "64"},
              labels={"nvidia.com/gpu.product": GPU_PRODUCT},
              taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]),
]
