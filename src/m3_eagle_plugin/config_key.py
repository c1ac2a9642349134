"""The `m3_eagle_plugin:` key in the YAML given to `trtllm-serve --extra_llm_api_options` / `--config`.

TensorRT-LLM rejects unknown top-level keys (BaseLlmArgs forbids extras), so the key must be read and
removed before the host validates the dict. It is sugar for the environment variables: it sets
`M3_EAGLE_PLUGIN` (and `M3_EAGLE_PLUGIN_FORCE` / `_TRACE`) in `os.environ`, which processes this
one starts afterwards inherit, and under a bare `mpirun` every rank reads `--config` itself.
TensorRT-LLM's own MPI pool starts its workers from the environment the driver had when MPI
started (the first `tensorrt_llm` import, before this key is read), so the activated driver
forwards them through the pool's `env` (`host/trtllm/patches/forward_env_to_mpi_pool.py`).
Under `trtllm-llmapi-launch` (multi-node) only rank 0's command reads the file, in a process the
launcher marks with `TLLM_SPAWN_PROXY_PROCESS=1`; the model runs in the MPI ranks it started beside
it, from the launch's environment, and nothing the key exports reaches them. A key that would turn
on there what those ranks leave off is refused under `require`, before anything is exported (a
`trace` alone is only warned about), and warned about under `auto`: export such variables before
`mpirun` / `srun`.

Precedence: the environment wins. A variable already exported (non-blank) in the process, any of
`M3_EAGLE_PLUGIN`, `M3_EAGLE_PLUGIN_FORCE`, `M3_EAGLE_PLUGIN_TRACE`, is kept over the key's value;
when the two mean different things, one warning names the variable, both values and the winner.

Accepted values::

    m3_eagle_plugin: auto            # or require / off (YAML `off`/`on` booleans mean off / auto)
    m3_eagle_plugin:
      mode: require
      force: true                    # override the manifest's "defer" verdict
      trace: false                   # log every hook call

The parsing is pure (`split_config_key`, `settings_env`); `install_host_hook` wraps the host's
`update_llm_args_with_extra_dict`, the one function every YAML path goes through.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, MutableMapping

from m3_eagle_plugin.log import get_logger
from m3_eagle_plugin.switches import FALSE, FORCE_ENV, MODE_ENV, MODES, TRACE_ENV, TRUE

CONFIG_KEY = "m3_eagle_plugin"
#: Exported by TensorRT-LLM's `trtllm-llmapi-launch` for the command it runs on rank 0.
SPAWN_PROXY_ENV = "TLLM_SPAWN_PROXY_PROCESS"
HOST_FUNCTION = "update_llm_args_with_extra_dict"
HOST_MODULES = ("tensorrt_llm.llmapi.llm_args", "tensorrt_llm.llmapi.llm_utils")


class ConfigKeyError(ValueError):
    """The `m3_eagle_plugin:` config value is malformed."""


@dataclass(frozen=True)
class ConfigKeySettings:
    mode: str
    force: bool | None = None
    trace: bool | None = None


def _mode(value: Any) -> str:
    if isinstance(value, bool):  # YAML 1.1: `off` / `no` -> False, `on` / `yes` -> True
        return "auto" if value else "off"
    if value is None:
        return "off"
    if not isinstance(value, str) or value.strip().lower() not in MODES:
        raise ConfigKeyError(f"config key {CONFIG_KEY!r}: mode must be one of {', '.join(MODES)}, got {value!r}")
    return value.strip().lower()


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigKeyError(f"config key '{CONFIG_KEY}.{name}' must be true or false, got {value!r}")
    return value


def parse_config_value(value: Any) -> ConfigKeySettings:
    """Turn the YAML value of `m3_eagle_plugin:` into settings; raises `ConfigKeyError` when malformed."""
    if not isinstance(value, Mapping):
        return ConfigKeySettings(mode=_mode(value))
    # YAML reads bare `on:` / `1:` keys as bool / int: sort by repr, mixed types do not compare.
    unknown = sorted(set(value) - {"mode", "force", "trace"}, key=repr)
    if unknown:
        raise ConfigKeyError(f"config key {CONFIG_KEY!r}: unknown field(s) {unknown}; allowed: mode, force, trace")
    return ConfigKeySettings(
        mode=_mode(value.get("mode", "auto")),
        force=None if "force" not in value else _flag(value["force"], "force"),
        trace=None if "trace" not in value else _flag(value["trace"], "trace"),
    )


def split_config_key(config: Any) -> tuple[Any, ConfigKeySettings | None]:
    """Return (config without the key, parsed settings or None). The input is never modified."""
    if not isinstance(config, Mapping) or CONFIG_KEY not in config:
        return config, None
    settings = parse_config_value(config[CONFIG_KEY])
    remaining = {key: value for key, value in config.items() if key != CONFIG_KEY}
    return remaining, settings


def settings_env(settings: ConfigKeySettings) -> dict[str, str]:
    """The environment variables the settings stand for."""
    env = {MODE_ENV: settings.mode}
    if settings.force is not None:
        env[FORCE_ENV] = "1" if settings.force else "0"
    if settings.trace is not None:
        env[TRACE_ENV] = "1" if settings.trace else "0"
    return env


def _meaning(name: str, value: str) -> str:
    """A variable's value as the key would write it (`AUTO` -> `auto`, `yes` -> `1`), else as given."""
    value = value.strip().lower()
    if name != MODE_ENV and (value in TRUE or value in FALSE):
        return "1" if value in TRUE else "0"
    return value


