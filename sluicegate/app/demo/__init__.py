"""``sluicegate demo``: the whole chain on the embedded stack, with a summary at the end."""
