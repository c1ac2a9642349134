"""m3_eagle_plugin: one-model Eagle3 speculative decoding for MiniMax-M3 on MSA sparse attention."""
from m3_eagle_plugin._version import __version__

__all__ = ["__version__"]
