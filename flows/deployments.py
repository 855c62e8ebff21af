"""Serve the deployments of prefect.yaml from one runner process (the embedded stack's worker).

Reading prefect.yaml keeps one definition of triggers and schedules for both `prefect deploy`
(work pools, production) and `sluicegate up` (a local runner).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from sluicegate.errors import ConfigError
from sluicegate.settings import Settings

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

PREFECT_YAML = Path(__file__).resolve().parent.parent / "prefect.yaml"


def load_spec(path: Path = PREFECT_YAML) -> list[dict[str, Any]]:
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read deployments from {path}: {exc}") from exc
    deployments = document.get("deployments") if isinstance(document, dict) else None
    if not isinstance(deployments, list) or not deployments:
        raise ConfigError(f"{path} has no 'deployments' list")
    return deployments


def _flow(entrypoint: str) -> Any:
    """``flows/pipeline.py:pipeline`` -> the flow object, imported as a module (works installed too)."""
    file, _, name = entrypoint.partition(":")
    module = file.removesuffix(".py").replace("/", ".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"deployment entrypoint {entrypoint!r} does not name a flow: {exc}") from exc


def runner_deployments(settings: Settings, path: Path = PREFECT_YAML) -> list[RunnerDeployment]:
    from prefect.events import DeploymentEventTrigger
    from prefect.schedules import Cron
    from prefect.types.entrypoint import EntrypointType

    built = []
    for spec in load_spec(path):
        triggers = [
            DeploymentEventTrigger(**{k: v for k, v in trigger.items() if k != "type"})
            for trigger in spec.get("triggers", [])
            if trigger.get("type", "event") == "event"
        ]
        schedules = []
        for schedule in spec.get("schedules", []):
            cron = schedule.get("cron")
            if cron is None:
                raise ConfigError(f"deployment {spec['name']!r}: only cron schedules are served locally")
            if spec["name"] == "scheduled-retrain" and settings.retrain.cron:
                schedules.append(Cron(settings.retrain.cron, timezone=settings.retrain.timezone))
            else:
                schedules.append(Cron(cron, timezone=schedule.get("timezone", "UTC")))
        built.append(
            _flow(spec["entrypoint"]).to_deployment(
                name=spec["name"],
                description=spec.get("description"),
                tags=spec.get("tags"),
                triggers=triggers,
                schedules=schedules,
                entrypoint_type=EntrypointType.MODULE_PATH,
            )
        )
    return built


def serve(settings: Settings) -> None:
    """Serve every deployment until interrupted, starting runs warm unless ``prefect.runner_warm`` is off."""
    deployments = runner_deployments(settings)
    p = settings.prefect
    if p.runner_warm:
        from flows.warm_runner import serve_warm

        serve_warm(deployments, poll_seconds=p.runner_poll_seconds, limit=p.runner_limit, preload=p.runner_preload)
        return
    import prefect

    prefect.serve(*deployments, print_starting_message=False, query_seconds=p.runner_poll_seconds, limit=p.runner_limit)


def main() -> None:
    """``python -m flows.deployments``: the embedded stack's runner process.

    Its own small main module rather than the CLI: the warm runner's forkserver imports the parent's
    main module once more, and the CLI's imports (typer, rich) would be paid again for nothing.
    """
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    serve(Settings())


if __name__ == "__main__":
    main()
