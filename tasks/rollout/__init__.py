"""Canary rollout (DESIGN section 7): the plan and its pure analysis, the metrics sources, and the
platforms that move traffic (Kubernetes, or the local server's version weights)."""
