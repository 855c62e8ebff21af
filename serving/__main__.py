"""``python -m serving``: the server process (``serving.server.main``)."""

from serving.memory import bound_heap_retention, start_trimmer

# Before gRPC, ONNX Runtime or the telemetry thread exist: the allocator's heap limit binds new threads only.
bound_heap_retention()
start_trimmer()

from serving.server import main  # noqa: E402 - after the allocator is set, on purpose

main()
