"""Reference-host test fixtures: one tiny checkpoint pair per session."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """`m3-eagle make-tiny` output: (target dir, draft dir)."""
    from m3_eagle_plugin.models.tiny import make_tiny

    out = tmp_path_factory.mktemp("reference_host_tiny")
    return make_tiny(out, seed=5)
