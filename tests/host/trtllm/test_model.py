"""The MiniMax-M3 Eagle3 model class on the host double: Eagle3 base, capture, weights, aliases."""
from __future__ import annotations

import inspect
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch

from m3_eagle_plugin.host import trtllm as adapter


def _model_config(spec=True):
    from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig, MiniMaxM3SparseAttentionConfig

    return SimpleNamespace(
        pretrained_config=SimpleNamespace(hidden_size=8, vocab_size=16, num_hidden_layers=4),
        spec_config=Eagle3DecodingConfig() if spec else None,
        sparse_attention_config=MiniMaxM3SparseAttentionConfig())


def _classes():
    adapter.install()
    from tensorrt_llm._torch.models.modeling_utils import get_registered_model_class

    return (get_registered_model_class("MiniMaxM3SparseForCausalLM"),
            get_registered_model_class("MiniMaxM3SparseForConditionalGeneration"))


def test_model_is_a_one_engine_eagle3_target_with_unified_kv(host):
    from tensorrt_llm._torch.models.modeling_minimaxm3 import MiniMaxM3ForCausalLM
    from tensorrt_llm._torch.models.modeling_speculative import SpecDecOneEngineForCausalLM

    text_cls, _ = _classes()
    torch.manual_seed(0)
    model = text_cls(_model_config())
    assert isinstance(model, SpecDecOneEngineForCausalLM) and isinstance(model, MiniMaxM3ForCausalLM)
    assert model.use_separate_draft_kv_cache is False
    assert model.spec_worker.use_separate_draft_kv_cache is False
    model.setup_aliases()
    assert model.aliases_set_up and model.m3_aliases_set_up  # both setup_aliases ran


def test_capture_hooks_record_hidden_plus_residual_at_layer_exit(host):
    from tensorrt_llm._torch.speculative import SpecMetadata

    text_cls, _ = _classes()
    torch.manual_seed(0)
    model = text_cls(_model_config())
    ids = torch.tensor([1, 5, 7])
    spec = SpecMetadata(layers_to_capture=(1, 3))
    model.forward(None, input_ids=ids, spec_metadata=spec)
    # independent walk through the host model's layers
    hidden, residual, expected = model.model.embed_tokens(ids), None, {}
    for layer in model.model.layers:
        hidden, residual = layer(None, hidden, None, residual)
        expected[layer.layer_idx] = hidden + residual
    assert set(spec.captured) == {1, 3}
    for layer_id in (1, 3):
        torch.testing.assert_close(spec.captured[layer_id], expected[layer_id])
    spec.captured.clear()
    model.forward(None, input_ids=ids)  # no spec metadata: nothing captured, nothing stale
    assert spec.captured == {} and model.eagle3_capture.spec_metadata is None


def test_capture_after_setup_aliases_is_the_raw_layer_output_not_the_boundary_norm(host):
    # The host's setup_aliases wires next_layer_layernorm, so a layer returns
    # (rmsnorm(out + residual), out + residual). Eagle3 needs out + residual, which the post-#18872
    # host captures before that norm (modeling_minimaxm3.py forward_MoE / forward_mlp @ 12b1dd65).
    from tensorrt_llm._torch.speculative import SpecMetadata

    text_cls, _ = _classes()
    torch.manual_seed(0)
    model = text_cls(_model_config())
    model.setup_aliases()
    ids = torch.tensor([2, 4, 6, 8])
    spec = SpecMetadata(layers_to_capture=(0, 2, 3))
    model.forward(None, input_ids=ids, spec_metadata=spec)

    def rmsnorm(x, weight, eps):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    layers = model.model.layers
    stream = model.model.embed_tokens(ids)  # the residual stream, walked by hand
    normed, expected = rmsnorm(stream, layers[0].input_layernorm.weight, 1e-6), {}
    for i, layer in enumerate(layers):
        stream = torch.tanh(layer.proj(normed)) + stream
        expected[i] = stream
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
        normed = rmsnorm(stream, nxt.weight, nxt.variance_epsilon)
    assert set(spec.captured) == {0, 2, 3}
    for layer_id in (0, 2, 3):
        torch.testing.assert_close(spec.captured[layer_id], expected[layer_id])


