"""ec.Ragged (and ec.Sparse) built from torch tensors of any float dtype, with requires_grad or not, without
embedcore.inputs importing torch (duck typing)."""

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs the torch extra: pip install torch==2.13.0 'embedcore[torch]'")

import embedcore as ec  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_ragged_weights_from_torch_tensors_weigh_as_float32(dtype, requires_grad):
    ids = ec.Ragged(torch.tensor([1, 2, 2, 0, 4]), torch.tensor([0, 2, 2, 5]))
    w32 = np.array([0.5, 1.25, 2.0, -0.75, 3.0], np.float32)  # exact in every 16-bit format
    weights = torch.tensor(w32, dtype=dtype, requires_grad=requires_grad)
    ragged = ec.Ragged(weights, torch.tensor([0, 2, 2, 5]))
    assert isinstance(ragged.values, np.ndarray) and isinstance(ragged.row_splits, np.ndarray)
    np.testing.assert_array_equal(ragged.values.astype(np.float32), w32)
    emb = ec.Embedding({"f": ec.FeatureConfig(ec.TableConfig(5, 3, name="t", combiner="sum"))}, ec.SGD(0.1))
    acts, _ = emb.lookup({"f": ids}, {"f": ragged})
    expected, _ = emb.lookup({"f": ids}, {"f": ec.Ragged(w32, np.array([0, 2, 2, 5]))})
    np.testing.assert_array_equal(acts["f"], expected["f"])
    if requires_grad:
        assert weights.grad is None  # a constant: nothing flows back to it


def test_sparse_from_torch_tensors_with_requires_grad():
    values = torch.tensor([1.5, 2.0], dtype=torch.bfloat16, requires_grad=True)
    sparse = ec.Sparse(torch.tensor([[0, 0], [1, 0]]), values, (2, 1))
    np.testing.assert_array_equal(sparse.values, np.array([1.5, 2.0], np.float32))


def test_inputs_does_not_import_torch():
    code = "import sys, embedcore.inputs as i; i.Ragged([1], [0, 1]); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
