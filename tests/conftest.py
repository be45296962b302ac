import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _float64_and_single_thread():
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    yield
    torch.set_default_dtype(dtype)
