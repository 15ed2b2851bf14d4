import gc
import os

import pytest

from hypothesis import HealthCheck, settings

# "ci" keeps the suite within its time budget; "long" is for a deeper local run:
#   CKPTOPT_HYPOTHESIS=long pytest tests/test_solvers.py
settings.register_profile(
    "ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("long", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("CKPTOPT_HYPOTHESIS", "ci"))


# The library collects garbage before each measurement (``measure_peak``, and each layer measured on
# real tensors), so that no earlier garbage is freed inside the measured step. A full collection walks
# every object of the process: with transformers, diffusers and the suite's earlier models loaded, a
# few tenths of a second each, thousands of times. Each test starts by collecting the garbage and
# moving what survives (imports, module fixtures, earlier models still referenced) to the permanent
# generation, so the library's collections walk only what the running test made.
@pytest.fixture(autouse=True)
def _collect_and_freeze_what_earlier_tests_left():
    gc.collect()
    gc.freeze()
    yield
