"""The model server: standalone; imports nothing from sluicegate/, tasks/ or flows/."""
