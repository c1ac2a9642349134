"""Host double of TensorRT-LLM (test-only): real module paths, class names and signatures of the
symbols m3_eagle_plugin touches, with tiny pure-torch bodies. Pre-#18872 behaviour."""
from .version import __version__
