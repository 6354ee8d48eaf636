"""fedpartial: federated learning from partially annotated medical images on NVIDIA FLARE."""
__version__ = "0.1.0"
