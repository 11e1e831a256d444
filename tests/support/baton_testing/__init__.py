"""Test doubles and harnesses for Baton's tests; kept with the tests, never shipped in the package.

tests/conftest.py puts tests/support on sys.path, so tests import `baton_testing.<module>`:
- `fake_kv_transfer.py` — the in-process KV transfer backend (`--disaggregation-transfer-backend fake`,
  registered under that name by importing it: tests/engine/conftest.py does);
- `kube/` — the operator's harness: an emulated API server, a real control plane, a cluster facade.
"""
