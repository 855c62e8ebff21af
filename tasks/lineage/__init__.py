"""Lineage: walk from a request, a model version or a dataset version to everything it came from and
went into (``walk``), over the metadata store's rows (``rows``), MLflow records (``records``) and the
model server's request logs (``request_logs``). MLflow run tracking during a pipeline is ``tasks.tracking``."""
