import os

import pytest
import torch

THREADS_VARIABLE = "LSN_EXT_TEST_THREADS"


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when CUDA is not available (with the reason in the report)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_configure(config):
    """Refuse a bad ``$LSN_EXT_TEST_THREADS`` before collecting anything."""
    value = os.environ.get(THREADS_VARIABLE, "1")
    if not value.isdigit() or int(value) < 1:
        raise pytest.UsageError(
            f"{THREADS_VARIABLE}={value!r}: expected a whole number of threads >= 1 (default 1)"
        )


@pytest.fixture(scope="session", autouse=True)
def _suite_threads():
    """One intra-op thread for the whole session (module fixtures included), restored after.

    Nearly every test works on tiny tensors, where a second OpenMP thread gains little and, on
    a loaded machine, costs many times over: threads spin-waiting on each other. On one thread a
    test needs one free core, not all of them. ``LSN_EXT_TEST_THREADS=2`` runs the suite on two
    threads. Scripts that tests start in subprocesses choose their own threads.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get(THREADS_VARIABLE, "1")))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _float64_and_seed():
    """Float64 by default, a fixed seed, and the global state restored afterwards."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture
def one_thread():
    """One intra-op thread for tests on tiny tensors, restored afterwards (also when the suite
    runs on more threads, see ``_suite_threads``).

    On a loaded machine several OpenMP threads spin-waiting on each other make tiny kernels
    (small convolutions, MKL's LAPACK on r×r matrices) milliseconds to seconds slower per call.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
