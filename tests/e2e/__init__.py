"""End-to-end tests on a real control plane (see docs/e2e.md)."""
