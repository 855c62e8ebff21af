"""Which model a dataset trains, and that model's settings.

Zero configuration: dataset ``X`` trains, gates against and rolls out model ``<model.prefix>X``, with
the platform's settings; labels, input size and colour come from its first version (then from its
champion). A model spec, one YAML file per model in the ``model.specs`` folder, overrides any of it:

    # <specs>/pcb-classifier.yaml
    datasets: [pcb, pcb-line2]        # default: the model's own name
    labels: [bridge, excess, good, insufficient]
    preprocessing: {height: 32, width: 32, colour: RGB}
    training: {augment_flips: true, augment_quarter_turns: true}
    eval_gate: {min_accuracy_gain: 0.01}
    canary: {steps: [10, 50, 100], hold_seconds: 120}
    serving: {replicas: 3, cpu: "2", memory: 2Gi}

A spec's groups are the settings groups of the same name (``SLUICEGATE_TRAINING__*`` and so on), validated
with their own rules; a spec wins over the environment, because it is the more specific of the two.
Only the canary *plan* is per model: where traffic moves and where metrics come from stay platform-wide.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sluicegate.errors import ConfigError
from sluicegate.settings import (
    DataGateSettings,
    EvalGateSettings,
    FeatureGateSettings,
    Group,
    PreprocessingSettings,
    RolloutSettings,
    Settings,
    TrainGateSettings,
    TrainingSettings,
)

# A Kubernetes label value and a DNS-1123 label: the model name becomes object names and metric labels.
# 40 leaves room for "<model>-canary-<pod-template-hash>-<suffix>" and the ConfigMap
# "<model>-serving-<hash>" within Kubernetes' 63 (tasks/rollout/manifests.py).
MODEL_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")
# Kubernetes quantities as the serving overlay accepts them (tasks/rollout/manifests.py).
CPU = re.compile(r"^([0-9]+(\.[0-9]{1,3})?|[0-9]+m)$")
MEMORY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
SPEC_SUFFIXES = (".yaml", ".yml")

# The groups a spec may override, by their key in the spec and in Settings.
GROUPS: dict[str, type[Group]] = {
    "preprocessing": PreprocessingSettings,
    "training": TrainingSettings,
    "data_gate": DataGateSettings,
    "feature_gate": FeatureGateSettings,
    "train_gate": TrainGateSettings,
    "eval_gate": EvalGateSettings,
}
# A model's canary plan; the rest of the rollout group (platform, URLs, tokens) is the platform's.
CANARY_FIELDS = frozenset(
    {
        "steps",
        "hold_seconds",
        "analysis_interval_seconds",
        "min_requests",
        "max_inconclusive",
        "max_p95_increase",
        "min_p95_delta_seconds",
        "max_error_rate_increase",
        "latency_significance",
        "pause_before",
        "custom_checks",
    }
)


class SpecError(ConfigError):
    """A model spec file is unreadable or invalid; the message names the file, the field and the fix."""


class ServingResources(BaseModel):
    """What the model's serving Deployment asks for (the Kubernetes overlay's resources)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: int = Field(2, ge=1, description="Pods of the stable Deployment.")
    cpu: str = Field("1", pattern=CPU.pattern, description="CPU request and limit (Kubernetes quantity).")
    memory: str = Field("1Gi", pattern=MEMORY.pattern, description="Memory request and limit.")
    gpu: int = Field(0, ge=0, description="nvidia.com/gpu per pod (0: CPU, ONNX Runtime).")


