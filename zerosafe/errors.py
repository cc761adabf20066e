"""The error types zerosafe raises for problems a user can fix.

Every error that reaches a user names the file, what was expected, what was found and what
to do. Plain programming mistakes (a wrong argument type) raise plain builtins instead.
"""

from __future__ import annotations

__all__ = [
    "CheckpointFormatError",
    "ConfigError",
    "ConversionError",
    "IntegrityError",
    "LayoutMismatchError",
    "OutputExistsError",
    "StorageError",
    "UnsafePickleError",
    "UnsupportedCheckpointError",
    "VerificationError",
]


class ConversionError(Exception):
    """Base of every error zerosafe raises on purpose; the CLI prints it as one line, exit 2."""


class CheckpointFormatError(ConversionError, ValueError):
    """The input is unreadable, truncated, or not the kind of file it should be."""

    lists_formats = False
    """Set on the error for a folder that holds no checkpoint of the format read: a reader
    knows only its own format, so the registry, which knows them all, ends the message with
    what each holds (`zerosafe.formats.registry.formats_listed`)."""


class UnsupportedCheckpointError(CheckpointFormatError):
    """A real checkpoint layout that zerosafe does not convert yet (TP/PP, MoE, ZeRO-0...)."""


class UnsafePickleError(CheckpointFormatError):
    """A pickle asks for a global outside the allowlist: it could run code, so it is refused."""


class LayoutMismatchError(ConversionError, ValueError):
    """Element counts, paddings or world sizes disagree between files or with the metadata."""


class IntegrityError(ConversionError):
    """Bytes read do not match a recorded checksum (zip CRC32, intermediate hash, manifest)."""


class ConfigError(ConversionError, ValueError):
    """An option or a combination of options is invalid."""


class OutputExistsError(ConversionError, FileExistsError):
    """The destination already holds output that this run would replace."""


class StorageError(ConversionError, OSError):
    """A storage operation failed for a reason the user must fix (permissions, no space...)."""


class VerificationError(ConversionError):
    """A written output failed a check (checksum, header, finiteness, coverage)."""

    def __init__(self, message: str, failures: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or []

    def __reduce__(self) -> tuple[object, ...]:  # raised in a worker process, re-raised here
        return (type(self), (str(self), self.failures))
