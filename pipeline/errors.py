"""The one error type users see: a single line naming what is wrong and where, exit code 2."""

from __future__ import annotations


class PipelineError(Exception):
    """A problem the user can fix (bad config, missing or corrupt file, unreachable host).

    The CLI prints ``error: <message>`` on one line and exits with :attr:`exit_code`,
    without a traceback. Bugs in the pipeline itself must *not* use this type.
    """

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class TransientError(PipelineError):
    """A failure a retry may cure: an unreachable host, a dropped connection, a remote build that timed out.

    Orchestrators (the Prefect flow) retry these and only these; every other PipelineError is deterministic.
    """
