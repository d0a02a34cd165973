import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same RNG state, so failures reproduce."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
