"""The gRPC transport (the inference path): KServe V2 ``inference.GRPCInferenceService`` with Triton's
extensions and the traffic admin service. ``servicer`` (thin methods over the data plane), ``converters``
(ModelInfer messages <-> serving/types.py), ``fast_infer`` (the common ModelInfer form, zero-copy),
``converters_meta`` (metadata, repository index, ModelConfig, ModelStatistics), ``rpc_errors`` (the one
place a ``ServingError`` becomes a status) and ``server`` (one ``grpc.server`` with every service bound).

Named ``grpc_api`` rather than ``grpc``: a folder named ``grpc`` on ``sys.path`` (a script run from
serving/, or from a mirrored tests folder) would shadow the grpcio library."""