def apply_settings(settings: ConfigKeySettings, environ: MutableMapping[str, str]) -> dict[str, str]:
    """Export the settings into `environ`, except variables the user already exported (the environment
    wins, with a warning when the values differ); returns what was set."""
    applied: dict[str, str] = {}
    for name, value in settings_env(settings).items():
        exported = environ.get(name, "")
        if not exported.strip():
            environ[name] = value
            applied[name] = value
        elif _meaning(name, exported) != value:
            get_logger().warning(f"config key {CONFIG_KEY}: {name} is exported as {exported!r} and wins over "
                                 f"{value!r} from the key")
    return applied


def check_launcher_ranks(settings: ConfigKeySettings, environ: Mapping[str, str]) -> None:
    """Under `trtllm-llmapi-launch`, the key's values that would turn something on here never reach the
    ranks that run the model: raise `ConfigKeyError` when the mode in effect is `require` (tracing
    alone excepted), else warn."""
    if environ.get(SPAWN_PROXY_ENV, "").strip() != "1":
        return
    unreached = {name: value for name, value in settings_env(settings).items()
                 if not environ.get(name, "").strip() and value not in ("off", "0")}
    mode = environ.get(MODE_ENV, "").strip().lower() or settings.mode
    if not unreached or mode == "off":
        return
    exports = " ".join(f"{name}={value}" for name, value in unreached.items())
    message = (f"config key {CONFIG_KEY}: {SPAWN_PROXY_ENV}=1 (trtllm-llmapi-launch): the model runs in MPI ranks "
               f"started before this file was read, which do not see {exports}; export before mpirun / srun")
    if mode == "require" and set(unreached) - {TRACE_ENV}:  # tracing alone changes only what is logged
        raise ConfigKeyError(message)
    get_logger().warning(message)


def consume_config_key(config: Any, environ: MutableMapping[str, str] | None = None) -> Any:
    """Strip the key from a host config dict, export it, and activate if it enables the plugin."""
    stripped, settings = split_config_key(config)
    if settings is None:
        return config
    target = os.environ if environ is None else environ
    check_launcher_ranks(settings, target)
    applied = apply_settings(settings, target)
    if environ is None and applied.get(TRACE_ENV) == "1":
        from m3_eagle_plugin.registry import trace_switched_on

        trace_switched_on()  # a manager built before the key was read (the variable activated) read it unset
    from m3_eagle_plugin.activation import activate

    activate()
    return stripped


_originals: dict[str, Callable[..., Any]] = {}


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_llm_args_with_extra_dict(llm_args: Any, llm_args_dict: Any, *args: Any, **kwargs: Any) -> Any:
        return original(llm_args, consume_config_key(llm_args_dict), *args, **kwargs)

    update_llm_args_with_extra_dict.__wrapped__ = original  # type: ignore[attr-defined]
    update_llm_args_with_extra_dict.__doc__ = original.__doc__
    update_llm_args_with_extra_dict._m3_eagle_config_key = True  # type: ignore[attr-defined]
    return update_llm_args_with_extra_dict


def _binding(module: Any) -> Any:
    # The raw namespace, not getattr() or vars(): a lazy module-level __getattr__ must not run here, nor
    # the `__getattribute__` of an `importlib.util.LazyLoader` module (any attribute access, `__dict__`
    # included, executes it) or of any other object that sits in sys.modules.
    try:
        namespace = object.__getattribute__(module, "__dict__")
    except Exception:  # noqa: BLE001 - no namespace of its own: it cannot hold the host function
        return None
    return namespace.get(HOST_FUNCTION) if isinstance(namespace, dict) else None


def install_host_hook() -> list[str]:
    """Wrap the host's YAML merge function wherever it is bound; returns the rebound module names.

    `tensorrt_llm.commands.serve` binds the function by `from ... import`, so every loaded module that
    holds the original object is rebound too (modules imported later bind the wrapper).
    """
    import importlib

    original = None
    for name in HOST_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        candidate = getattr(module, HOST_FUNCTION, None)
        if callable(candidate):
            original = getattr(candidate, "__wrapped__", candidate) if getattr(
                candidate, "_m3_eagle_config_key", False) else candidate
            break
    if original is None:
        return []
    wrapper = _originals.get("wrapper")
    if wrapper is None or _originals.get("original") is not original:
        wrapper = _wrap(original)
        _originals.update(original=original, wrapper=wrapper)
    rebound = []
    for module_name, module in list(sys.modules.items()):
        if _binding(module) is original:
            setattr(module, HOST_FUNCTION, wrapper)
            rebound.append(module_name)
    return rebound


def uninstall_host_hook() -> None:
    """Undo `install_host_hook` (tests)."""
    original, wrapper = _originals.get("original"), _originals.get("wrapper")
    if original is None:
        return
    for module in list(sys.modules.values()):
        if _binding(module) is wrapper:
            setattr(module, HOST_FUNCTION, original)
    _originals.clear()
