"""A real Prefect API (temporary SQLite server) for the whole test session."""

import pytest
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session", autouse=True)
def prefect_api():
    with prefect_test_harness(server_startup_timeout=60):
        yield
