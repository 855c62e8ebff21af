"""The platform's settings: one pydantic-settings root, read once at an entry point and passed down.

Every field defaults to the embedded stack (`sluicegate up`), with state under ``./.sluicegate/``.
A service URL left unset means "run the embedded one"; set it to point at a real service and
``sluicegate up`` skips starting that part.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

LOOPBACK = "127.0.0.1"


class Group(BaseModel):
    """A nested settings group: a misspelt variable (SLUICEGATE_STORAGE__BUKET) is an error, not ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class StorageSettings(Group):
    """Object store (S3 API) and its event queue."""

    endpoint_url: str | None = Field(
        None,
        description="S3 endpoint URL. Unset: the embedded moto server on `port`. "
        "For AWS use https://s3.<region>.amazonaws.com; for MinIO its URL.",
    )
    port: int = Field(9100, description="Port of the embedded S3+SQS endpoint.")
    bucket: str = Field("sluicegate", description="Bucket holding datasets and MLflow artifacts.")
    region: str = Field("us-east-1", description="AWS region for S3 and SQS clients.")
    access_key_id: SecretStr | None = Field(
        None, description="Access key. Unset: the embedded endpoint's test key, else boto3's chain."
    )
    secret_access_key: SecretStr | None = Field(
        None, description="Secret key. Unset: the embedded endpoint's test key, else boto3's chain."
    )
    datasets_prefix: str = Field("datasets/", description="Key prefix under which dataset versions land.")
    max_concurrency: int = Field(16, ge=1, description="Parallel S3 requests per operation.")

    @property
    def embedded(self) -> bool:
        return self.endpoint_url is None

    @property
    def url(self) -> str:
        return self.endpoint_url or f"http://{LOOPBACK}:{self.port}"


class EventSettings(Group):
    """The S3 -> Prefect event bridge."""

    sources: list[Literal["sqs", "webhook"]] = Field(
        default_factory=lambda: ["sqs", "webhook"],  # type: ignore[arg-type,unused-ignore]
        description="Event sources the bridge runs.",
    )
    queue_name: str = Field("sluicegate-events", description="SQS queue receiving S3 notifications.")
    dead_letter_queue_name: str = Field(
        "sluicegate-events-dlq", description="SQS queue where malformed messages are set aside."
    )
    queue_url: str | None = Field(
        None, description="Full SQS queue URL; unset: looked up from `queue_name` on the endpoint."
    )
    notification_suffix: str = Field(
        "manifest.csv",
        description="Suffix filter of the bucket notification the embedded stack configures "
        "(a dataset version is announced by its manifest, uploaded last). Empty: every object.",
    )
    wait_seconds: int = Field(1, ge=0, le=20, description="SQS long-poll wait per receive call.")
    visibility_timeout: int = Field(
        30, ge=1, description="Seconds a received SQS message stays hidden before redelivery."
    )
    webhook_port: int = Field(9102, description="Port of the bridge's HTTP webhook and /health.")
    webhook_host: str = Field(
        LOOPBACK, description="Address the webhook binds (0.0.0.0 in a container that MinIO reaches over a network)."
    )
    webhook_token: SecretStr | None = Field(
        None, description="Bearer token the webhook requires; unset: no authentication (loopback only)."
    )
    event_name: str = Field("s3.object.created", description="Prefect event name emitted per object.")


