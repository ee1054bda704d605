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
            f"{install_hint(extra)}") from exc


def install_hint(extra: str) -> str:
    """How to install ``extra`` where tierkv came from: a checkout (``pip install
    '/path/to/checkout[remote]'``; no release of it need exist) or an index
    (``pip install 'tierkv-cache[remote]'``), and the extra's modules by name."""
    import json
    from importlib import metadata
    from urllib.parse import unquote, urlsplit

    source = DISTRIBUTION
    try:
        direct = json.loads(metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
                            or "{}")
    except (metadata.PackageNotFoundError, ValueError, OSError):
        direct = {}
    url = direct.get("url", "") if isinstance(direct, dict) else ""
    if url.startswith("file://") and "dir_info" in direct:  # installed from a checkout
        source = unquote(urlsplit(url).path)
    return (f"pip install '{source}[{extra}]' (or its modules: pip install "
            f"{' '.join(EXTRAS[extra])})")
