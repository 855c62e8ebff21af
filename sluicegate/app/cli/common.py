"""What every `sluicegate` command module shares: the console and reading the settings once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import Annotated

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


ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Registered model name; default: SLUICEGATE_MODEL__NAME, else the only model in the registry.",
    ),
]


def dataset_name_of(location: str, datasets_prefix: str) -> str:
    """The dataset a location holds: ``<name>`` of ``s3://bucket/<prefix><name>/<version>/``, else the
    folder's own name (a local copy is usually named after its dataset)."""
    if location.startswith("s3://"):
        key = location[5:].partition("/")[2]
        if key.startswith(datasets_prefix) and key[len(datasets_prefix) :].strip("/"):
            return key[len(datasets_prefix) :].split("/")[0]
    return PurePosixPath(location.rstrip("/")).name or "dataset"


def settings_for_location(settings: Settings, location: str, model: str | None) -> Settings:
    """The settings of the model a command on ``location`` works for: ``--model``, else the model the
    location's dataset trains (its spec's, or its own name)."""
    from sluicegate import model_specs

    with cli_errors():
        if model is not None:
            return model_specs.settings_for_model(settings, model)
        choice = model_specs.model_for_dataset(settings, dataset_name_of(location, settings.storage.datasets_prefix))
        return model_specs.settings_for_model(settings, choice.name, choice.spec)


def resolve_model(settings: Settings, model: str | None) -> Settings:
    """The settings of the model a command names: ``--model``, else ``model.name``, else the only model
    registered in MLflow; with several and none named, the command stops and lists them."""
    from sluicegate import model_specs

    name = model or settings.model.name
    if not name:
        from tasks import registry

        with cli_errors():
            names = registry.model_names(settings.mlflow.url)
        if len(names) != 1:
            listed = ", ".join(names) if names else "none yet"
            console.print(f"[red]error:[/red] name the model with --model (registered models: {listed})")
            raise typer.Exit(2)
        name = names[0]
    with cli_errors():
        return model_specs.settings_for_model(settings, name)
