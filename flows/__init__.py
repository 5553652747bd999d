"""Prefect flows: they only wire the pipeline's stage functions together.

Library warnings go to the debug log here as in the CLI (pipeline/library_warnings.py): a flow run's logs are a
user's terminal too.
"""

from pipeline.library_warnings import route_library_warnings

route_library_warnings()
