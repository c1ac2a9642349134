_ZOO_PACKAGE = "tensorrt_llm._torch.models"

MODEL_ARCH_TO_MODULE = {
    "MiniMaxM3SparseForCausalLM": "modeling_minimaxm3",
    "MiniMaxM3SparseForConditionalGeneration": "modeling_minimaxm3",
}


def is_builtin_zoo_module(module_name: str) -> bool:
    return module_name == _ZOO_PACKAGE or module_name.startswith(_ZOO_PACKAGE + ".")
