"""Test harness for the operator: an emulated API server and a cluster facade.

Used by tests/operator and usable by e2e. The facade hides whether the API is emulated (kmock) or a
real control plane (a kubeconfig), so the same tests run against both.
"""
