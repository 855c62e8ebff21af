"""Prometheus metrics: moved to ``serving.observability.metrics``."""

from serving.observability.metrics import ServerMetrics as ServerMetrics
