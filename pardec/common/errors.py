"""The project's error types, each defined once. Every message names the offending key, file,
row or value, so a user can act on it without a traceback."""

from __future__ import annotations


class PardecError(Exception):
    """Base of every error pardec raises on bad input (catch this to report any of them)."""


class ConfigError(PardecError, ValueError):
    """A configuration key or value is invalid; the message names it (``trainer.lr``, ``decoder.tau``)."""


class DataError(PardecError, ValueError):
    """Bad data input; the message names the file, split, row or field."""


class CheckpointError(PardecError, RuntimeError):
    """A checkpoint (training state or HF export) is missing, unreadable or inconsistent; the
    message names the file or the metadata key."""


class ChecksumError(PardecError, ValueError):
    """A file's sha256 is not the one recorded for it; the message names the file, the expected and the
    actual digest."""


class UnsupportedModelError(CheckpointError):
    """A checkpoint of an architecture the installed transformers cannot read (e.g. a GGUF file of an
    architecture it has no converter for); the message names the file and the architecture."""
