class KVCacheManager:
    def __init__(self, *args, **kwargs):
        self.kwargs = kwargs
