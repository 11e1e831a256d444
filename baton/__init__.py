"""Baton: LLM serving with prefill/decode disaggregation on Kubernetes."""

__version__ = "0.1.0"
