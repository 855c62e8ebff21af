"""The serving model repository format, as the pipeline sees it.

The format itself (``<repo>/<model>/<version>/`` with model files, ``config.json`` and ``SHA256SUMS``)
lives in ``serving/model_format.py``: the server reads it and may import nothing from ``tasks/``, while the
pipeline may import from ``serving/``. This module keeps the names pipeline code and tests already use.
``RepositoryError`` is a ``serving.errors.ServingError``, not a ``SluicegateError``: CLI code catches both
(``sluicegate.cli_common.cli_errors``).
"""

from __future__ import annotations

from serving.errors import RepositoryError
from serving.model_format import (
    CONFIG,
    CONFIG_FORMAT,
    DEFAULT_BATCHING,
    PICKLE_SUFFIXES,
    PLATFORMS,
    SUMS,
    ModelConfig,
    pickle_refusal,
    read_config,
    sha256_file,
    verify_version,
    write_version,
)

__all__ = [
    "CONFIG",
    "CONFIG_FORMAT",
    "DEFAULT_BATCHING",
    "PICKLE_SUFFIXES",
    "PLATFORMS",
    "SUMS",
    "ModelConfig",
    "RepositoryError",
    "pickle_refusal",
    "read_config",
    "sha256_file",
    "verify_version",
    "write_version",
]
