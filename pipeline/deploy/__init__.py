"""Deploy stage: versioned releases on targets, atomic switch, health check, automatic rollback, pruning."""

from pipeline.deploy.fleet import rollback, status
from pipeline.deploy.stage import run

__all__ = ["rollback", "run", "status"]
