"""Reliability and safety suite: crash, corruption, full disk, concurrency, bad config, security (docs/reliability.md)."""
