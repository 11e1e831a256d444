"""Mooncake Transfer Engine backend (RDMA in production, TCP on CPU machines and in CI)."""
