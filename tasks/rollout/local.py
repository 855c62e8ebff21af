"""The local rollout platform: the canary runs inside one sluicegate model server, as a second loaded
version of the model, and traffic moves with the server's version weights (the authenticated admin
route of serving/rest_api/side_port.py). The whole canary, metrics analysis and rollback included, runs
on one machine.

The server serves a local repository folder (``sluicegate serve --repo DIR``). A canary version is put
into that folder (``fetch``: e.g. downloaded from the registry) and loaded with ``RepositoryModelLoad``;
a retired version is moved to ``DIR/.retired/`` (the server skips dot folders) and the next load
unloads it, after its in-flight requests finish. Which version is stable, which the canary and what
stable ran before is kept beside the model in ``DIR/<model>/.rollout.json``: the platform's state lives
where it acts, so a re-run after a crash reads it back.

Order matters for the traffic: weights are pinned to stable *before* a canary is loaded (with no
weights, the server sends everything to the newest version), and moved to stable before a canary is
unloaded.

With TLS on the server (``SLUICEGATE_SERVING__TLS_*``), ``ClientTls`` (from ``rollout.tls_*``) makes both
admin clients verify it against the CA and, for mutual TLS, present the client certificate.
"""

from __future__ import annotations

import json
import shutil
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import httpx

from serving.proto import grpc_service_pb2 as pb
from serving.proto import grpc_service_pb2_grpc as pb_grpc
from tasks.rollout.platform import PlatformError, PlatformState

if TYPE_CHECKING:
    from sluicegate.settings import RolloutSettings

Fetch = Callable[[str, str, Path], None]  # (model, version, destination folder) -> the version's files there


@dataclass(frozen=True)
class ClientTls:
    """What a client of a TLS model server uses: the CA that signed the server's certificate (None: the
    system's trust store) and, for mutual TLS, the client certificate and its key."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    def _read(self, path: Path | None) -> bytes | None:
        try:
            return path.read_bytes() if path is not None else None
        except OSError as exc:
            raise PlatformError(f"cannot read the TLS file {path}: {exc}") from exc

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca_file),
            private_key=self._read(self.key_file),
            certificate_chain=self._read(self.cert_file),
        )

    def ssl_context(self) -> ssl.SSLContext:
        """For httpx's ``verify=``."""
        try:
            context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
            if self.cert_file is not None:
                context.load_cert_chain(str(self.cert_file), str(self.key_file) if self.key_file else None)
        except (OSError, ssl.SSLError) as exc:
            raise PlatformError(f"cannot load the TLS files {self}: {exc}") from exc
        return context


def client_tls(rollout: RolloutSettings) -> ClientTls | None:
    """The rollout settings' TLS for the local server's clients; None: plaintext."""
    if not rollout.client_tls:
        return None
    return ClientTls(rollout.tls_ca_file, rollout.tls_client_cert_file, rollout.tls_client_key_file)


