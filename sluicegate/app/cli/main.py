"""The `sluicegate` command line (typer). Settings are read here, once, and passed down."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from sluicegate.app.cli.common import cli_errors, console, load_settings
from sluicegate.app.cli.data import check_app, dataset_app
from sluicegate.app.cli.lineage import lineage_command
from sluicegate.app.cli.models import models_app
from sluicegate.app.cli.rollout import rollout_app
from sluicegate.app.cli.train import train_command
from sluicegate.settings import Settings

if TYPE_CHECKING:
    from sluicegate.metadata import MetadataStore

app = typer.Typer(no_args_is_help=True, help="sluicegate: a dataset lands in S3, a better model serves traffic.")
db_app = typer.Typer(no_args_is_help=True, help="The metadata store's schema.")
storage_app = typer.Typer(no_args_is_help=True, help="The object store and its event queue.")
app.add_typer(db_app, name="db")
app.add_typer(storage_app, name="storage")
app.add_typer(dataset_app, name="dataset")
app.add_typer(check_app, name="check")
app.add_typer(models_app, name="models")
app.add_typer(rollout_app, name="rollout")
app.command("train")(train_command)
app.command("lineage")(lineage_command)


def _configure_logging(level: int = logging.INFO) -> None:
    from serving.redact import install_log_masking

    install_log_masking()
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per HTTP request (the runner polls every second) drowns what matters.
    logging.getLogger("httpx").setLevel(logging.WARNING)


@app.command()
def up() -> None:
    """Start the embedded stack (a no-op when it is already running) and print its URLs."""
    from sluicegate.app import stack

    settings = load_settings()
    seen: set[str] = set()

    def progress(state: stack.StackState) -> None:
        for name, part in state.parts.items():
            if part.status == stack.READY and name not in seen:
                seen.add(name)
                console.print(f"  [green]ready[/green] {name:8} {part.url}")

    with cli_errors(), console.status("starting the embedded stack..."):
        state, started = stack.up(settings, progress)
    if not started:
        console.print("the stack is already running")
    _print_urls(settings, state)


def _print_urls(settings: Settings, state: object) -> None:
    table = Table(title="sluicegate stack")
    table.add_column("service")
    table.add_column("where")
    table.add_column("run by")
    rows = [
        ("S3 + SQS", settings.storage.url, "embedded" if settings.storage.embedded else "external"),
        (
            "Prefect UI/API",
            settings.prefect.url.removesuffix("/api"),
            "embedded" if settings.prefect.embedded else "external",
        ),
        ("MLflow", settings.mlflow.url, "embedded" if settings.mlflow.embedded else "external"),
        ("metadata store", _redact(settings.metadata_url), "file" if settings.metadata.url is None else "external"),
        ("event webhook", f"http://127.0.0.1:{settings.events.webhook_port}/events", "embedded"),
        ("logs", str(settings.home / "logs"), ""),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _redact(url: str) -> str:
    from serving.redact import mask_url

    return mask_url(url)


@app.command()
def status() -> None:
    """Each part of the embedded stack: process, health, restarts."""
    from sluicegate.app import stack

    settings = load_settings()
    overall, rows = stack.status(settings)
    table = Table(title=f"sluicegate stack: {overall}")
    for column in ("part", "pid", "process", "health", "restarts", "url"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row.name,
            str(row.pid or "-"),
            "running" if row.running else "[red]not running[/red]",
            "[green]healthy[/green]" if row.healthy else "[red]unhealthy[/red]",
            str(row.restarts),
            row.url,
        )
    console.print(table)
    if overall != stack.READY:
        raise typer.Exit(1)


@app.command()
def down() -> None:
    """Stop the embedded stack and every process it started."""
    from sluicegate.app import stack

    settings = load_settings()
    with console.status("stopping..."):
        killed = stack.down(settings)
    if killed:
        console.print(f"killed leftover processes: {killed}")
    console.print("the stack is stopped")


@app.command()
def serve(
    repo: Annotated[str, typer.Option(help="Model repository: PATH, s3://bucket/prefix or models:/<name>@<alias>.")],
    grpc_port: Annotated[int | None, typer.Option(help="KServe V2 gRPC port.")] = None,
    http_port: Annotated[int | None, typer.Option(help="Health, metrics, REST and admin port.")] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
) -> None:
    """Serve every model in a repository over KServe V2 gRPC (the same as `python -m serving`)."""
    from serving.server import main as serve_main

    argv = ["--repo", repo]
    for flag, value in (("--grpc-port", grpc_port), ("--http-port", http_port), ("--host", host)):
        if value is not None:
            argv += [flag, str(value)]
    serve_main(argv)


@app.command()
def demo(
    stop_at_end: Annotated[bool, typer.Option(help="Stop the stack at the end (default: leave it up).")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each triggered pipeline run.")] = 900,
    first_images: Annotated[int, typer.Option(help="Images in the first dataset version.")] = 600,
    improved_images: Annotated[int, typer.Option(help="Images in the improved dataset version.")] = 1500,
) -> None:
    """The whole chain on the embedded stack: a first champion, a corrupt dataset stopped by the data gate,
    an improved one through the canary to champion under traffic; then a summary and the UI links."""
    from sluicegate.app.demo import run as demo_run

    with cli_errors():
        report = demo_run.run(
            load_settings(),
            console,
            steps=demo_run.default_steps(first_images, improved_images),
            stop_at_end=stop_at_end,
            timeout=timeout,
        )
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def config(
    markdown: Annotated[bool, typer.Option(help="Print every setting as the README's markdown table.")] = False,
) -> None:
    """Show the effective settings (secrets masked), or document them all with --markdown."""
    from sluicegate.settings import settings_markdown

    if markdown:
        typer.echo(settings_markdown())
        return
    from serving.redact import mask_text

    # SecretStr fields print as stars already; URLs with a password in them do not.
    console.print_json(mask_text(load_settings().model_dump_json()))


@app.command("stack-supervise", hidden=True)
def stack_supervise() -> None:
    """The detached supervisor process (started by `up`)."""
    from sluicegate.app import stack

    _configure_logging()
    raise typer.Exit(stack.supervise(load_settings()))


@app.command()
def bridge() -> None:
    """Run the S3 -> Prefect event bridge (SQS poller and webhook) in the foreground."""
    from flows.events import service

    _configure_logging()
    with cli_errors():
        service.serve(load_settings())


@app.command()
def runner() -> None:
    """Serve the deployments of prefect.yaml from this process (the embedded stack's worker)."""
    from flows import deployments

    _configure_logging()
    deployments.serve(load_settings())


@contextlib.contextmanager
def _store() -> Iterator[MetadataStore]:
    """The configured metadata store for one schema command (not checked: these fix the schema); its
    errors become a clean exit."""
    from sluicegate.metadata import MetadataStore

    with cli_errors(), MetadataStore.unchecked(load_settings().metadata_url) as store:
        yield store


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head") -> None:
    """Migrate the metadata store's schema (to the newest by default)."""
    with _store() as store:
        before = store.current_revision()
        store.upgrade(revision)
        console.print(f"{store.url_redacted}: {before or 'empty'} -> {store.current_revision()}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument(help="Target revision, e.g. -1 or base.")]) -> None:
    """Step the metadata store's schema back."""
    with _store() as store:
        store.downgrade(revision)
        console.print(f"{store.url_redacted}: now at {store.current_revision() or 'base'}")


@db_app.command("current")
def db_current() -> None:
    """Show the schema revision the store is at and the one this code expects; exit 1 if they differ."""
    with _store() as store:
        current, head = store.current_revision(), store.head_revision()
        console.print(f"{store.url_redacted}: at {current or 'empty'}, code expects {head}")
    if current != head:
        raise typer.Exit(1)


@storage_app.command("provision")
def storage_provision() -> None:
    """Create the bucket (versioned), the event queues and the bucket notification (idempotent)."""
    from sluicegate import storage

    with cli_errors():
        urls = storage.provision(load_settings())
    for name, url in urls.items():
        console.print(f"{name}: {url}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
