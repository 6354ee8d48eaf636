"""Evaluation metrics: ``classification_metrics`` (AUC, mAP, bacc, accuracy, F1, precision,
recall, per class); for segmentation ``validation_metrics`` / ``overlap_summary`` (pooled and
per-image foreground Dice / IoU, share of images with a predicted lesion) and
``segmentation_metrics`` (per-image means, empty = 1)."""
from fedpartial.metrics.classification import classification_metrics
from fedpartial.metrics.segmentation import (overlap_counts, overlap_summary, pooled_validation,
                                             segmentation_metrics, segmentation_scores, validation_metrics)

__all__ = ["classification_metrics", "overlap_counts", "overlap_summary", "pooled_validation",
           "segmentation_metrics", "segmentation_scores", "validation_metrics"]
