"""The lineage walks over a real metadata store (SQLite and PostgreSQL) with MLflow down, and the request
log search over lines written by the server's own formatter."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from sluicegate.metadata import MetadataStore
from sluicegate.metadata.datasets import upsert_dataset_version
from tasks.lineage.records import Lineage
from tasks.lineage.request_logs import default_log_files, find_request
from tasks.lineage.walk import LineageAmbiguous, LineageNotFound, LogQuery, connect_mlflow, walk
from tests.fixtures import lineage as history
from tests.fixtures.services import free_port


def lineage_of(url: str, ref: str, logs: LogQuery | None = None, **kwargs: object) -> Lineage:
    mlflow, tracker = connect_mlflow(f"http://127.0.0.1:{free_port()}", timeout_s=1)  # nothing listens there
    store = MetadataStore(url)
    try:
        with store.session() as session:
            return walk(
                session,
                ref,
                mlflow=mlflow,
                tracker=tracker,
                model_name=history.MODEL,
                logs=logs or LogQuery(),
                **kwargs,  # type: ignore[arg-type]
            )
    finally:
        store.dispose()


def test_model_version_walks_down_to_data_and_up_to_deployments(store_url: str) -> None:
    seeded = history.seed(store_url)
    found = lineage_of(store_url, history.FIRST)
    assert found.kind == "model" and not found.mlflow.reachable and found.mlflow.error
    model = found.model
    assert model is not None and model.training_run is None  # MLflow is down: the store's part only
    assert model.model.version == history.FIRST and model.model.registry_version == "1"
    assert model.code_dirty is False and model.environment["gpus"][0]["name"] == "NVIDIA H200"
    run = model.pipeline_run
    assert run is not None and run.prefect_flow_run_id == seeded.flow_run_ids[0] and run.status == "succeeded"
    assert run.trigger_event is not None and run.trigger_event.version_id == "manifest-ver-1"
    assert [(g.gate, g.passed) for g in run.gates] == [("data", True), ("train", True)]
    dataset = model.dataset
    assert dataset is not None and dataset.num_objects == 3 and dataset.objects is None
    assert dataset.manifest_version_id == "manifest-ver-1"
    [deployment] = model.model.deployments
    assert deployment.status == "promoted" and [s.canary_weight for s in deployment.steps] == [10, 50]
    assert [(m.alias, m.direction) for m in model.model.alias_moves] == [("champion", "to")]
    # With MLflow down, the aliases it holds now come from the last recorded move of each.
    assert model.model.aliases == ("champion",) and model.model.aliases_source == "metadata store"

    by_prefix = lineage_of(store_url, "v1.0.1-abc", with_objects=True)
    assert by_prefix.model is not None and by_prefix.model.model.version == history.SECOND
    assert by_prefix.model.dataset is not None and by_prefix.model.dataset.objects is not None
    assert [o.version_id for o in by_prefix.model.dataset.objects] == ["ver-0", "ver-1", "ver-2"]
    assert by_prefix.model.model.deployments[0].steps[0].reason == "p99 latency 80 ms > 1.2x stable"


def test_data_version_walks_up_to_runs_models_and_rollouts(store_url: str) -> None:
    history.seed(store_url)
    found = lineage_of(store_url, history.DATA[:7].upper())
    assert found.kind == "data" and found.data is not None
    data = found.data
    assert data.dataset.data_version == history.DATA
    assert [(r.status, r.reason) for r in data.pipeline_runs] == [
        ("succeeded", None),
        ("succeeded", None),
        ("failed", "GateFailed: data gate: 2 blank images"),
    ]
    outcomes = {m.version: [d.status for d in m.deployments] for m in data.models}
    assert outcomes == {history.FIRST: ["promoted"], history.SECOND: ["rolled_back"]}
    assert data.champion == history.FIRST


def test_request_id_walks_from_the_server_log(store_url: str, tmp_path: Path) -> None:
    history.seed(store_url)
    logs = tmp_path / "logs"
    history.write_request_log(logs / "serving.log.1")  # a rotated file
    (logs / "supervisor.log").write_text(f"{history.SERVER_REQUEST_ID} is not a request line here\n")
    files = default_log_files(logs)
    assert [f.name for f in files] == ["serving.log.1"]
    # The server's ids are 32 hex characters: not mistaken for a data version that does not exist.
    found = lineage_of(store_url, history.SERVER_REQUEST_ID, LogQuery(tuple(files)))
    assert found.kind == "request" and found.request is not None
    assert found.request.model_version == history.FIRST and found.request.input_digest == history.INPUT_DIGEST
    assert found.request.source.endswith("serving.log.1:2")
    assert found.model is not None and found.model.model.version == history.FIRST

    stdin = io.StringIO((logs / "serving.log.1").read_text())
    by_stream = lineage_of(store_url, history.CLIENT_REQUEST_ID, LogQuery((), stdin))
    assert by_stream.request is not None and by_stream.request.source == "<stdin>:3"
    assert by_stream.model is not None and by_stream.model.model.version == history.SECOND


def test_unknown_and_ambiguous_references_say_what_was_tried(store_url: str, tmp_path: Path) -> None:
    history.seed(store_url)
    with pytest.raises(LineageNotFound, match=r"model version: no recorded.*request id: no request logs.*--logs"):
        lineage_of(store_url, "v9.9.9")
    log = tmp_path / "serving.log"
    history.write_request_log(log)
    with pytest.raises(LineageNotFound, match=r"data version: no recorded .*not in the request logs searched"):
        lineage_of(store_url, "1234567890abcdef", LogQuery((log,)))
    with pytest.raises(LineageAmbiguous, match=r"matches .*v1\.0\.0-.*v1\.0\.1-"):
        lineage_of(store_url, "v1.0")
    with pytest.raises(LineageNotFound, match=r"MLflow at .* is not reachable"):
        lineage_of(store_url, "champion")
    store = MetadataStore(store_url)
    with store.session() as session:
        upsert_dataset_version(
            session,
            dataset_name="pcb",
            data_version=history.DATA[:7] + "0" * 57,
            bucket="b",
            prefix="p/",
            manifest_key="p/manifest.csv",
            manifest_etag="e",
            manifest_version_id=None,
            objects={},
        )
    store.dispose()
    with pytest.raises(LineageAmbiguous, match="is ambiguous"):
        lineage_of(store_url, history.DATA[:7])


def test_request_search_reads_only_request_lines(tmp_path: Path) -> None:
    log = tmp_path / "serving.log"
    history.write_request_log(log)
    search = find_request("ready", [log])  # a word of a non-request line is no request id
    assert search.matches == () and search.searched == (str(log),)
    legacy = find_request("other", [log]).latest  # an older line: its sha256 read with the algorithm named
    assert legacy is not None and legacy.input_digest == f"sha256:{history.LEGACY_SHA256}"
