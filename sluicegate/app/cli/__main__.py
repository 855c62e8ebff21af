"""``python -m sluicegate.app.cli``: what the embedded stack runs for its child processes."""

from sluicegate.app.cli.main import app

app()
