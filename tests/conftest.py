import pytest
import torch


@pytest.fixture(autouse=True)
def _float64_and_seed():
    """Float64 by default, a fixed seed, and the global state restored afterwards."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)
