"""Train-to-deploy pipeline for edge AI: train, consolidate, export, build, deploy."""

__version__ = "0.1.0"
