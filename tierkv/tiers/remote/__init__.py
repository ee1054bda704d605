"""The remote tier (Redis / Valkey, standalone or Cluster): ``tier.py`` (:class:`RemoteTier`),
its values (``format.py``), client and health, its I/O (``pushes.py``: write-behind;
``lookup.py``: the scheduler side's questions;
``usage.py``: the servers' memory for the capacity gauges) and its tools' view (``tools.py``).
Import from the modules."""
