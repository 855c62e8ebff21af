"""The model server: standalone; imports nothing from sluicegate/, tasks/ or flows/.

The protocol-agnostic core sits at the top (``dataplane``, ``types``, ``errors``, ``settings``,
``batching``, ``traffic``, ``repository``, ``model_format``, ``codec``, ``server`` for the process);
each transport is a subpackage over it (``grpc``, ``rest``), beside ``runtimes``, ``observability`` and
the generated ``proto``. serving/README.md lists every module's contract.
"""
