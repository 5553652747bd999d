"""Prefect flows: they only wire the pipeline's stage functions together."""
