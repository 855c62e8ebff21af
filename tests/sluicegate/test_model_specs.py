"""Model specs: dataset -> model mapping, validation that names the field, overrides applied to settings."""

from pathlib import Path

import pytest

from sluicegate import model_specs
from sluicegate.errors import ConfigError
from sluicegate.settings import Settings


def settings_in(tmp_path: Path, **extra: object) -> Settings:
    return Settings(home=tmp_path, **extra)  # type: ignore[arg-type]


def write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def test_without_a_spec_a_dataset_trains_a_model_of_its_own_name(tmp_path: Path) -> None:
    settings = settings_in(tmp_path)
    assert model_specs.model_for_dataset(settings, "digits") == model_specs.ModelChoice("digits", None)
    # Dataset names may hold characters a model name (a Kubernetes label) may not.
    assert model_specs.model_for_dataset(settings, "Line_2.Scans").name == "line-2-scans"
    prefixed = settings_in(tmp_path, model={"prefix": "staging-"})
    assert model_specs.model_for_dataset(prefixed, "digits").name == "staging-digits"
    with pytest.raises(ConfigError, match="no valid model name"):
        model_specs.model_for_dataset(settings, "___")


def test_a_spec_maps_its_datasets_and_its_overrides_reach_every_group(tmp_path: Path) -> None:
    write(
        tmp_path / "models",
        "pcb-classifier.yaml",
        """
datasets: [pcb, pcb-line2]
labels: [bridge, good]
intended_use: joints
preprocessing: {height: 48, width: 40, colour: BGR}
training: {augment_flips: true, epochs: 7}
eval_gate: {min_accuracy_gain: 0.02}
canary: {steps: [10, 100], hold_seconds: 5}
serving: {replicas: 3, cpu: 500m, memory: 2Gi}
""",
    )
    settings = settings_in(tmp_path, training={"learning_rate": 0.01}, rollout={"platform": "kubernetes"})
    choice = model_specs.model_for_dataset(settings, "pcb-line2")
    assert choice.name == "pcb-classifier" and choice.spec is not None
    assert model_specs.model_for_dataset(settings, "other").spec is None
    mine = model_specs.settings_for_model(settings, choice.name, choice.spec)
    assert mine.model.name == "pcb-classifier" and mine.model.intended_use == "joints"
    assert (mine.preprocessing.height, mine.preprocessing.width, mine.preprocessing.colour) == (48, 40, "BGR")
    assert mine.training.augment_flips and mine.training.epochs == 7
    assert mine.training.learning_rate == 0.01  # what the spec leaves alone stays the environment's
    assert mine.data_gate.labels == ["bridge", "good"]
    assert mine.eval_gate.min_accuracy_gain == 0.02
    assert mine.rollout.steps == (10, 100) and mine.rollout.hold_seconds == 5
    assert mine.rollout.platform == "kubernetes"  # the platform is not a model's to choose
    assert choice.spec.serving.replicas == 3
    # Looking a model up by name finds the same spec; the original settings are untouched.
    assert model_specs.settings_for_model(settings, "pcb-classifier").training.epochs == 7
    assert settings.training.epochs is None and settings.model.name == ""


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("training: {epochs: 0}", "training.epochs"),
        ("training: {arch: vgg}", "training.arch"),
        ("training: {epoch: 3}", "training.epoch"),
        ("preprocessing: {colour: CMYK}", "preprocessing.colour"),
        ("canary: {platform: kubernetes}", "not part of a model's canary plan"),
        ("serving: {memory: lots}", "serving.memory"),
        ("labels: [only-one]", "labels"),
        ("name: Bad_Name", "name"),
        ("semver: one", "semver"),
        ("colour: RGB", "colour"),
        ("- a list", "expected a mapping"),
        ("training: {epochs: [", "cannot be read as YAML"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_file_and_the_field(tmp_path: Path, text: str, named: str) -> None:
    path = write(tmp_path / "models", "m.yaml", text + "\n")
    with pytest.raises(model_specs.SpecError) as caught:
        model_specs.check_all(settings_in(tmp_path))
    assert str(path) in str(caught.value) and named in str(caught.value)


def test_a_dataset_claimed_by_two_models_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    write(folder, "a.yaml", "datasets: [shared]\n")
    write(folder, "b.yml", "datasets: [shared, own]\n")
    with pytest.raises(model_specs.SpecError, match=r"'shared' already trains the model of .*a\.yaml"):
        model_specs.load_specs(folder)


def test_the_specs_folder_defaults_to_the_state_directory_and_may_be_absent(tmp_path: Path) -> None:
    assert model_specs.specs_folder(settings_in(tmp_path)) == tmp_path.resolve() / "models"
    assert model_specs.check_all(settings_in(tmp_path)) == {}
    elsewhere = settings_in(tmp_path, model={"specs": str(tmp_path / "specs")})
    write(tmp_path / "specs", "digits.yaml", "training: {augment_shift: 0.05}\n")
    assert model_specs.settings_for_model(elsewhere, "digits").training.augment_shift == 0.05
