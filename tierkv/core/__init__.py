"""Pure bookkeeping: no torch, no lmdb, no threads. Property-tested against a dict model."""
