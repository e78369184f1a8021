"""scripts/gpu_step_reference.py times PyTorch rebuilds of hgsgc's models on a GPU; its
EXPECTED_PARAMS (checked there against each PyTorch model) must equal the Keras models' trainable
parameter counts, so that the GPU step of the bench's GPU-dilated cells is that of the same model.
PyTorch is not installed here, so the table is read from the script's source, not imported."""
import ast
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BUILD = {"lstm_small": dict(name="lstm_small", num_classes=10_000),
         "alexnet_w025": dict(name="alexnet", input_shape=(32, 32, 3), width=0.25, num_classes=10),
         "alexnet_small": dict(name="alexnet_small"),
         "resnet20": dict(name="resnet20"),
         "vgg16_w025": dict(name="vgg16", width=0.25)}


def expected_params():
    tree = ast.parse(open(os.path.join(ROOT, "scripts", "gpu_step_reference.py")).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "EXPECTED_PARAMS":
            return ast.literal_eval(node.value)
    raise AssertionError("EXPECTED_PARAMS not found in scripts/gpu_step_reference.py")


def test_expected_params_cover_the_models():
    assert set(expected_params()) == set(BUILD)


@pytest.mark.parametrize("key", sorted(BUILD))
def test_expected_params_equal_the_keras_models(key):
    from hgsgc.models import build_model

    m = build_model(**BUILD[key])
    n = sum(int(np.prod(w.shape)) for w in m.trainable_weights)
    assert n == expected_params()[key]
