import os

from hypothesis import HealthCheck, settings

# "ci" keeps the suite within its time budget; "long" is for a deeper local run:
#   CKPTOPT_HYPOTHESIS=long pytest tests/test_solvers.py
settings.register_profile(
    "ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("long", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("CKPTOPT_HYPOTHESIS", "ci"))
