"""Fakes for tests: a `tensorrt_llm` package (version via dist-info, the YAML merge function, a serve
module) and third-party plugin distributions."""
from __future__ import annotations

import textwrap
from pathlib import Path

FAKE_LLM_ARGS = '''
ALLOWED = {"model", "max_batch_size", "speculative_config", "kv_cache_config"}


def update_llm_args_with_extra_dict(llm_args, llm_args_dict, extra_llm_api_options=None):
    """Like the host: unknown top-level keys are rejected."""
    unknown = set(llm_args_dict) - ALLOWED
    if unknown:
        raise ValueError(f"unknown LlmArgs fields: {sorted(unknown)}")
    return {**llm_args, **llm_args_dict}


def update_llm_args_with_extra_options(llm_args, extra_llm_api_options):
    import yaml
    with open(extra_llm_api_options) as f:
        return update_llm_args_with_extra_dict(llm_args, yaml.safe_load(f), extra_llm_api_options)
'''

FAKE_SERVE = '''
import yaml
from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict


def load_args(path):
    with open(path) as f:
        return update_llm_args_with_extra_dict({"model": "m"}, yaml.safe_load(f))
'''


def write_fake_host(root: Path, version: str, *, install_double: bool = False) -> Path:
    """A minimal `tensorrt_llm` (with dist-info so importlib.metadata reports `version`) under `root`."""
    pkg = root / "tensorrt_llm"
    (pkg / "llmapi").mkdir(parents=True)
    (pkg / "commands").mkdir()
    init = f"__version__ = {version!r}\nimport tensorrt_llm.llmapi.llm_utils\n"
    if install_double:
        # Test double for the adapter's install(): activation runs right after this module executes.
        init += textwrap.dedent('''
            import m3_eagle_plugin.host.trtllm as _adapter
            _adapter.install = lambda: {"patches": ["fake-patch"], "installed_by": "fake host"}
        ''')
    (pkg / "__init__.py").write_text(init)
    (pkg / "llmapi" / "__init__.py").write_text("")
    (pkg / "llmapi" / "llm_args.py").write_text(FAKE_LLM_ARGS)
    (pkg / "llmapi" / "llm_utils.py").write_text(
        "from tensorrt_llm.llmapi.llm_args import update_llm_args_with_extra_dict\n")
    (pkg / "commands" / "__init__.py").write_text("")
    (pkg / "commands" / "serve.py").write_text(FAKE_SERVE)
    dist = root / f"tensorrt_llm-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: {version}\n")
    return root


def write_plugin_distribution(site: Path, name: str, entry_points: str, modules: dict[str, str] | None = None) -> None:
    """A dist-info `name 1.0` on sys.path `site` declaring `entry_points` (lines `name = module[:attr]`) in
    the plugin group, with `modules` (file path under `site` -> source) written beside it."""
    for path, source in (modules or {}).items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text(textwrap.dedent(source))
    dist = site / f"{name.replace('-', '_')}-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[m3_eagle_plugin]\n{entry_points}\n")