class PrefectSettings(Group):
    """Orchestration."""

    api_url: str | None = Field(
        None, description="Prefect API URL (ends in /api). Unset: the embedded server on `port`."
    )
    port: int = Field(4200, description="Port of the embedded Prefect server (UI and API).")
    api_key: SecretStr | None = Field(None, description="Prefect Cloud API key (Bearer), if any.")
    auth_string: SecretStr | None = Field(
        None, description="Basic-auth 'user:password' of a self-hosted Prefect server, if it has one."
    )
    ui: bool = Field(True, description="Serve the Prefect UI from the embedded server.")
    runner_poll_seconds: float = Field(
        5.0,
        gt=0,
        description="How often (seconds) the embedded runner asks the API for runs to start. Triggered "
        "runs start on the server's flow-run event without waiting for it; the poll catches scheduled runs "
        "coming due (fetched 10 s ahead) and covers a lost event stream. Each poll is also a write on the "
        "server, and on SQLite a write can make a concurrent run creation wait 2 s.",
    )
    runner_warm: bool = Field(
        True,
        description="Start each flow run forked from a server that has imported Prefect's engine and the "
        "flow modules (tens of ms); false: Prefect's own fresh interpreter per run (seconds).",
    )
    runner_preload: list[str] = Field(
        ["sluicegate.metadata", "sluicegate.storage"],
        description="Modules the warm runner's server imports once, besides Prefect's engine and the flow "
        "modules: what every run imports soon after it starts.",
    )
    runner_limit: int = Field(5, ge=1, description="Flow runs the embedded runner runs at once.")
    runner_port: int = Field(9103, description="Port of the embedded runner's health server.")

    @property
    def embedded(self) -> bool:
        return self.api_url is None

    @property
    def url(self) -> str:
        return self.api_url or f"http://{LOOPBACK}:{self.port}/api"


class MlflowSettings(Group):
    """Tracking and model registry."""

    tracking_uri: str | None = Field(None, description="MLflow tracking URI. Unset: the embedded server on `port`.")
    port: int = Field(5000, description="Port of the embedded MLflow server.")
    experiment: str = Field("sluicegate", description="Experiment holding pipeline runs.")
    artifacts_prefix: str = Field("mlflow/", description="Key prefix of MLflow artifacts in the bucket.")

    @property
    def embedded(self) -> bool:
        return self.tracking_uri is None

    @property
    def url(self) -> str:
        return self.tracking_uri or f"http://{LOOPBACK}:{self.port}"


class MetadataSettings(Group):
    """The metadata (lineage) store."""

    url: str | None = Field(
        None,
        description="SQLAlchemy URL, e.g. postgresql+psycopg://user:pw@host/db. "
        "Unset: a SQLite file under the state directory.",
    )


class RetrainSettings(Group):
    """Scheduled retraining."""

    cron: str | None = Field(
        None, description="Cron of the scheduled-retrain deployment; unset: the one in prefect.yaml."
    )
    timezone: str = Field("UTC", description="Timezone of the retrain cron.")


class DataGateSettings(Group):
    """Gate 1: the dataset itself (DESIGN section 5)."""

    max_missing_fraction: float = Field(
        0.05, ge=0, le=1, description="Largest fraction of manifest rows with an empty label or split."
    )
    max_label_kl: float = Field(
        0.3, ge=0, description="Largest KL divergence of the label distribution from the reference."
    )
    min_same_size_fraction: float = Field(
        0.99, ge=0, le=1, description="Smallest fraction of images that share the most common size."
    )
    labels: list[str] | None = Field(
        None,
        description="Allowed labels (JSON list). Unset: the champion's labels; with no champion either, "
        "any label is allowed and the reference distribution is uniform over the labels seen.",
    )
    read_concurrency: int = Field(16, ge=1, description="Images read and decoded in parallel.")


class FeatureGateSettings(Group):
    """Gate 2: candidate preprocessing vs the champion's (DESIGN section 5)."""

    sample_size: int = Field(1000, ge=1, description="Images sampled from the dataset version.")
    percentile: float = Field(5.0, gt=0, lt=100, description="Percentile of per-image cosine similarity checked.")
    min_cosine: float = Field(0.999, gt=0, le=1, description="Smallest allowed cosine at that percentile.")
    seed: int = Field(0, description="Seed of the image sample.")


