"""Tiers hold bytes: ``cpu.py`` (the pinned CPU slab, one module), ``disk/`` (the disk
tier: LMDB index over slab files), ``remote/`` (Redis / Valkey). ``base.py`` is the
interface below the CPU tier; ``tuning.py`` (sizing, malloc) is shared."""
