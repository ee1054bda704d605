"""Adapters for inference engines (vLLM)."""
