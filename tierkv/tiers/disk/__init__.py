"""The disk tier: ``opener.py`` (:func:`open_disk`, the one way to open one), ``tier.py``
(:class:`DiskTier`), its directory layout (``layout.py``),
format, files, environments, slabs, write path, budget, and its tools' view (``tools.py``:
what ``tierkv inspect / verify / rm`` need of a store root). Import from the modules."""
