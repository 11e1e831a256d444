"""Test harness for the operator: an emulated API server, a real control plane, and a cluster facade.

Used by tests/operator and tests/e2e. The facade hides whether the API is emulated (kmock) or a real
control plane (a kubeconfig, e.g. one `controlplane.py` started: etcd, kube-apiserver, controllers, kwok),
so the same tests run against both.
"""
