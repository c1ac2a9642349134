"""The embedded reference host: a compact one-model Eagle3 speculative-decoding engine.

engine (request lifecycle, stats) -> scheduler (which rows run this step) -> runner (metadata,
target forward, accept, draft loop; cuda_graphs for generation steps) -> sampler (greedy /
lossless rejection). `build_engine` assembles one from checkpoint directories; `m3-eagle run`
(cli) drives it from the command line.
"""
from m3_eagle_plugin.host.reference.build import build_engine
from m3_eagle_plugin.host.reference.engine import Engine, EngineConfig, GenerationResult
from m3_eagle_plugin.host.reference.sampler import SamplingParams

__all__ = ["Engine", "EngineConfig", "GenerationResult", "SamplingParams", "build_engine"]
