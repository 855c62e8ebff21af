"""The HTTP transport: ``side_port`` (uvicorn serving the port, with a deadline on request heads), ``app``
(the Starlette routes: health, ``/metrics``, the V2 REST routes, Triton's repository extension, the admin
traffic route; body limits, content types, errors) and ``converters`` (V2 REST JSON and Triton's binary
tensor data extension <-> serving/types.py). It shares serving/codec.py with the gRPC transport and
imports nothing from serving/grpc_api/."""
