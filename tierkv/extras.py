"""The optional parts of tierkv and the extra that installs each (``pip install
'tierkv-cache[NAME]'``): :func:`needs` turns a missing module into a :class:`MissingExtraError`
that names the extra, instead of a bare ``ModuleNotFoundError``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tierkv import DISTRIBUTION
from tierkv.errors import MissingExtraError

# The modules each extra brings (pyproject.toml, [project.optional-dependencies]).
EXTRAS = {
    "warmup": ("transformers", "aiofiles", "tqdm"),
    "remote": ("redis", "hiredis"),
    "vllm": ("vllm",),
    "metrics": ("prometheus_client",),
    "config": ("yaml",),
}


@contextlib.contextmanager
def needs(extra: str, what: str) -> Iterator[None]:
    """Imports inside the block that fail for a module of ``extra`` raise
    :class:`MissingExtraError`: ``{what} needs the '{extra}' extra: pip install ...``."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in EXTRAS[extra]:
            raise
        raise MissingExtraError(
            f"{what} needs the {extra!r} extra (module {missing!r} is not installed): "
            f"pip install '{DISTRIBUTION}[{extra}]'") from exc