def test_weights_go_through_the_host_m3_loader(host):
    """The host M3 loader first (it takes no `skip_modules`), then the Eagle3 base's, which has the
    generic loader skip the draft model, as the host's classes chain after #18872."""
    text_cls, vl_cls = _classes()
    a, b, c = torch.ones(2, 3), torch.zeros(2, 3), torch.full((1,), 7.0)
    model = text_cls(_model_config())
    model.load_weights({"model.layers.0.index_q_proj.weight": a,
                        "model.layers.0.index_k_proj.weight": b, "draft_model.fc.weight": c})
    assert model.skipped_modules == ["draft_model"]
    assert set(model.loaded) == {"model.layers.0.index_qk_proj.weight"}
    torch.testing.assert_close(model.loaded["model.layers.0.index_qk_proj.weight"], torch.cat([a, b]))
    vl = vl_cls(_model_config())
    vl.load_weights({"language_model.lm_head.weight": c, "vision_tower.patch.weight": a,
                     "language_model.model.mtp.0.weight": b})
    assert set(vl.loaded) == {"lm_head.weight"}


def test_a_vl_checkpoint_hands_the_text_loader_what_the_hosts_vl_split_does(current_host):
    """The released VL checkpoint stores the tower, its projector and the patch merger at the top
    level; the host's VL class splits all three off (`_VL_PREFIXES` in modeling_minimaxm3 at
    016beb63) before its text loader, which refuses unknown top-level names. The patch merger
    reached that loader."""
    _, vl_cls = _classes()
    t = torch.zeros(1)
    checkpoint = {"language_model.lm_head.weight": t, "language_model.model.norm.weight": t,
                  "vision_tower.blocks.0.weight": t, "multi_modal_projector.linear_1.weight": t,
                  "patch_merge_mlp.0.weight": t, "language_model.model.mtp.0.eh_proj.weight": t}
    host_vl_prefixes = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.")
    expected = {k[len("language_model."):] for k in checkpoint
                if k.startswith("language_model.") and not k.startswith("language_model.model.mtp.")}
    expected |= {k for k in checkpoint if not k.startswith(("language_model.", *host_vl_prefixes))}
    vl = vl_cls(_model_config())
    vl.load_weights(checkpoint)
    assert set(vl.loaded) == expected == {"lm_head.weight", "model.norm.weight"}


def _call_load_weights(load_method, weights, weight_mapper, allow_partial_loading=False):
    """`ModelLoader._call_load_weights` as in the host (tensorrt_llm/_torch/pyexecutor/model_loader.py,
    NVIDIA/TensorRT-LLM @ b51992a3): keywords go only to a method whose signature names them."""
    args = inspect.getfullargspec(load_method).args
    kwargs = {}
    if "weight_mapper" in args:
        kwargs["weight_mapper"] = weight_mapper
    if "allow_partial_loading" in args:
        kwargs["allow_partial_loading"] = allow_partial_loading
    else:
        assert allow_partial_loading is False, "allow_partial_loading is not supported for this model"
    load_method(weights, **kwargs)


