"""The HTTP transport: ``side_port`` (health, ``/metrics``, the V2 REST routes, the admin traffic route)
and ``converters`` (V2 REST JSON and Triton's binary tensor data extension <-> serving/types.py). It
shares serving/codec.py with the gRPC transport and imports nothing from serving/grpc_api/."""
