"""Orchestration: the one-process library store, the engine adapter and the worker adapter."""
