"""The server's observability: Prometheus metrics (with NVML GPU gauges), feature drift, output entropy,
JSON request logs and OpenTelemetry tracing. Self-contained: each module imports only numpy, scipy,
prometheus-client, opentelemetry and (lazily, optionally) pynvml, and nothing else from the server."""
