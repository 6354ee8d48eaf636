"""Models: ``build_model(arch, num_classes, in_channels, **arch_args) -> FedModel`` and
self-describing model files (``save_model_file`` / ``save_weights_file`` / ``load_model_file``) and
pretrained starts (``load_pretrained``)."""
from fedpartial.models.io import (FORMAT, ModelFileError, load_model_file, read_model_file, save_model_file,
                                  save_weights_file)
from fedpartial.models.networks import ARCHS, CLASSIFICATION, SEGMENTATION, FedModel, build_model
from fedpartial.models.pretrained import load_pretrained

__all__ = ["ARCHS", "CLASSIFICATION", "SEGMENTATION", "FORMAT", "FedModel", "ModelFileError", "build_model",
           "load_model_file", "load_pretrained", "read_model_file", "save_model_file", "save_weights_file"]
