"""The few MLflow REST calls that bring a registered model version's files to the server.

httpx rather than the ``mlflow`` package, which the serving image does not carry (it would pull in the
whole tracking client and its dependencies). Endpoints: ``registered-models/alias``,
``model-versions/get``, ``runs/get``, ``artifacts/list`` and ``get-artifact`` (the tracking server
proxies the artifact store, so the server needs no S3 credentials of the registry's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from serving.errors import RepositoryError
from serving.redact import mask_text, mask_url

ARTIFACT_PATH = "model"  # where the pipeline logs a version folder in its MLflow run (tasks.registry)
_TIMEOUT = httpx.Timeout(30.0, connect=5.0)
_CHUNK = 1 << 20


class MlflowRest:
    """The few MLflow REST calls a registered version's files need."""

    def __init__(self, tracking_uri: str, source: str) -> None:
        """``source`` (the ``models:/`` string) only names the request in error messages."""
        self.tracking_uri = tracking_uri
        # What messages show: the URI may carry user:password (basic auth to the tracking server).
        self.shown_uri = mask_url(tracking_uri)
        self.source = source
        self._http = httpx.Client(base_url=tracking_uri, timeout=_TIMEOUT)

    def close(self) -> None:
        self._http.close()

    def _get(
        self, path: str, params: dict[str, str], *, missing: str, missing_codes: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        try:
            response = self._http.get(path, params=params)
        except httpx.TransportError as exc:
            raise RepositoryError(
                f"{self.source}: MLflow tracking server {self.shown_uri} is unreachable ({mask_text(str(exc))}): "
                "start it or "
                "fix mlflow_tracking_uri"
            ) from exc
        if response.status_code == 404 or _error_code(response) in ("RESOURCE_DOES_NOT_EXIST", *missing_codes):
            raise RepositoryError(f"{self.source}: {missing} (MLflow says: {_error_message(response)})")
        if response.is_error:
            raise RepositoryError(
                f"{self.source}: MLflow {path} answered {response.status_code} ({_error_message(response)}): "
                f"check the tracking server at {self.shown_uri}"
            )
        body: dict[str, Any] = response.json()
        return body

    def model_version(self, reference: str) -> dict[str, Any]:
        """The registered version named ``<name>@<alias>`` or ``<name>/<version>``."""
        if "@" in reference:
            name, _, alias = reference.rpartition("@")
            body = self._get(
                "/api/2.0/mlflow/registered-models/alias",
                {"name": name, "alias": alias},
                missing=f"no version of {name!r} holds the alias {alias!r}: set the alias in the registry, "
                "or name a version as models:/<name>/<version>",
                # MLflow answers an unknown alias with 400 INVALID_PARAMETER_VALUE, not 404.
                missing_codes=("INVALID_PARAMETER_VALUE",),
            )
        else:
            name, _, number = reference.rpartition("/")
            if not name or not number.isdigit():
                raise RepositoryError(
                    f"model repository {self.source!r} is not models:/<name>@<alias> or models:/<name>/<version>"
                )
            body = self._get(
                "/api/2.0/mlflow/model-versions/get",
                {"name": name, "version": number},
                missing=f"model {name!r} has no registry version {number}: list the versions in MLflow and "
                "name one that exists",
            )
        version: dict[str, Any] = body.get("model_version", {})
        return version

    def artifact_path(self, run_id: str, source: str) -> str:
        """The version's folder inside the run's artifacts, from its registered ``source`` URI.

        The pipeline registers ``<run artifact root>/model``; a version registered from elsewhere in the
        run is followed too, and anything unrecognised falls back to ``model``.
        """
        if source.startswith(f"runs:/{run_id}/"):
            return source.removeprefix(f"runs:/{run_id}/").strip("/") or ARTIFACT_PATH
        run = self._get(
            "/api/2.0/mlflow/runs/get", {"run_id": run_id}, missing=f"run {run_id} of the version no longer exists"
        )
        root = str(run.get("run", {}).get("info", {}).get("artifact_uri", "")).rstrip("/")
        if root and source.startswith(root + "/"):
            return source.removeprefix(root + "/").strip("/")
        return ARTIFACT_PATH

    def list_files(self, run_id: str, path: str) -> list[str]:
        """Every file (not folder) under ``path`` in the run's artifacts, recursively."""
        files: list[str] = []
        token = ""
        while True:
            params = {"run_id": run_id, "path": path, **({"page_token": token} if token else {})}
            body = self._get("/api/2.0/mlflow/artifacts/list", params, missing=f"run {run_id} has no {path!r}")
            for entry in body.get("files", []):
                entry_path = str(entry["path"])
                if entry.get("is_dir"):
                    files += self.list_files(run_id, entry_path)
                else:
                    files.append(entry_path)
            token = str(body.get("next_page_token") or "")
            if not token:
                return files

    def download(self, run_id: str, path: str, destination: Path) -> None:
        destination.parent.mkdir(parents=True, exist_ok=True)
        partial = destination.with_name(destination.name + ".partial")
        try:
            with self._http.stream("GET", "/get-artifact", params={"path": path, "run_uuid": run_id}) as response:
                if response.is_error:
                    response.read()
                    raise RepositoryError(
                        f"{self.source}: downloading {path} of run {run_id} answered {response.status_code} "
                        f"({_error_message(response)}): check the MLflow artifact store"
                    )
                with partial.open("wb") as handle:
                    for chunk in response.iter_bytes(_CHUNK):
                        handle.write(chunk)
        except httpx.TransportError as exc:
            raise RepositoryError(
                f"{self.source}: downloading {path} from {self.shown_uri} failed ({mask_text(str(exc))}): retry, "
                "or check "
                "the tracking server"
            ) from exc
        partial.replace(destination)


def _error_code(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error_code", ""))
    except ValueError:
        return ""


def _error_message(response: httpx.Response) -> str:
    """The server's error text, masked: a proxy or the tracking server may echo the URL it was asked."""
    try:
        body = response.json()
    except ValueError:
        return mask_text(response.text[:200] or response.reason_phrase)
    return mask_text(str(body.get("message") or body.get("error_code") or body)[:300])
