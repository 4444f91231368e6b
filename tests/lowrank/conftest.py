import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (tests/conftest.py's ``one_thread``)."""
