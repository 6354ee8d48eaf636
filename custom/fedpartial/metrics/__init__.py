"""Evaluation metrics: ``classification_metrics`` (AUC, mAP, bacc, accuracy, F1, precision,
recall, per class) and ``segmentation_metrics`` (foreground Dice, IoU)."""
from fedpartial.metrics.classification import classification_metrics
from fedpartial.metrics.segmentation import (overlap_counts, overlap_summary, segmentation_metrics,
                                             segmentation_scores)

__all__ = ["classification_metrics", "overlap_counts", "overlap_summary", "segmentation_metrics",
           "segmentation_scores"]
