"""sluicegate: from a dataset landing in S3 to a better model serving traffic, gated and traceable."""

__version__ = "0.1.0"
