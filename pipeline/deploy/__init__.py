"""Deploy stage: versioned releases on targets, atomic switch, health check, automatic rollback, pruning.

Targets are local directories (`local`, `fleet`) or Jetsons over SSH from an inventory (`inventory`, `ssh`, `probe`,
`remote`, `rollout`, `ssh_fleet`, and `activate.sh`, which runs on the device).
"""

from pipeline.deploy.fleet import rollback, status
from pipeline.deploy.stage import STAGE, run

__all__ = ["STAGE", "rollback", "run", "status"]
