"""The MLflow model registry side of a model version: its files as run artifacts, a registered version
carrying the version tags (found again, not duplicated, when a crashed run is re-run), and the aliases
``champion`` and ``challenger`` (MLflow 3 has no stages), each move recorded in the metadata store."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluicegate.errors import RegistryError
from tasks import tracking

if TYPE_CHECKING:
    from sluicegate.metadata import AliasChange, MetadataStore

TAG_MODEL_VERSION = "sluicegate.model_version"
TAG_EVAL_GATE = "sluicegate.eval_gate"
# On registered models the pipeline made: the registry may hold other teams' models too.
TAG_MANAGED = "sluicegate.managed"
ARTIFACT_PATH = "model"
CHAMPION = "champion"
CHALLENGER = "challenger"


@dataclass(frozen=True)
class RegistryVersion:
    name: str
    registry_version: str
    model_version: str  # sluicegate's vX.Y.Z-<commit7>-<data7> ("" for versions registered by hand)
    run_id: str
    source: str
    aliases: tuple[str, ...]
    created_ms: int
    tags: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.name} {self.model_version or '(untagged)'} (registry v{self.registry_version})"


def _from_mlflow(version: Any) -> RegistryVersion:
    tags = dict(version.tags or {})
    return RegistryVersion(
        name=str(version.name),
        registry_version=str(version.version),
        model_version=tags.get(TAG_MODEL_VERSION, ""),
        run_id=str(version.run_id or ""),
        source=str(version.source or ""),
        aliases=tuple(sorted(version.aliases or ())),
        created_ms=int(version.creation_timestamp or 0),
        tags=tags,
    )


def find_version(tracking_uri: str, model_name: str, model_version: str) -> str | None:
    """The registry version number already carrying ``model_version``, if any."""
    client = tracking.client(tracking_uri)
    found = client.search_model_versions(f"name = '{model_name}' and tags.`{TAG_MODEL_VERSION}` = '{model_version}'")
    return str(found[0].version) if found else None


def register_version(
    tracking_uri: str, model_name: str, run_id: str, version_dir: Path, tags: Mapping[str, str]
) -> str:
    """Log the repository version folder under the run's ``model/`` and register it; returns the registry version.

    Idempotent: a version whose ``sluicegate.model_version`` tag is already registered is returned as is.
    """
    from mlflow.exceptions import MlflowException

    model_version = tags[TAG_MODEL_VERSION]
    existing = find_version(tracking_uri, model_name, model_version)
    if existing is not None:
        return existing
    client = tracking.client(tracking_uri)
    client.log_artifacts(run_id, str(version_dir), artifact_path=ARTIFACT_PATH)
    try:
        client.create_registered_model(
            model_name,
            tags={TAG_MANAGED: "true"},
            description="sluicegate: gated models from S3 dataset versions",
        )
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        # A model registered before the tag existed, or by hand: it becomes one of ours now.
        client.set_registered_model_tag(model_name, TAG_MANAGED, "true")
    artifact_uri = client.get_run(run_id).info.artifact_uri.rstrip("/")
    created = client.create_model_version(
        model_name,
        source=f"{artifact_uri}/{ARTIFACT_PATH}",
        run_id=run_id,
        tags=dict(tags),
        description=f"{model_version}",
    )
    return str(created.version)


@dataclass(frozen=True)
class ModelSummary:
    """A registered model of ours, for ``sluicegate models ls``."""

    name: str
    aliases: dict[str, str]  # alias -> registry version
    latest: str | None  # newest registry version
    updated_ms: int | None


def models(tracking_uri: str) -> list[ModelSummary]:
    """Every registered model the pipeline created (tag ``sluicegate.managed``), by name; other models
    sharing the registry are left out."""
    client = tracking.client(tracking_uri)
    found: list[ModelSummary] = []
    token = None
    while True:
        page = client.search_registered_models(f"tags.`{TAG_MANAGED}` = 'true'", max_results=200, page_token=token)
        for model in page:
            versions = [int(v.version) for v in model.latest_versions or []]
            found.append(
                ModelSummary(
                    model.name,
                    {alias: str(number) for alias, number in (model.aliases or {}).items()},
                    str(max(versions)) if versions else None,
                    model.last_updated_timestamp,
                )
            )
        token = page.token
        if not token:
            return sorted(found, key=lambda m: m.name)


def model_names(tracking_uri: str) -> list[str]:
    return [model.name for model in models(tracking_uri)]


def get_version(tracking_uri: str, model_name: str, registry_version: str) -> RegistryVersion:
    return _from_mlflow(tracking.client(tracking_uri).get_model_version(model_name, registry_version))


def list_versions(tracking_uri: str, model_name: str) -> list[RegistryVersion]:
    """Every registered version of ``model_name``, newest first (empty when the model does not exist)."""
    import dataclasses

    client = tracking.client(tracking_uri)
    found = [_from_mlflow(v) for v in client.search_model_versions(f"name = '{model_name}'")]
    if not found:
        return []
    # Search results leave aliases out (MLflow fills them in only on get): take them from the model.
    held: dict[str, list[str]] = {}
    for alias, number in (client.get_registered_model(model_name).aliases or {}).items():
        held.setdefault(str(number), []).append(alias)
    found = [dataclasses.replace(v, aliases=tuple(sorted(held.get(v.registry_version, ())))) for v in found]
    return sorted(found, key=lambda v: int(v.registry_version), reverse=True)


def alias_holder(tracking_uri: str, model_name: str, alias: str) -> RegistryVersion | None:
    """The version holding ``alias``, or None (no such alias, or no such model)."""
    from mlflow.exceptions import MlflowException

    try:
        version = tracking.client(tracking_uri).get_model_version_by_alias(model_name, alias)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise
    return _from_mlflow(version)


def resolve(tracking_uri: str, model_name: str, ref: str) -> RegistryVersion:
    """A version named by an operator: registry number (``3``), model version (``v1.0.0-ab12cd3-ef45678``
    or a unique prefix of one), or alias (``champion``, ``@champion``).

    Raises:
        RegistryError: nothing or more than one version matches; the message lists what exists.
    """
    ref = ref.strip()
    if ref.startswith("@") or ref in (CHAMPION, CHALLENGER):
        holder = alias_holder(tracking_uri, model_name, ref.lstrip("@"))
        if holder is None:
            raise RegistryError(f"no version of {model_name!r} holds the alias {ref.lstrip('@')!r}")
        return holder
    versions = list_versions(tracking_uri, model_name)
    if not versions:
        raise RegistryError(f"model {model_name!r} has no registered versions (check settings model.name)")
    matches = [v for v in versions if ref in (v.registry_version, v.model_version)]
    if not matches:
        matches = [v for v in versions if v.model_version and v.model_version.startswith(ref)]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(f"{v.registry_version}={v.model_version or '-'}" for v in versions[:10])
    problem = "matches several versions" if matches else "matches no version"
    raise RegistryError(
        f"{ref!r} {problem} of {model_name!r}; name one exactly (registry version or model version): {known}"
    )


def download_version(tracking_uri: str, version: RegistryVersion, destination: Path) -> Path:
    """Download a registered version's files into ``destination`` in the repository layout.

    Returns ``destination/<model>/<version>/`` (names from the version's ``config.json``), the folder
    ``verify_version`` checks; nothing is verified here.
    """
    import mlflow.artifacts

    from serving.model_format import read_config

    client = tracking.client(tracking_uri)
    uri = client.get_model_version_download_uri(version.name, version.registry_version)
    staging = destination / ".download"
    local = Path(
        mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(staging), tracking_uri=tracking_uri)
    )
    config = read_config(local)
    target = destination / config.name / config.version
    target.parent.mkdir(parents=True, exist_ok=True)
    local.rename(target)
    return target


def set_tags(tracking_uri: str, version: RegistryVersion, tags: Mapping[str, str]) -> None:
    client = tracking.client(tracking_uri)
    for key, value in tags.items():
        client.set_model_version_tag(version.name, version.registry_version, key, value)


def move_alias(
    tracking_uri: str,
    store: MetadataStore,
    target: RegistryVersion,
    alias: str,
    *,
    actor: str,
    reason: str,
    pipeline_run_id: int | None = None,
) -> AliasChange | None:
    """Point ``alias`` at ``target`` in MLflow and record the move (who, why, from what) in the store.

    A move to where the alias already points changes and records nothing (a re-run pipeline repeats
    its moves). If recording fails, the alias is put back, so MLflow never shows a move the store lacks.

    Returns:
        The recorded change, or None when nothing moved.
    """
    from sluicegate.metadata.model_versions import record_alias_change

    if not actor.strip() or not reason.strip():
        raise RegistryError("an alias move needs an actor and a reason (who moved it, and why)")
    client = tracking.client(tracking_uri)
    before = alias_holder(tracking_uri, target.name, alias)
    if before is not None and before.registry_version == target.registry_version:
        return None
    client.set_registered_model_alias(target.name, alias, target.registry_version)
    try:
        with store.session() as session:
            row = record_alias_change(
                session,
                model_name=target.name,
                alias=alias,
                registry_version=target.registry_version,
                model_version=target.model_version or None,
                previous_registry_version=None if before is None else before.registry_version,
                previous_model_version=None if before is None else (before.model_version or None),
                actor=actor,
                reason=reason,
                pipeline_run_id=pipeline_run_id,
            )
        return row  # loaded and detached: the session commits and closes, rows do not expire
    except BaseException:
        if before is None:
            client.delete_registered_model_alias(target.name, alias)
        else:
            client.set_registered_model_alias(target.name, alias, before.registry_version)
        raise


def rollback_target(tracking_uri: str, store: MetadataStore, model_name: str, alias: str = CHAMPION) -> RegistryVersion:
    """The version ``alias`` held before its current holder, from the recorded moves.

    Rolling back twice returns to where it started, like ``kubectl rollout undo``.

    Raises:
        RegistryError: the alias is unset, its current holder was not moved by sluicegate (no record to
            undo), or there was no earlier holder.
    """
    from sluicegate.metadata.model_versions import alias_history

    current = alias_holder(tracking_uri, model_name, alias)
    if current is None:
        raise RegistryError(f"{model_name!r} has no {alias!r}: nothing to roll back")
    with store.session() as session:
        moves = alias_history(session, model_name, alias)
        last = next((m for m in moves if m.registry_version == current.registry_version), None)
        previous = None if last is None else last.previous_registry_version
    if last is None:
        raise RegistryError(
            f"{alias} {current.describe()} was not set through sluicegate, so there is no recorded move to undo; "
            f"name the version to restore: sluicegate models promote VERSION --alias {alias} --reason ..."
        )
    if previous is None:
        raise RegistryError(f"{current.describe()} is the first {alias} of {model_name!r}: there is none before it")
    return resolve(tracking_uri, model_name, previous)


def download_to_temp(tracking_uri: str, version: RegistryVersion, parent: Path) -> Path:
    """``download_version`` into a fresh temporary folder under ``parent`` (the caller removes it)."""
    parent.mkdir(parents=True, exist_ok=True)
    return download_version(tracking_uri, version, Path(tempfile.mkdtemp(prefix="registry-", dir=parent)))
