"""Transfer engines move bytes: GPU <-> CPU slab (CUDA or CPU fallback) and slab <-> disk."""
