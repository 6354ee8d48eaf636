"""What a hospital does with a result model: predicting on its own images with decision thresholds
(:mod:`.predict`) and exporting the model for use outside fedpartial (:mod:`.export`). May import
the runtime and :mod:`fedpartial_tools.data` (the image readers)."""
