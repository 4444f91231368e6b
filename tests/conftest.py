import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when CUDA is not available (with the reason in the report)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


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
    """One intra-op thread for tests on tiny tensors, restored afterwards.

    On a loaded machine several OpenMP threads spin-waiting on each other make tiny kernels
    (small convolutions, MKL's LAPACK on r×r matrices) milliseconds to seconds slower per call.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
