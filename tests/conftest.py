import os

import pytest
import torch
from hypothesis import settings

# CI replays the same examples on every run; locally hypothesis keeps exploring.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _float64_and_single_thread():
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    yield
    torch.set_default_dtype(dtype)
