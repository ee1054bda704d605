"""The error tree of tierkv.

Backpressure is a value ("no room" is counted, never raised); failure is an exception.
Every message names the tier, the chunk key (short hex) where there is one, and the
setting to change.

A bad setting is a :class:`ConfigError`; a call made wrongly by a program (an argument of
the wrong kind, size or range, a job completed twice, an unknown policy name given to the
index) is a :class:`UsageError`, as is a call the object does not support at that moment
(from a forked child, from two threads at once). Both change nothing.
"""

from __future__ import annotations


class TierKVError(Exception):
    """Root of every error tierkv raises on purpose."""


class ConfigError(TierKVError, ValueError):
    """A setting has a bad value; the message names the setting and the value. Not for a
    program's calls made wrongly: those are :class:`UsageError`."""


class ClosedError(TierKVError):
    """The store, tier or engine was closed by its owner and used afterwards."""


class BrokenError(TierKVError):
    """A device, disk or thread underneath failed; the component cannot go on."""


class DamagedError(BrokenError):
    """An environment's files are damaged and this handle may not repair them (read-only
    checks, or another process owns the environment)."""


class UsageError(TierKVError):
    """Misuse: a call made wrongly by a program (bad keys, block ids, buffers or job ids;
    a job completed twice), or one the object does not support (from a forked child, from
    two threads at once); nothing was changed."""


class InvariantError(TierKVError):
    """An internal invariant does not hold (``BlockIndex.check()``, a policy's ``check()``):
    a bug in tierkv, raised rather than asserted so that ``python -O`` keeps the check."""


class TransferError(TierKVError):
    """A copy between tiers failed."""


class UnknownJobError(TransferError):
    """A wait on a job id that was never submitted: the race tierkv exists to prevent (a
    flush waiting on a store that was never started). Submit before waiting."""


class JobTimeoutError(TransferError, TimeoutError):
    """A wait whose timeout expired before its jobs finished."""


class NamespaceMismatchError(TierKVError):
    """Persistent data was written under another namespace (model, layout, format)."""


class MisplacedError(DamagedError, NamespaceMismatchError):
    """An environment holds another namespace's or part's chunks (a directory copied,
    swapped or restored to the wrong place) and this handle may not move it aside
    (read-only, or another process claims it). It is a :class:`DamagedError` too, so
    whatever skips a damaged part (the vLLM start-up scan, the readers of another TP size's
    parts) skips a misplaced one the same way, with a warning, never a crash."""


def short_key(key: bytes) -> str:
    """The first 8 hex digits of a key, as messages print it."""
    return key[:4].hex()


class MissingExtraError(TierKVError, ImportError):
    """An optional part of tierkv was used without the extra that installs it."""


class ForeignInstallError(TierKVError, ImportError):
    """Another distribution (the unrelated PyPI project ``tierkv``) installed files under
    this package's import name: the installation may be a mix of both."""
