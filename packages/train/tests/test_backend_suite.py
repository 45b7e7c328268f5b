"""The backend suite (``mtl.train.backend_suite``) for the ``local`` backend in fp32: its
layouts equal one process within the fp32 tolerances of ``mtl.train.testing``."""

import pytest

from mtl.train.backend_suite import *  # noqa: F403 (the suite's tests, collected here)
from mtl.train.backend_suite import BackendCase
from mtl.train.testing import LOSS_RTOL

LOCAL = BackendCase("local", ["model.backend='local'"], loss_rtol=LOSS_RTOL, grad_rel=1e-4, logits_atol=1e-5)


@pytest.fixture(params=[LOCAL], ids=lambda case: case.name)
def backend_case(request):
    return request.param