def test_the_hosts_loader_hands_the_vl_class_its_weight_mapper_and_partial_loading(current_host, monkeypatch):
    """The host's loader reads the load method's signature: the checkpoint's weight mapper and a
    refit's partial loading (RL `update_weights`) reach the text loader through the plugin's VL class
    as through the host's own VL class. A `*args, **kwargs` signature got neither (the mapper was
    replaced by a default one, a partial reload failed its assert)."""
    from tensorrt_llm._torch.models import modeling_minimaxm3 as host_m3

    _, vl_cls = _classes()
    seen = []
    text_loader = host_m3.MiniMaxM3ForCausalLM.load_weights

    def recording(self, weights, weight_mapper=None, params_map=None, allow_partial_loading=False):
        seen.append((type(self), weight_mapper, allow_partial_loading))
        text_loader(self, weights, weight_mapper=weight_mapper, params_map=params_map,
                    allow_partial_loading=allow_partial_loading)

    monkeypatch.setattr(host_m3.MiniMaxM3ForCausalLM, "load_weights", recording)
    mapper, t = object(), torch.zeros(1)
    for cls in (host_m3.MiniMaxM3VLForConditionalGeneration, vl_cls):
        model = cls(_model_config())
        _call_load_weights(model.load_weights, {"language_model.lm_head.weight": t}, mapper)
        _call_load_weights(model.load_weights, {"language_model.model.norm.weight": t}, mapper,
                           allow_partial_loading=True)
    assert seen == [(host_m3.MiniMaxM3VLForConditionalGeneration, mapper, False),
                    (host_m3.MiniMaxM3VLForConditionalGeneration, mapper, True),
                    (vl_cls, mapper, False), (vl_cls, mapper, True)]
    assert set(model.loaded) == {"lm_head.weight", "model.norm.weight"}


def test_vl_config_builds_on_its_text_config_with_unified_kv(host):
    """A VL checkpoint's config (sizes only under `text_config`) builds as the host M3 constructor
    would build it; its converted copy keeps the unified draft/target KV policy."""
    _, vl_cls = _classes()
    cfg = _model_config()
    cfg.pretrained_config = SimpleNamespace(
        model_type="minimax_m3_vl", architectures=["MiniMaxM3SparseForConditionalGeneration"],
        text_config={"hidden_size": 8, "vocab_size": 16, "num_hidden_layers": 2})
    model = vl_cls(cfg)
    assert len(model.model.layers) == 2 and model.lm_head.weight.shape == (16, 8)
    assert model.use_separate_draft_kv_cache is False


@pytest.fixture
def post_18872_host(fake_host_dirs, tmp_path):
    """The double with its M3 class rewritten as after #18872 (an Eagle3 base of its own, which
    converts a VL config itself); reached only by forced activation."""
    from .conftest import _activate, _deactivate
    from .fakehost import CURRENT

    root = tmp_path / "post"
    shutil.copytree(fake_host_dirs[CURRENT], root)
    module = root / "tensorrt_llm/_torch/models/modeling_minimaxm3.py"
    text = module.read_text()
    for before, after in (
        ("class MiniMaxM3ForCausalLM(DecoderModelForCausalLM):",
         "class MiniMaxM3ForCausalLM(SpecDecOneEngineForCausalLM):"),
        ("""        super().__init__(MiniMaxM3Model(model_config), config=model_config,
                         hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size)""",
         """        super().__init__(MiniMaxM3Model(model_config), model_config,
                         hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size)"""),
        ("from .modeling_utils import",
         "from .modeling_speculative import SpecDecOneEngineForCausalLM\nfrom .modeling_utils import"),
    ):
        assert before in text
        text = text.replace(before, after)
    module.write_text(text)
    _activate(root)
    import tensorrt_llm

    yield tensorrt_llm
    _deactivate(root)
    assert str(root) not in sys.path


def test_vl_config_on_a_post_18872_host_keeps_unified_kv(post_18872_host):
    """There the host's own constructor would deep-copy a VL config; the plugin converts it first and
    marks the copy, so the Eagle3 base still sees the unified draft/target KV policy."""
    from m3_eagle_plugin.host.trtllm import model as plugin_model

    _, vl_cls = _classes()
    assert plugin_model.HOST_M3_IS_EAGLE3
    cfg = _model_config()
    cfg.pretrained_config = SimpleNamespace(
        model_type="minimax_m3_vl", text_config={"hidden_size": 8, "vocab_size": 16, "num_hidden_layers": 2})
    model = vl_cls(cfg)
    assert len(model.model.layers) == 2 and model.use_separate_draft_kv_cache is False


