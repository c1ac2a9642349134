"""m3_eagle_plugin: one-model Eagle3 speculative decoding for MiniMax-M3 on MSA sparse attention.

Importing the package is deliberately cheap (the interpreter-start bootstrap imports it in every
process where the plugin is enabled): `activate` and `status` load the activation machinery on use.
"""
from m3_eagle_plugin._version import __version__

__all__ = ["__version__", "activate", "status"]


def activate(mode: "str | None" = None) -> "m3_eagle_plugin.activation.ActivationReport":  # noqa: F821
    """Activate the plugin on TensorRT-LLM (`mode`: off | auto | require; default `$M3_EAGLE_PLUGIN`)."""
    from m3_eagle_plugin.activation import activate as _activate

    return _activate(mode)


def status() -> "m3_eagle_plugin.activation.ActivationReport":  # noqa: F821
    """Report mode, host, manifest verdict, components and applied patches without activating."""
    from m3_eagle_plugin.activation import status as _status

    return _status()
