"""Stage logic as plain typed functions (no Prefect import); flows/ wraps them as tasks."""
