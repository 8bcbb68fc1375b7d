"""Fixtures of the deployment tests (helpers in tests/deploy/helpers.py)."""

from __future__ import annotations

import pytest
import yaml

from tests.deploy.helpers import VARIANTS, Rendered, helm_template


@pytest.fixture(scope="session")
def rendered() -> dict[str, Rendered]:
    """Every variant of VARIANTS rendered once (helm template; about 0.1 s each)."""
    out = {}
    for name, args in VARIANTS.items():
        proc = helm_template(*args)
        assert proc.returncode == 0, f"helm template ({name}) failed:\n{proc.stderr}"
        objects = [o for o in yaml.safe_load_all(proc.stdout) if o]
        out[name] = Rendered(name, proc.stdout, objects)
    return out
