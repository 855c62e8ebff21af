"""What every `sluicegate` command module shares: the console and reading the settings once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import typer
from rich.console import Console

from serving.errors import ServingError
from sluicegate.errors import SluicegateError
from sluicegate.settings import Settings

console = Console()


def load_settings() -> Settings:
    """The settings for this command; invalid ones end it with pydantic's message (field, value)."""
    try:
        return Settings()
    except Exception as exc:
        console.print(f"[red]invalid settings:[/red] {exc}")
        raise typer.Exit(2) from exc


@contextlib.contextmanager
def cli_errors(*also: type[Exception]) -> Iterator[None]:
    """Our errors (and ``also``) end the command with their message and exit code 1, not a traceback.

    ``ServingError`` counts as ours: the model repository format lives in ``serving/`` (the server may not
    import the pipeline), so a damaged version reaches commands as a ``serving.errors.RepositoryError``.
    """
    caught: tuple[type[Exception], ...] = (SluicegateError, ServingError, *also)
    try:
        yield
    except caught as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(1) from exc
