"""Structured output (grammar-constrained decoding)."""
