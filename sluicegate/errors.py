"""One error hierarchy for the platform. Messages name the field or thing, the value, and the fix."""

from __future__ import annotations

from serving.redact import mask_text


class SluicegateError(Exception):
    """Root of every error the platform raises on purpose. Its message is masked (URL passwords, secret
    query values) when it is made: errors end up in logs, Prefect state messages and CLI output."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(mask_text(arg) if isinstance(arg, str) else arg for arg in args))


class ConfigError(SluicegateError):
    """A setting or argument is wrong; the message names it and says how to fix it."""


class StoreUnavailable(SluicegateError):
    """The metadata store cannot be reached (the message names the URL, password redacted)."""


class SchemaOutdated(SluicegateError):
    """The metadata store's schema is older (or newer) than this code expects."""


class DatasetError(SluicegateError):
    """A dataset version does not follow the contract (manifest, listed objects)."""


class StorageError(SluicegateError):
    """The object store refused or could not serve a request."""


class EventError(SluicegateError):
    """An incoming S3 event message cannot be understood."""


class StackError(SluicegateError):
    """A part of the embedded stack failed to start, stay up or stop."""


class GateFailed(SluicegateError):
    """A gate's verdict was negative; the message names each failed check and its observed value."""


class RegistryError(SluicegateError):
    """A model version or alias cannot be found or moved; the message names it and the fix."""