class PreprocessingSettings(Group):
    """The candidate's preprocessing (serving/preprocessing.py), recorded with every model.

    An unset field follows the model's champion (what it was trained and is served with) and, for a
    model's first version, the data: its most common image size (shrunk to fit ``max_size``, aspect kept)
    and colour (one channel "L" when every image is grey). A model spec or these variables pin a field.
    """

    height: int | None = Field(None, ge=1, description="Model input height; unset: the champion's, else the data's.")
    width: int | None = Field(None, ge=1, description="Model input width; unset: the champion's, else the data's.")
    # 32 keeps CPU training of a first model to about a minute; raise it on a GPU work pool.
    max_size: int = Field(32, ge=1, description="Largest input side a size taken from the data is shrunk to.")
    colour: Literal["RGB", "BGR", "L"] | None = Field(
        None, description="Channels the model expects (L: one grey channel); unset: the champion's, else the data's."
    )
    mean: tuple[float, ...] | None = Field(
        None, description="Per-channel mean after scaling to [0, 1] (RGB order; one value for L); unset: ImageNet's."
    )
    std: tuple[float, ...] | None = Field(
        None, description="Per-channel std (RGB order; one value for L); unset: ImageNet's."
    )


class TrainingSettings(Group):
    """Gate 3's training run. Unset fields are chosen from the data (architecture by input size, epoch
    budget by training-set size)."""

    arch: Literal["auto", "resnet-small", "resnet-wide"] = Field(
        "auto",
        description="Model architecture; auto: resnet-small below 64 pixels a side, resnet-wide from there.",
    )
    width: int | None = Field(None, ge=4, description="Channels of the first stage; unset: the architecture's.")
    blocks: tuple[int, ...] | None = Field(
        None, description="Residual blocks per stage (JSON list); unset: the architecture's."
    )
    epochs: int | None = Field(
        None, ge=1, description="Most epochs to train; unset: from the training-set size (more for small sets)."
    )
    patience: int | None = Field(
        None, ge=1, description="Epochs without validation-loss improvement before stopping; unset: epochs // 4."
    )
    batch_size: int = Field(64, ge=1, description="Training batch size.")
    learning_rate: float = Field(5e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW weight decay.")
    augment_shift: float = Field(
        0.1, ge=0, le=0.5, description="Random translation, as a fraction of the image side (0: none)."
    )
    augment_rotate_degrees: float = Field(10.0, ge=0, le=180, description="Random rotation within +- degrees.")
    augment_scale: float = Field(0.1, ge=0, lt=1, description="Random zoom within 1 +- this.")
    augment_flips: bool = Field(
        False, description="Random horizontal and vertical flips: only when a mirrored image keeps its label."
    )
    augment_quarter_turns: bool = Field(
        False, description="Random 90-degree turns: only when a turned image keeps its label (not digits)."
    )
    seed: int = Field(0, description="Seed of initialisation and data order (deterministic on CPU).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where to train; auto: CUDA if present.")
    amp: bool = Field(True, description="Mixed precision (bf16 autocast) when training on CUDA.")


class TrainGateSettings(Group):
    """Gate 3's stability checks (DESIGN section 5)."""

    max_roughness: float = Field(
        0.1,
        gt=0,
        description="Largest mean |2nd difference| of the min-max normalised, smoothed per-step training-loss curve.",
    )
    max_loss_rise: float = Field(
        2.0,
        gt=0,
        description="Largest ratio of the smoothed training loss's peak to the first step's loss (above: diverged).",
    )
    final_loss_tolerance: float = Field(
        0.05,
        ge=0,
        description="Final loss at most this fraction above the mean of earlier runs' final losses (lower passes).",
    )
    memory_tolerance: float = Field(
        0.10,
        ge=0,
        description="Peak memory at most this fraction above the mean of earlier runs' peaks (lower passes).",
    )
    history_runs: int = Field(10, ge=1, description="How many earlier runs of the model form the history.")


class ConversionSettings(Group):
    """Gate 4: ONNX export and parity, TensorRT engine where available."""

    opset: int = Field(18, ge=17, description="ONNX opset of the export.")
    parity_atol: float = Field(1e-4, gt=0, description="Largest |ONNX Runtime - PyTorch| on the validation batch.")
    parity_batch: int = Field(32, ge=1, description="Validation images in the parity batch.")
    tensorrt: Literal["auto", "off"] = Field(
        "auto", description="Build a TensorRT engine when a GPU and TensorRT exist."
    )
    fp16: bool = Field(False, description="Build the TensorRT engine in FP16 (parity bound `fp16_atol`).")
    fp16_atol: float = Field(2e-2, gt=0, description="Parity bound for an FP16 engine (looser, stated).")
    profile: tuple[int, int, int] = Field((1, 8, 64), description="TensorRT batch profile: min, opt, max.")
    engine_cache: Path | None = Field(None, description="Folder of cached engines; unset: <home>/engines.")


class EvalGateSettings(Group):
    """Gate 5: the candidate against the champion on the test split, through the serving runtime."""

    min_accuracy_gain: float = Field(
        0.005, ge=0, le=1, description="Accuracy must reach the champion's plus this (0.005 = 0.5 points)."
    )
    max_latency_ratio: float = Field(
        1.1, gt=0, description="p95 latency at each batch size at most the champion's times this."
    )
    latency_retries: int = Field(
        1, ge=0, description="Re-measure latency this many times when only the latency rule trips (noise)."
    )
    min_latency_delta_ms: float = Field(
        0.25,
        ge=0,
        description="p95 differences below this (ms) never fail the champion comparison: on a sub-millisecond "
        "model a busy CPU's scheduling noise alone moves p95 past any ratio (0: the ratio alone).",
    )
    first_model_min_accuracy: float = Field(
        0.8, ge=0, le=1, description="Absolute accuracy floor when there is no champion yet."
    )
    baseline_margin: float = Field(
        0.005,
        ge=-1,
        le=1,
        description="Accuracy must reach the majority-class and the linear baseline's plus this (capped at 1); "
        "-1 switches the baselines off (wiring tests on random images only).",
    )
    baseline_size: int = Field(
        16, ge=2, description="Side the linear baseline (logistic regression) downsamples images to."
    )
    max_p95_ms: float | None = Field(
        None, gt=0, description="Absolute p95 latency ceiling (ms) at every batch size; unset: none."
    )
    batch_sizes: tuple[int, ...] = Field((1, 8), min_length=1, description="Batch sizes latency is measured at.")
    latency_iterations: int = Field(300, ge=20, description="Timed calls per model and batch size.")
    warmup_iterations: int = Field(20, ge=0, description="Untimed calls before measuring.")
    threads: int = Field(1, ge=0, description="ONNX Runtime intra-op threads (1 = one serving core; 0 = all).")
    calibration_bins: int = Field(15, ge=2, description="Equal-width confidence bins of the calibration error.")
    max_images: int = Field(5000, ge=1, description="Most test images evaluated (a fixed, seeded subset beyond).")


class RolloutSettings(Group):
    """Canary rollout (DESIGN sections 5 and 7): the plan, where traffic moves, where metrics come from."""

    platform: Literal["local", "kubernetes"] = Field(
        "local", description="local: the local model server's version weights; kubernetes: Deployments (+ Istio)."
    )
    after_pipeline: bool = Field(
        False, description="Run the canary as a subflow of the pipeline once the eval gate passed (needs a platform)."
    )
    steps: tuple[int, ...] = Field((5, 20, 50, 100), description="Canary weights in percent; the last must be 100.")
    hold_seconds: float = Field(60.0, gt=0, description="How long each step is held before it is judged.")
    analysis_interval_seconds: float = Field(10.0, gt=0, description="Seconds between two metric reads in a step.")
    min_requests: int = Field(200, ge=1, description="Canary requests a step needs before it can pass.")
    max_inconclusive: int = Field(3, ge=0, description="Extra intervals an undecided step waits before failing.")
    max_p95_increase: float = Field(0.10, ge=0, description="Canary p95 at most stable's times (1 + this).")
    min_p95_delta_seconds: float = Field(
        0.002, ge=0, description="p95 differences below this never fail a step (histogram resolution)."
    )
    max_error_rate_increase: float = Field(
        0.005, ge=0, le=1, description="Canary error rate at most stable's plus this (0.005 = 0.5 points)."
    )
    latency_significance: float = Field(
        0.01,
        gt=0,
        le=1,
        description="A canary p95 past the bound fails only at this binomial p-value; above it the check passes.",
    )
    pause_before: tuple[int, ...] = Field((), description="Steps (weights) before which the rollout waits for resume.")
    custom_checks: tuple[dict[str, Any], ...] = Field(
        (),
        description='PromQL checks (JSON list of {"name", "query", "op", "bound", "relative"}); need prometheus_url.',
    )
    prometheus_url: str | None = Field(None, description="Prometheus for the analysis; unset: scrape the servers.")
    metrics_urls: tuple[str, ...] = Field(
        (), description="The servers' /metrics URLs for the scrape source; unset: the local server's."
    )
    alertmanager_url: str | None = Field(None, description="Alertmanager to notify on a rollback; unset: none.")
    local_repository: Path | None = Field(
        None, description="Folder the local server serves; unset: <home>/serving-repo."
    )
    local_grpc: str = Field(f"{LOOPBACK}:8001", description="The local model server's gRPC address.")
    local_http: str = Field(f"http://{LOOPBACK}:8000", description="The local model server's side port.")
    admin_token: SecretStr | None = Field(None, description="The serving admin token (local platform).")
    # TLS to the local model server: the rollout's admin calls (gRPC and the HTTPS side port) and the
    # embedded stack's clients use these; with any of them set, local_http must be https://.
    tls_ca_file: Path | None = Field(
        None,
        description="PEM CA bundle that signed the local model server's certificate; set: the clients use TLS "
        "(gRPC and HTTPS) and trust only it.",
    )
    tls_client_cert_file: Path | None = Field(
        None, description="PEM client certificate the clients present to a mutual-TLS model server."
    )
    tls_client_key_file: Path | None = Field(None, description="PEM private key of tls_client_cert_file.")
    local_tls_cert_file: Path | None = Field(
        None,
        description="Embedded stack: the local model server's certificate (SLUICEGATE_SERVING__TLS_CERT_FILE); "
        "with tls_client_cert_file set, it also requires client certificates signed by tls_ca_file.",
    )
    local_tls_key_file: Path | None = Field(None, description="Embedded stack: the private key of local_tls_cert_file.")
    namespace: str = Field("sluicegate-serving", description="Kubernetes namespace of the serving Deployments.")
    istio: bool = Field(True, description="Kubernetes: split with Istio weights; false: by replica ratio.")
    ready_timeout_seconds: float = Field(600.0, gt=0, description="How long a canary may take to become ready.")

    @model_validator(mode="after")
    def _tls_pairs(self) -> RolloutSettings:
        for cert, key in (
            ("tls_client_cert_file", "tls_client_key_file"),
            ("local_tls_cert_file", "local_tls_key_file"),
        ):
            if (getattr(self, cert) is None) != (getattr(self, key) is None):
                raise ValueError(f"rollout.{cert} and rollout.{key} go together: set both or neither")
        if self.client_tls and not self.local_http.startswith("https://"):
            raise ValueError(f"rollout TLS is set but local_http is {self.local_http!r}: use https://")
        return self

    @property
    def client_tls(self) -> bool:
        """Whether the clients of the local model server use TLS."""
        return any(f is not None for f in (self.tls_ca_file, self.tls_client_cert_file, self.local_tls_cert_file))


class ModelSettings(Group):
    """Models: one per dataset name unless a model spec (``specs``) maps datasets to a model."""

    name: str = Field(
        "",
        description="Default model of the CLI's --model; the pipeline picks each dataset's model itself.",
    )
    specs: Path | None = Field(None, description="Folder of model spec files (<model>.yaml); unset: <home>/models.")
    prefix: str = Field(
        "", description="Prefix of the model name a dataset gets without a spec (e.g. an environment: 'staging-')."
    )
    intended_use: str = Field(
        "Classifying images into the dataset's classes, as a screening aid whose outputs a person reviews.",
        description="The model card's intended-use statement (a model spec may set its own).",
    )
    semver: str = Field("1.0.0", description="MAJOR.MINOR.PATCH of produced model versions (vX.Y.Z-<commit7>-<data7>).")
    repository: Path | None = Field(
        None, description="Local model repository (serving layout) the pipeline writes to; unset: <home>/repository."
    )


class StackSettings(Group):
    """The embedded stack's supervisor."""

    start_timeout: float = Field(120.0, gt=0, description="Seconds to wait for each part to become healthy.")
    stop_timeout: float = Field(20.0, gt=0, description="Seconds to wait for a part to exit before SIGKILL.")
    max_restarts: int = Field(3, ge=0, description="Restarts of a crashed part before the supervisor gives up on it.")
    serving: bool = Field(
        True, description="Run the local model server (rollout.local_grpc/local_http) that the local rollout drives."
    )


class Settings(BaseSettings):
    """Root of the platform's settings (env prefix ``SLUICEGATE_``, nested groups with ``__``)."""

    model_config = SettingsConfigDict(env_prefix="SLUICEGATE_", env_nested_delimiter="__", extra="forbid", frozen=True)

    home: Path = Field(Path(".sluicegate"), description="State directory of the embedded stack.")
    code_commit: str | None = Field(
        None, description="Git commit of the code when it runs outside a git checkout (baked at image build)."
    )
    storage: StorageSettings = Field(default_factory=StorageSettings)
    events: EventSettings = Field(default_factory=EventSettings)
    prefect: PrefectSettings = Field(default_factory=PrefectSettings)
    mlflow: MlflowSettings = Field(default_factory=MlflowSettings)
    metadata: MetadataSettings = Field(default_factory=MetadataSettings)
    retrain: RetrainSettings = Field(default_factory=RetrainSettings)
    stack: StackSettings = Field(default_factory=StackSettings)
    data_gate: DataGateSettings = Field(default_factory=DataGateSettings)
    feature_gate: FeatureGateSettings = Field(default_factory=FeatureGateSettings)
    preprocessing: PreprocessingSettings = Field(default_factory=PreprocessingSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    train_gate: TrainGateSettings = Field(default_factory=TrainGateSettings)
    conversion: ConversionSettings = Field(default_factory=ConversionSettings)
    eval_gate: EvalGateSettings = Field(default_factory=EvalGateSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)

    @field_validator("home")
    @classmethod
    def _absolute_home(cls, value: Path) -> Path:
        # Children of the stack run with other working directories; pin the path now.
        return value.expanduser().resolve()

    @property
    def metadata_url(self) -> str:
        return self.metadata.url or f"sqlite:///{self.home / 'metadata.db'}"

    def to_env(self) -> dict[str, str]:
        """These settings as ``SLUICEGATE_*`` variables, so a child process reads back the same values.

        Only fields that differ from their defaults are written, so a child also sees what its own
        environment adds.
        """
        env: dict[str, str] = {}

        def encode(value: Any) -> str:
            if isinstance(value, SecretStr):
                return value.get_secret_value()
            if isinstance(value, list | tuple | dict):
                return json.dumps(value)
            return str(value)

        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            if isinstance(value, Group):
                for sub, sub_field in type(value).model_fields.items():
                    sub_value = getattr(value, sub)
                    if sub_value is not None and sub_value != sub_field.get_default(call_default_factory=True):
                        env[f"SLUICEGATE_{name.upper()}__{sub.upper()}"] = encode(sub_value)
            elif value is not None and (name == "home" or value != field.get_default(call_default_factory=True)):
                env[f"SLUICEGATE_{name.upper()}"] = encode(value)
        return env


def settings_table() -> list[tuple[str, str, str]]:
    """(environment variable, default, description) for every setting: the README's table."""
    rows: list[tuple[str, str, str]] = []

    def default_of(field: Any) -> str:
        value = field.get_default(call_default_factory=True)
        if value is None:
            return "(unset)"
        if isinstance(value, list):
            return json.dumps(value)
        return str(value)

    for name, field in Settings.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, Group):
            for sub, sub_field in annotation.model_fields.items():
                rows.append(
                    (f"SLUICEGATE_{name.upper()}__{sub.upper()}", default_of(sub_field), sub_field.description or "")
                )
        else:
            default = ".sluicegate" if name == "home" else default_of(field)
            rows.append((f"SLUICEGATE_{name.upper()}", default, field.description or ""))
    return rows


def settings_markdown() -> str:
    lines = ["| variable | default | what it sets |", "|---|---|---|"]
    lines += [f"| `{var}` | `{default}` | {text} |" for var, default, text in settings_table()]
    return "\n".join(lines)
