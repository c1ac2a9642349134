from .modeling_utils import get_registered_model_class

__all__ = ["get_registered_model_class"]
