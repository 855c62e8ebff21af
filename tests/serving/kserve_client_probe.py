"""Talk to a running sluicegate server with KServe's own Python client (kserve 0.21), unchanged.

Runs inside the separate venv that ``scripts/kserve-client-venv.sh`` builds (kserve cannot be installed
into the project venv), so it imports nothing from this repository. Prints one JSON line:

    {"ok": bool, "input_sha256": str, "grpc": {check: result}, "rest": {check: result}}

where each result is ``{"ok": true, "value": ...}`` or ``{"ok": false, "error": "..."}``; inference
results carry the model version and every output as ``{"datatype", "shape", "data": [...]}``. Exit code 0
when every check passed, 1 when any failed (the JSON says which), 2 on bad arguments.

gRPC uses ``kserve.InferenceGRPCClient`` (live, ready, model ready, infer with raw and with typed
contents); that client has no metadata call, so model metadata goes through kserve's own generated stub
and messages. REST uses ``kserve.InferenceRESTClient`` with the V2 protocol (live, ready, model ready,
infer with JSON data and with KServe's default binary data); that client has no metadata call either,
so ``GET /v2/models/<name>`` is fetched with httpx and parsed as KServe's own ``ModelMetadataResponse``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import httpx
import numpy as np
from google.protobuf.json_format import MessageToDict
from kserve import InferenceGRPCClient, InferenceRESTClient, RESTConfig
from kserve.protocol.grpc.grpc_predict_v2_pb2 import ModelMetadataRequest
from kserve.protocol.grpc.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub
from kserve.protocol.infer_type import InferInput, InferRequest, InferResponse
from kserve.protocol.rest.v2_datamodels import ModelMetadataResponse

TIMEOUT_S = 30.0


async def check(results: dict[str, Any], name: str, call: Callable[[], Awaitable[Any]]) -> Any:
    """Run one client call, recording its value or its error under ``name``; returns the value or None."""
    try:
        value = await call()
    except Exception as exc:  # a probe reports every failure, whatever its type
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return None
    results[name] = {"ok": value is not False, "value": value}
    return value


def request(model: str, name: str, datatype: str, x: np.ndarray, *, binary: bool) -> InferRequest:
    given = InferInput(name=name, shape=list(x.shape), datatype=datatype)
    given.set_data_from_numpy(x, binary_data=binary)
    return InferRequest(model_name=model, infer_inputs=[given], request_id=f"kserve-probe-{int(binary)}")


def answer(response: InferResponse) -> dict[str, Any]:
    return {
        "model_version": response.model_version,
        "id": response.id,
        "outputs": {
            out.name: {"datatype": out.datatype, "shape": list(out.shape), "data": out.as_numpy().ravel().tolist()}
            for out in response.outputs
        },
    }


async def probe_grpc(target: str, model: str, x: np.ndarray) -> dict[str, Any]:
    results: dict[str, Any] = {}
    async with InferenceGRPCClient(target, timeout=TIMEOUT_S) as client:
        await check(results, "server_live", client.is_server_live)
        await check(results, "server_ready", client.is_server_ready)
        await check(results, "model_ready", lambda: client.is_model_ready(model))
        async with grpc.aio.insecure_channel(target) as channel:
            stub = GRPCInferenceServiceStub(channel)

            async def metadata() -> dict[str, Any]:
                reply = await stub.ModelMetadata(ModelMetadataRequest(name=model), timeout=TIMEOUT_S)
                return MessageToDict(reply, preserving_proto_field_name=True)

            meta = await check(results, "metadata", metadata)
        name, datatype = first_input(meta)
        for label, binary in (("infer_raw", True), ("infer_typed", False)):
            infer = request(model, name, datatype, x, binary=binary)
            await check(results, label, lambda infer=infer: answered(client.infer(infer)))
    return results


async def probe_rest(base_url: str, model: str, x: np.ndarray) -> dict[str, Any]:
    results: dict[str, Any] = {}
    async with InferenceRESTClient(RESTConfig(protocol="v2", timeout=TIMEOUT_S)) as client:
        await check(results, "server_live", lambda: client.is_server_live(base_url))
        await check(results, "server_ready", lambda: client.is_server_ready(base_url))
        await check(results, "model_ready", lambda: client.is_model_ready(base_url, model))

        async def metadata() -> dict[str, Any]:
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as plain:
                reply = await plain.get(f"{base_url}/v2/models/{model}")
            reply.raise_for_status()
            return ModelMetadataResponse.model_validate_json(reply.content).model_dump(exclude_none=True)

        meta = await check(results, "metadata", metadata)
        name, datatype = first_input(meta)
        for label, binary in (("infer_json", False), ("infer_binary", True)):
            infer = request(model, name, datatype, x, binary=binary)
            await check(results, label, lambda infer=infer: answered(client.infer(base_url, infer, model_name=model)))
    return results


async def answered(pending: Awaitable[InferResponse]) -> dict[str, Any]:
    return answer(await pending)


def first_input(meta: dict[str, Any] | None) -> tuple[str, str]:
    """The request is built from the served metadata, as a client would; the usual names if it is missing."""
    inputs = (meta or {}).get("inputs") or [{}]
    return str(inputs[0].get("name", "input")), str(inputs[0].get("datatype", "FP32"))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="gRPC address, host:port")
    parser.add_argument("--rest-url", help="HTTP side port base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="model name")
    parser.add_argument("--shape", required=True, help="input shape, comma separated, e.g. 1,3,32,32")
    parser.add_argument("--seed", type=int, default=0, help="seed of the FP32 standard-normal input")
    args = parser.parse_args(argv)
    if not (args.target or args.rest_url):
        parser.error("give --target, --rest-url or both")
    return args


async def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = tuple(int(size) for size in args.shape.replace("[", "").replace("]", "").split(","))
    x = np.random.default_rng(args.seed).standard_normal(shape).astype(np.float32)
    report: dict[str, Any] = {"input_sha256": hashlib.sha256(x.tobytes()).hexdigest()}
    if args.target:
        report["grpc"] = await probe_grpc(args.target, args.model, x)
    if args.rest_url:
        report["rest"] = await probe_rest(args.rest_url.rstrip("/"), args.model, x)
    checks = [result for side in ("grpc", "rest") for result in report.get(side, {}).values()]
    report["ok"] = all(result["ok"] for result in checks)
    return report


def main(argv: list[str]) -> int:
    report = asyncio.run(run(parse(argv)))
    print(json.dumps(report, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
