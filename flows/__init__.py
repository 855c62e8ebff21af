"""The Prefect edge: flows, task wrappers around tasks/, deployments, the S3 -> Prefect event bridge."""

from serving.redact import install_log_masking

# Flow runs, the runner and the event bridge all import this package first: credentials in any URL
# they log (settings, exceptions from clients) are masked before a handler (Prefect's API one too) sees them.
install_log_masking()
