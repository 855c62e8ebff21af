"""`sluicegate lineage REF`: where a model version, a served request or a dataset version came from, and
what became of it. The walk is ``tasks/lineage/walk.py``; the tree and JSON are ``lineage_view.py`` beside this."""

from __future__ import annotations

import enum
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from sluicegate.app.cli.common import cli_errors, console, load_settings

if TYPE_CHECKING:
    from tasks.lineage.walk import LogQuery


class RefKind(enum.StrEnum):
    auto = "auto"
    model = "model"
    data = "data"
    request = "request"


RefArgument = Annotated[
    str,
    typer.Argument(
        metavar="MODEL_VERSION|REQUEST_ID|DATA_VERSION",
        help="A model version (vX.Y.Z-commit7-data7, a unique prefix, a registry number or alias), "
        "a request id from the server's request log, or a data version (7-64 hex).",
    ),
]
LogsOption = Annotated[
    list[str] | None,
    typer.Option(
        "--logs",
        help="Request log to search for a request id, besides <home>/logs/serving*: a file, a folder "
        "(its files) or - for stdin (kubectl logs deploy/pcb-stable | sluicegate lineage REQ --logs -). "
        "Repeatable.",
    ),
]


def lineage_command(
    ref: RefArgument,
    logs: LogsOption = None,
    objects: Annotated[bool, typer.Option("--objects", help="List every S3 object of the dataset version.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of a tree.")] = False,
    kind: Annotated[RefKind, typer.Option(help="Read REF as this kind only (default: detect).")] = RefKind.auto,
) -> None:
    """Walk lineage both ways: request -> model version -> pipeline run -> MLflow run -> dataset version ->
    S3 objects, code and environment; and up to deployments, alias moves and gate results. From a data
    version: every run that used it and every model trained on it, and how their rollouts ended."""
    from sluicegate.app.cli.lineage_view import dumps, tree
    from sluicegate.metadata import MetadataStore
    from tasks.lineage import walk

    settings = load_settings()
    with cli_errors():
        query = _log_query(settings.home / "logs", logs or [])
        state, tracker = walk.connect_mlflow(settings.mlflow.url)
        with MetadataStore.checked(settings.metadata_url) as store, store.session() as session:
            found = walk.walk(
                session,
                ref,
                mlflow=state,
                tracker=tracker,
                model_name=settings.model.name,
                logs=query,
                kind=kind.value,
                with_objects=objects,
            )
    if as_json:
        typer.echo(dumps(found))
        return
    console.print(tree(found))


def _log_query(logs_dir: Path, extra: list[str]) -> LogQuery:
    """The default server logs plus ``--logs``; a missing path ends the command with its name."""
    from sluicegate.errors import ConfigError
    from tasks.lineage import walk
    from tasks.lineage.request_logs import STDIN, default_log_files, expand

    try:
        given = expand([Path(p) for p in extra if p != STDIN])
    except FileNotFoundError as exc:
        raise ConfigError(f"--logs: {exc}; give an existing file or folder, or - for stdin") from exc
    files = [*default_log_files(logs_dir), *given]
    stream = sys.stdin if STDIN in extra else None
    return walk.LogQuery(tuple(dict.fromkeys(files)), stream)
