"""What every `sluicegate` command module shares: the console and reading the settings once."""

from __future__ import annotations

import typer
from rich.console import Console

from sluicegate.settings import Settings

console = Console()


def load_settings() -> Settings:
    """The settings for this command; invalid ones end it with pydantic's message (field, value)."""
    try:
        return Settings()
    except Exception as exc:
        console.print(f"[red]invalid settings:[/red] {exc}")
        raise typer.Exit(2) from exc
