"""Fixtures: the TensorRT-LLM host double on sys.path, in either module layout, torn down after."""
from __future__ import annotations

import importlib
import sys

import pytest

from .fakehost import CURRENT, LAYOUTS, build_fake_host, purge_host_modules

@pytest.fixture(scope="session")
def fake_host_dirs(tmp_path_factory):
    return {layout: build_fake_host(tmp_path_factory.mktemp(layout.replace("/", "_")), layout)
            for layout in LAYOUTS}


def _activate(path):
    from m3_eagle_plugin.host import trtllm as adapter

    adapter.uninstall()
    purge_host_modules()
    sys.path.insert(0, str(path))
    importlib.invalidate_caches()
    return adapter


def _deactivate(path) -> None:
    from m3_eagle_plugin.host import trtllm as adapter

    adapter.uninstall()
    purge_host_modules()
    sys.path.remove(str(path))


@pytest.fixture(params=LAYOUTS, ids=["attention-backends", "attention_backend"])
def host(request, fake_host_dirs):
    """The double in each layout; yields the `tensorrt_llm` package with `.layout` set."""
    path = fake_host_dirs[request.param]
    _activate(path)
    import tensorrt_llm

    tensorrt_llm.layout = request.param
    yield tensorrt_llm
    _deactivate(path)


@pytest.fixture
def current_host(fake_host_dirs):
    """The double in the post-refactor layout only (for tests that do not depend on the layout)."""
    path = fake_host_dirs[CURRENT]
    _activate(path)
    import tensorrt_llm

    tensorrt_llm.layout = CURRENT
    yield tensorrt_llm
    _deactivate(path)
