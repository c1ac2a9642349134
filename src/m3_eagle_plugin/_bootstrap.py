"""Interpreter-start bootstrap: the target of `m3_eagle_plugin.pth` and the PEP 829 `.start` file.

TensorRT-LLM has no plugin system, and its MPI workers and spawned servers are fresh interpreters,
so the only way to activate in every process is to run at interpreter start. This runs in *every*
Python process of the environment, so when the plugin is off it must cost next to nothing: it reads
a few environment variables and `sys.argv`, imports nothing beyond `os` and `sys`, and returns.

When enabled (`M3_EAGLE_PLUGIN` not off, or a `trtllm-*` style `--config`/`--extra_llm_api_options`
flag that may carry the `m3_eagle_plugin:` config key) it installs a one-shot `sys.meta_path` finder
that wraps the loader of `tensorrt_llm` only; right after `tensorrt_llm` finishes importing, the
real activation (`m3_eagle_plugin.activation`) runs. Neither torch nor tensorrt_llm is imported here.

An MPI-launched process (`MPI_MARKERS` in its environment) gets the finder even with the plugin
off, deferred: TensorRT-LLM's MPI pool workers receive the driver's `M3_EAGLE_*` settings only
after they start (mpi4py applies `env` before the first task, `patches/forward_env_to_mpi_pool.py`),
so the decision is taken when `tensorrt_llm` is imported; still off then, nothing else runs.

A `.pth` that outlived this package (deleted or renamed without pip, an editable checkout removed)
finds neither it nor this module and starts the interpreter silently, as if uninstalled; any other
failure to import this module is reported by `site` as usual.
"""
import os
import sys

ENV_VAR = "M3_EAGLE_PLUGIN"
HOST_MODULE = "tensorrt_llm"
#: The host's flags for the YAML that may hold the config key. trtllm-serve / trtllm-bench parse them
#: with click, which takes `--flag VALUE` or `--flag=VALUE` and no abbreviations, so only those two
#: spellings count: `--config-settings` (pip), `--configure` or `--configs` are other flags.
CONFIG_FLAGS = ("--extra_llm_api_options", "--config")
_CONFIG_FLAGS_WITH_VALUE = tuple(flag + "=" for flag in CONFIG_FLAGS)
#: Set by the MPI runtimes (Open MPI, MPICH / Intel MPI, PMIx) in every process they launch or spawn.
MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
_OFF_VALUES = ("", "off")


def wants_activation(environ, argv) -> bool:
    """True when the plugin is not off, or the command line may carry the YAML config key."""
    if environ.get(ENV_VAR, "").strip().lower() not in _OFF_VALUES:
        return True
    return any(is_config_flag(arg) for arg in argv)


def is_config_flag(arg) -> bool:
    """`--config` / `--extra_llm_api_options`, alone or as `flag=value`; nothing that merely starts alike."""
    return arg in CONFIG_FLAGS or arg.startswith(_CONFIG_FLAGS_WITH_VALUE)


def is_mpi_process(environ) -> bool:
    return any(name in environ for name in MPI_MARKERS)


def wants_bootstrap(environ, argv) -> bool:
    """True when the finder goes in: activation wanted now, or an MPI process that may learn later."""
    return wants_activation(environ, argv) or is_mpi_process(environ)


class _PostImportLoader:
    """Delegates to the real loader; runs the activation once the host module has executed."""

    def __init__(self, loader, finder) -> None:
        self._loader = loader
        self._finder = finder

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        if is_namespace_spec(getattr(module, "__spec__", None)) and not hasattr(module, "__file__"):
            module.__file__ = None  # as the import system sets it on the namespace packages it loads
        # Leave no trace of the wrapper on the host module.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._finder.on_host_imported(module)


def is_namespace_spec(spec) -> bool:
    """Whether ``spec`` is a namespace package's: no origin file, a search path (no __init__.py)."""
    return spec is not None and spec.origin is None and spec.submodule_search_locations is not None


def _namespace_loader(spec):
    """The loader the import system gives a namespace package (its class is public from Python 3.11)."""
    import importlib.machinery

    loader_class = getattr(importlib.machinery, "NamespaceLoader", None)
    if loader_class is None:
        from importlib._bootstrap_external import _NamespaceLoader as loader_class
    return loader_class(spec.name, list(spec.submodule_search_locations), importlib.machinery.PathFinder.find_spec)


class HostImportHook:
    """A `sys.meta_path` finder that reacts to the import of `tensorrt_llm` and nothing else."""

    _m3_eagle_host_hook = True  # marker that survives a reload of this module

    def __init__(self, module_name: str = HOST_MODULE, deferred: bool = False) -> None:
        self.module_name = module_name
        self.deferred = deferred  # decide from the environment at the host import (MPI workers)
        self.fired = False
        self._searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module_name or self._searching or self.fired:
            return None
        self._searching = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._searching = False
        if spec.loader is None and is_namespace_spec(spec):
            # A directory without __init__.py (an incomplete install, a stray directory on sys.path): the
            # import system would give it a namespace loader after this returns, and the activation would
            # never run (under require, the host loaded unpatched). Give it that loader now, wrapped.
            spec.loader = _namespace_loader(spec)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PostImportLoader(spec.loader, self)
        return spec

    def on_host_imported(self, module) -> None:
        if self.deferred and not wants_activation(os.environ, ()):
            self._retire()
            return
        from m3_eagle_plugin.activation import on_host_imported

        # Retired only once activation returns: when it raises (require), the host import fails and
        # a retried `import tensorrt_llm` must be refused again, not load the host unpatched.
        on_host_imported(module)
        self._retire()

    def _retire(self) -> None:
        self.fired = True
        remove_hook()


def installed_hook():
    for finder in sys.meta_path:
        if getattr(finder, "_m3_eagle_host_hook", False):
            return finder
    return None


def remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "_m3_eagle_host_hook", False)]


def install_hook(deferred: bool = False) -> None:
    """Activate right after `tensorrt_llm` is imported (or now, if it already is). `deferred`: only
    if the environment then asks for it."""
    if HOST_MODULE in sys.modules:
        if deferred and not wants_activation(os.environ, ()):
            return
        from m3_eagle_plugin.activation import on_host_imported

        on_host_imported(sys.modules[HOST_MODULE])
        return
    hook = installed_hook()
    if hook is None:
        sys.meta_path.insert(0, HostImportHook(deferred=deferred))
    elif not deferred:
        hook.deferred = False


def main() -> None:
    """Entry point of the `.pth` line and the `.start` file; safe to call more than once."""
    environ, argv = os.environ, getattr(sys, "argv", ())
    if wants_bootstrap(environ, argv):
        install_hook(deferred=not wants_activation(environ, argv))
