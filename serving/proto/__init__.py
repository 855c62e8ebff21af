"""Generated gRPC code: the KServe V2 / Open Inference Protocol service with Triton's ModelConfig and
ModelStatistics (``grpc_service_pb2``), and the traffic admin service (``admin_pb2``).

Do not edit the ``*_pb2*`` files: change the ``.proto`` and run ``make generate``
(scripts/generate_proto.sh); tests/serving/test_proto.py fails when they drift. The V2 messages live
in a private descriptor pool so that tritonclient, which registers the same ``inference.*`` names,
can be imported in the same process.
"""
