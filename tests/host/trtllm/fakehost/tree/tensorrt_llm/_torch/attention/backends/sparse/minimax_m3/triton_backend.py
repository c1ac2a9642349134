from tensorrt_llm._torch.attention.backends.trtllm import TrtllmAttention


class MiniMaxM3SparseRuntimeBackend(TrtllmAttention):
    pass