class _Recorder:
    """Spec metadata that captures the layers in `layers` (by the id the hook reports)."""

    def __init__(self, layers):
        self.layers, self.captured = set(layers), {}

    def is_layer_capture(self, layer_id):
        return layer_id in self.layers

    def maybe_capture_hidden_states(self, layer_id, hidden_states, residual=None):
        self.captured[layer_id] = hidden_states if residual is None else hidden_states + residual


class _Layer(torch.nn.Module):
    def __init__(self, layer_idx, scale):
        super().__init__()
        self.layer_idx, self.scale = layer_idx, scale

    def forward(self, x):
        return x * self.scale, x


def test_capture_reports_each_layers_own_index(current_host):
    """Layers that carry a global `layer_idx` (a pipeline rank's layers 10 and 11) are captured under
    that id, not under their position in the list; a layer without one falls back to its position."""
    from m3_eagle_plugin.host.trtllm.model import Eagle3CaptureHooks

    layers = [_Layer(10, 2.0), _Layer(11, 3.0), _Layer(None, 5.0)]
    hooks = Eagle3CaptureHooks(layers)
    hooks.spec_metadata = _Recorder({0, 1, 2, 11})
    x = torch.ones(2)
    for layer in layers:
        layer(x)
    assert set(hooks.spec_metadata.captured) == {11, 2}
    torch.testing.assert_close(hooks.spec_metadata.captured[11], x * 3.0 + x)
    torch.testing.assert_close(hooks.spec_metadata.captured[2], x * 5.0 + x)


def test_removed_capture_hooks_capture_nothing(current_host):
    from m3_eagle_plugin.host.trtllm.model import Eagle3CaptureHooks

    layers = [_Layer(0, 2.0)]
    hooks = Eagle3CaptureHooks(layers)
    hooks.spec_metadata = _Recorder({0})
    hooks.remove()
    layers[0](torch.ones(1))
    assert hooks.spec_metadata.captured == {} and layers[0]._forward_hooks == {}


def test_no_spec_metadata_outlives_its_forward(host):
    """After a forward with spec metadata (and after one that raises), a later direct run of the
    layers (warm-up, the drafter's own pass) captures nothing into that step's metadata."""
    from tensorrt_llm._torch.speculative import SpecMetadata

    text_cls, _ = _classes()
    torch.manual_seed(0)
    model = text_cls(_model_config())
    ids = torch.tensor([1, 2])
    spec = SpecMetadata(layers_to_capture=(0, 1))
    model.forward(None, input_ids=ids, spec_metadata=spec)
    assert set(spec.captured) == {0, 1} and model.eagle3_capture.spec_metadata is None
    spec.captured.clear()
    model.model(attn_metadata=None, input_ids=ids)
    assert spec.captured == {}
    with pytest.raises(IndexError):
        model.forward(None, input_ids=torch.tensor([99]), spec_metadata=spec)  # id past the vocab
    assert model.eagle3_capture.spec_metadata is None


def test_the_eagle3_base_forward_receives_the_step_spec_metadata(host, monkeypatch):
    """The one-engine base runs the spec worker (drafting) from its forward's `spec_metadata`: the
    plugin's forward hands it, and the other arguments, on unchanged."""
    from tensorrt_llm._torch.models.modeling_speculative import SpecDecOneEngineForCausalLM
    from tensorrt_llm._torch.speculative import SpecMetadata

    seen = []
    base_forward = SpecDecOneEngineForCausalLM.forward

    def forward(self, attn_metadata, input_ids=None, position_ids=None, inputs_embeds=None,
                return_context_logits=False, spec_metadata=None, resource_manager=None, **kwargs):
        seen.append((attn_metadata, position_ids, return_context_logits, spec_metadata, resource_manager, kwargs))
        return base_forward(self, attn_metadata, input_ids=input_ids, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, spec_metadata=spec_metadata)

    monkeypatch.setattr(SpecDecOneEngineForCausalLM, "forward", forward)
    text_cls, _ = _classes()
    model = text_cls(_model_config())
    spec, manager = SpecMetadata(layers_to_capture=(1,)), object()
    model.forward(None, input_ids=torch.tensor([3]), position_ids="pos", return_context_logits=True,
                  spec_metadata=spec, resource_manager=manager, extra="x")
    assert seen == [(None, "pos", True, spec, manager, {"extra": "x"})]


