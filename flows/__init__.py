"""The Prefect edge: flows, task wrappers around tasks/, deployments, the S3 -> Prefect event bridge."""
