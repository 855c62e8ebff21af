"""Alembic migrations of the metadata store (``script_location``); run through ``MetadataStore``."""