def test_the_hosts_m3_model_receives_the_forward_keywords_the_eagle3_base_passes_on(host, monkeypatch):
    """The host's one-engine base hands its forward's other keywords (and `spec_metadata`) on to the
    inner model (modeling_speculative.py @ 00679c66: `self.model(..., spec_metadata=..., **kwargs)`),
    where the double dropped them: through the plugin's class they must arrive there unchanged."""
    from tensorrt_llm._torch.models.modeling_minimaxm3 import MiniMaxM3Model
    from tensorrt_llm._torch.speculative import SpecMetadata

    seen = []
    model_forward = MiniMaxM3Model.forward

    def forward(self, attn_metadata, input_ids=None, position_ids=None, inputs_embeds=None, **kwargs):
        seen.append(kwargs)
        return model_forward(self, attn_metadata, input_ids=input_ids, position_ids=position_ids,
                             inputs_embeds=inputs_embeds, **kwargs)

    monkeypatch.setattr(MiniMaxM3Model, "forward", forward)
    text_cls, _ = _classes()
    model = text_cls(_model_config())
    spec, embeds = SpecMetadata(layers_to_capture=(1,)), torch.zeros(2, 8)
    model.forward(None, input_ids=torch.tensor([3, 4]), spec_metadata=spec, resource_manager=object(),
                  orig_input_ids=torch.tensor([3, 4]), mm_embeds=embeds)
    assert len(seen) == 1 and set(seen[0]) == {"spec_metadata", "orig_input_ids", "mm_embeds"}
    assert seen[0]["spec_metadata"] is spec and seen[0]["mm_embeds"] is embeds
    assert seen[0]["orig_input_ids"].tolist() == [3, 4]


def test_a_dropped_model_frees_its_layers_as_the_hosts_class_does(host):
    """Dropping the last reference frees the layers (every weight) at once, as it does for the host's
    own M3 class: the capture hooks add no reference cycle that waits for the cyclic collector."""
    import gc
    import weakref

    from tensorrt_llm._torch.models.modeling_minimaxm3 import MiniMaxM3ForCausalLM

    text_cls, _ = _classes()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        alive = {}
        for cls in (MiniMaxM3ForCausalLM, text_cls):
            model = cls(_model_config())
            model.setup_aliases()
            layers = [weakref.ref(layer) for layer in model.model.layers]
            del model
            alive[cls] = [ref() is not None for ref in layers]
    finally:
        if was_enabled:
            gc.enable()
    assert alive[MiniMaxM3ForCausalLM] == [False] * 4
    assert alive[text_cls] == alive[MiniMaxM3ForCausalLM]


def test_a_post_18872_host_model_gets_no_second_capture(post_18872_host):
    """That host's layers capture the Eagle3 states themselves (its layers take spec_metadata): the
    plugin hooks none of them, or each capture layer would be recorded a second time per step, the
    hook's value over the host's own."""
    text_cls, _ = _classes()
    torch.manual_seed(0)
    model = text_cls(_model_config())
    spec = _Recorder(range(len(model.model.layers)))
    model.forward(None, input_ids=torch.tensor([1, 5, 7]), spec_metadata=spec)
    assert spec.captured == {}
