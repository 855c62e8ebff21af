"""The S3 -> Prefect event bridge: sources, normalisation, de-duplication, dead letters, the sink."""