class ModelSpec(BaseModel):
    """One model's spec file, validated field by field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Registered model name (default: the file's name without .yaml).")
    datasets: tuple[str, ...] = Field((), description="Dataset names whose versions train this model.")
    labels: tuple[str, ...] | None = Field(None, description="The model's classes; unset: its champion's.")
    intended_use: str | None = None
    semver: str | None = None
    preprocessing: dict[str, Any] = Field(default_factory=dict)
    training: dict[str, Any] = Field(default_factory=dict)
    data_gate: dict[str, Any] = Field(default_factory=dict)
    feature_gate: dict[str, Any] = Field(default_factory=dict)
    train_gate: dict[str, Any] = Field(default_factory=dict)
    eval_gate: dict[str, Any] = Field(default_factory=dict)
    canary: dict[str, Any] = Field(default_factory=dict)
    serving: ServingResources = Field(default_factory=ServingResources)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not MODEL_NAME.match(value):
            raise ValueError(
                f"{value!r} is not a model name: use 1-40 lower-case letters, digits and dashes, starting and "
                "ending with a letter or digit (it names Kubernetes objects and metric labels)"
            )
        return value

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None and (len(value) < 2 or len(set(value)) != len(value)):
            raise ValueError(f"labels must list at least two distinct classes, got {list(value)}")
        return value

    @model_validator(mode="after")
    def _groups(self) -> ModelSpec:
        unknown = sorted(set(self.canary) - CANARY_FIELDS)
        if unknown:
            raise ValueError(
                f"canary: {unknown} are not part of a model's canary plan (allowed: {sorted(CANARY_FIELDS)}); "
                "the platform, its URLs and tokens are SLUICEGATE_ROLLOUT__* settings"
            )
        if self.semver is not None:
            from sluicegate import ids

            try:
                ids.parse_semver(self.semver)
            except ConfigError as exc:
                raise ValueError(f"semver {self.semver!r} is not MAJOR.MINOR.PATCH (e.g. 1.0.0)") from exc
        return self

    def group_errors(self) -> list[str]:
        """Each group checked with its own settings class, so a spec and SLUICEGATE_* variables obey the
        same rules; the errors as ``<group>.<field>: <message>``."""
        found: list[str] = []
        checks: list[tuple[str, type[Group]]] = [*GROUPS.items(), ("canary", RolloutSettings)]
        for key, group in checks:
            try:
                group.model_validate(getattr(self, key))
            except ValidationError as exc:
                found += [_where(error, prefix=(key,)) for error in exc.errors(include_url=False)]
        return found

    def dataset_names(self) -> tuple[str, ...]:
        return self.datasets or (self.name,)


@dataclass(frozen=True)
class ModelChoice:
    """The model a dataset trains, and the spec that said so (None: zero configuration)."""

    name: str
    spec: ModelSpec | None


def specs_folder(settings: Settings) -> Path:
    return settings.model.specs or settings.home / "models"


def load_spec(path: Path) -> ModelSpec:
    """One spec file; the model name defaults to the file's name.

    Raises:
        SpecError: unreadable YAML, not a mapping, or an invalid field (each one named, with the fix).
    """
    import yaml

    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise SpecError(f"model spec {path}: cannot be read as YAML: {exc}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise SpecError(f"model spec {path}: expected a mapping of fields (name, datasets, training, ...)")
    try:
        spec = ModelSpec.model_validate({"name": path.stem, **raw})
    except ValidationError as exc:
        raise SpecError(f"model spec {path}: {'; '.join(_where(e) for e in exc.errors(include_url=False))}") from None
    errors = spec.group_errors()
    if errors:
        raise SpecError(f"model spec {path}: {'; '.join(errors)}")
    return spec


def _where(error: Any, prefix: tuple[str, ...] = ()) -> str:
    where = ".".join(str(part) for part in (*prefix, *error["loc"])) or "(file)"
    return f"{where}: {error['msg']}"


def load_specs(folder: Path) -> dict[str, ModelSpec]:
    """Every spec in ``folder`` by model name (an absent folder has none).

    Raises:
        SpecError: a bad file, two files for one model, or one dataset claimed by two models.
    """
    if not folder.is_dir():
        return {}
    specs: dict[str, tuple[Path, ModelSpec]] = {}
    claimed: dict[str, Path] = {}
    for path in sorted(p for p in folder.iterdir() if p.suffix in SPEC_SUFFIXES and p.is_file()):
        spec = load_spec(path)
        if spec.name in specs:
            raise SpecError(f"model spec {path}: model {spec.name!r} is already specified by {specs[spec.name][0]}")
        for dataset in spec.dataset_names():
            if dataset in claimed:
                raise SpecError(
                    f"model spec {path}: dataset {dataset!r} already trains the model of {claimed[dataset]}; "
                    "a dataset feeds one model: remove it from one of the two files"
                )
            claimed[dataset] = path
        specs[spec.name] = (path, spec)
    return {name: spec for name, (_, spec) in specs.items()}


def default_model_name(settings: Settings, dataset: str) -> str:
    """The zero-configuration model of a dataset: its name (with the settings' prefix), made a valid
    model name (lower case; anything else than letters, digits and dashes becomes a dash)."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"{settings.model.prefix}{dataset}".lower()).strip("-")[:40].strip("-")
    if not MODEL_NAME.match(name):
        raise ConfigError(
            f"dataset {dataset!r} gives no valid model name; name the dataset with letters and digits, "
            "or map it to a model in a spec file"
        )
    return name


def model_for_dataset(settings: Settings, dataset: str) -> ModelChoice:
    """The model ``dataset`` trains: the spec that lists it, else the dataset's own model."""
    for spec in load_specs(specs_folder(settings)).values():
        if dataset in spec.dataset_names():
            return ModelChoice(spec.name, spec)
    return ModelChoice(default_model_name(settings, dataset), None)


def spec_of(settings: Settings, model: str) -> ModelSpec | None:
    return load_specs(specs_folder(settings)).get(model)


def settings_for_model(settings: Settings, model: str, spec: ModelSpec | None = None) -> Settings:
    """``settings`` as model ``model`` sees them: its name, and its spec's overrides on top.

    ``spec`` None looks the model's spec up in the folder (zero configuration when there is none).
    """
    spec = spec if spec is not None else spec_of(settings, model)
    model_group = {"name": model}
    update: dict[str, Any] = {}
    if spec is not None:
        if spec.intended_use is not None:
            model_group["intended_use"] = spec.intended_use
        if spec.semver is not None:
            model_group["semver"] = spec.semver
        for key, group in GROUPS.items():
            overrides = dict(getattr(spec, key))
            if key == "data_gate" and spec.labels is not None:
                overrides.setdefault("labels", list(spec.labels))
            if overrides:
                current = getattr(settings, key)
                update[key] = group.model_validate({**current.model_dump(), **overrides})
        if spec.canary:
            update["rollout"] = RolloutSettings.model_validate({**settings.rollout.model_dump(), **spec.canary})
    update["model"] = settings.model.model_copy(update=model_group)
    return settings.model_copy(update=update)


def check_all(settings: Settings) -> dict[str, ModelSpec]:
    """Load and apply every spec (what ``sluicegate models check`` runs): any error raises SpecError."""
    specs = load_specs(specs_folder(settings))
    for name, spec in specs.items():
        settings_for_model(settings, name, spec)
    return specs
