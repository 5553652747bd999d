"""Deploy stage: content-addressed releases on targets, install-time engine builds for device classes without one,
atomic switch, health check, automatic rollback, pruning.

Targets are Jetsons over SSH from an inventory, or local directories standing in for devices; both go through the
same target-side steps (`remote`, and `activate.sh`, which runs on the target), over an SSH `Device` or
`hosts.LocalHost`. `rollout` orders a fleet in waves; `ssh_fleet` answers `status` and `rollback` for either.
"""

from pipeline.deploy.ssh_fleet import local_rollback as rollback
from pipeline.deploy.ssh_fleet import local_status as status
from pipeline.deploy.stage import STAGE, run

__all__ = ["STAGE", "rollback", "run", "status"]