class LocalPlatform:
    """Version weights of one local model server.

    Args:
        repository: The folder the server serves.
        grpc_target: The server's gRPC address, e.g. ``127.0.0.1:8001``.
        http_url: The server's side port, e.g. ``http://127.0.0.1:8000``.
        admin_token: The server's ``SLUICEGATE_SERVING__ADMIN_TOKEN``.
        fetch: Puts a version's files into the repository when it is not there yet.
        ready_timeout_s: How long a freshly loaded version may take to be ready.
        tls: The server's CA (and client certificate) when it serves TLS; ``http_url`` is then https://.
    """

    name = "local"

    def __init__(
        self,
        repository: Path,
        grpc_target: str,
        http_url: str,
        admin_token: str,
        *,
        fetch: Fetch | None = None,
        ready_timeout_s: float = 120.0,
        tls: ClientTls | None = None,
    ) -> None:
        self.repository, self.grpc_target, self.http_url = Path(repository), grpc_target, http_url.rstrip("/")
        if tls is not None and not self.http_url.startswith("https://"):
            raise PlatformError(f"TLS is set but the side port URL {http_url!r} is not https://")
        self.tls = tls
        self._token = admin_token
        # One client for the platform's life (a client per call cost 50-100 ms here), token on every call.
        self._http = httpx.Client(
            headers={"Authorization": f"Bearer {admin_token}"},
            timeout=10,
            verify=tls.ssl_context() if tls is not None else True,
        )
        self.fetch, self.ready_timeout_s = fetch, ready_timeout_s

    # -- the interface ----------------------------------------------------------------------------

    def state(self, model: str) -> PlatformState:
        recorded = self._read(model)
        stable, canary = recorded.get("stable"), recorded.get("canary")
        weights = self._weights(model) if stable else {}
        weight = int(weights.get(canary, 0)) if canary else 0
        total = sum(weights.values())
        percent = round(100 * weight / total) if total else 0
        return PlatformState(model, stable, canary, percent, recorded.get("previous"))

    def start_canary(self, model: str, version: str) -> PlatformState:
        recorded = self._read(model)
        stable = recorded.get("stable")
        if stable is None:
            raise PlatformError(
                f"model {model!r} has no stable version on the local server: deploy one first "
                "(`sluicegate models promote` then serve it), the canary needs something to compare with"
            )
        if version == stable:
            raise PlatformError(f"version {version!r} of {model!r} is already stable: nothing to roll out")
        self._set_weights(model, {stable: 100})  # before the load: a new version must not take the traffic
        target = self.repository / model / version
        if not target.is_dir():
            if self.fetch is None:
                raise PlatformError(f"{target} does not exist and no fetch function was given to bring it")
            self.fetch(model, version, target)
        self._write(model, {**recorded, "canary": version})
        self._load(model)
        self._wait_ready(model, version)
        self._set_weights(model, {stable: 100, version: 0})
        return self.state(model)

    def set_weight(self, model: str, canary_percent: int) -> PlatformState:
        if not 0 <= canary_percent <= 100:
            raise PlatformError(f"canary weight {canary_percent} is outside 0..100")
        recorded = self._read(model)
        stable, canary = recorded.get("stable"), recorded.get("canary")
        if stable is None or canary is None:
            raise PlatformError(f"model {model!r} has no canary to weigh (start one first)")
        self._set_weights(model, {stable: 100 - canary_percent, canary: canary_percent})
        return self.state(model)

    def promote(self, model: str) -> PlatformState:
        recorded = self._read(model)
        stable, canary = recorded.get("stable"), recorded.get("canary")
        if canary is None:
            if recorded.get("previous") and stable:  # a promotion that crashed after recording: finish it
                self._retire(model, str(recorded["previous"]))
                return self.state(model)
            raise PlatformError(f"model {model!r} has no canary to promote")
        self._set_weights(model, {canary: 100})
        self._write(model, {"stable": canary, "canary": None, "previous": stable})
        if stable is not None:
            self._retire(model, stable)
        return self.state(model)

    def rollback(self, model: str) -> PlatformState:
        recorded = self._read(model)
        stable, canary = recorded.get("stable"), recorded.get("canary")
        if stable is not None:
            self._set_weights(model, {stable: 100})
        if canary is not None:
            self._write(model, {**recorded, "canary": None})
            self._retire(model, canary)
        return self.state(model)

    # -- outside the interface: the first deployment ----------------------------------------------

    def adopt(self, model: str, version: str) -> PlatformState:
        """Make ``version`` the model's stable version with all the traffic: the first deployment, when
        there is no stable version to compare a canary with (fetched into the repository if missing)."""
        target = self.repository / model / version
        if not target.is_dir():
            if self.fetch is None:
                raise PlatformError(f"{target} does not exist and no fetch function was given to bring it")
            self.fetch(model, version, target)
        recorded = self._read(model)
        self._write(model, {"stable": version, "canary": None, "previous": recorded.get("stable")})
        self._load(model)
        self._wait_ready(model, version)
        self._set_weights(model, {version: 100})
        return self.state(model)

    # -- helpers ----------------------------------------------------------------------------------

    def _state_file(self, model: str) -> Path:
        return self.repository / model / ".rollout.json"

    def _read(self, model: str) -> dict[str, Any]:
        path = self._state_file(model)
        if not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            raise PlatformError(f"{path} is not JSON ({exc}): fix or delete it, then re-run") from exc
        return data if isinstance(data, dict) else {}

    def _write(self, model: str, data: dict[str, Any]) -> None:
        path = self._state_file(model)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(data, indent=2, sort_keys=True))
        partial.replace(path)  # atomic: a crash leaves the old state or the new one

    def _retire(self, model: str, version: str) -> None:
        source = self.repository / model / version
        if source.is_dir():
            target = self.repository / ".retired" / model / f"{version}-{time.time_ns()}"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(source), str(target))
        self._load(model)  # unloads the version now gone from the folder, after its in-flight requests

    def _channel(self) -> grpc.Channel:
        if self.tls is not None:
            return grpc.secure_channel(self.grpc_target, self.tls.grpc_credentials())
        return grpc.insecure_channel(self.grpc_target)

    def _load(self, model: str) -> None:
        with self._channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            try:
                stub.RepositoryModelLoad(
                    pb.RepositoryModelLoadRequest(model_name=model),
                    timeout=self.ready_timeout_s,
                    metadata=(("authorization", f"Bearer {self._token}"),),  # loading changes what is served
                )
            except grpc.RpcError as exc:
                raise PlatformError(
                    f"the server at {self.grpc_target} could not (re)load {model!r}: {exc.code().name} {exc.details()}"
                ) from exc

    def _wait_ready(self, model: str, version: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        with self._channel() as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            while time.monotonic() < deadline:
                try:
                    if stub.ModelReady(pb.ModelReadyRequest(name=model, version=version), timeout=5).ready:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise PlatformError(f"{model}/{version} was not ready on {self.grpc_target} after {self.ready_timeout_s:.0f} s")

    def _weights(self, model: str) -> dict[str, int]:
        try:
            response = self._http.get(f"{self.http_url}/v2/models/{model}/traffic")
        except httpx.HTTPError as exc:
            raise PlatformError(f"the server at {self.http_url} did not answer: {exc}") from exc
        if response.status_code == 404:
            return {}
        return dict(self._checked(response)["weights"])

    def _set_weights(self, model: str, weights: dict[str, int]) -> None:
        try:
            response = self._http.put(f"{self.http_url}/v2/models/{model}/traffic", json={"weights": weights})
        except httpx.HTTPError as exc:
            raise PlatformError(f"the server at {self.http_url} did not answer: {exc}") from exc
        self._checked(response)

    def _checked(self, response: httpx.Response) -> dict[str, Any]:
        if response.status_code == 401:
            raise PlatformError("the server refused the admin token: pass the server's SLUICEGATE_SERVING__ADMIN_TOKEN")
        if response.status_code >= 400:
            raise PlatformError(f"traffic call failed: HTTP {response.status_code} {response.text[:300]}")
        body: dict[str, Any] = response.json()
        return body
