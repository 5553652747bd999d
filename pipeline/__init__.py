"""Train-to-deploy pipeline for edge AI: train, consolidate, export, build, deploy."""

__version__ = "0.1.0"  # the one place it is set: pyproject.toml reads it; `pipeline.version` adds the revision
