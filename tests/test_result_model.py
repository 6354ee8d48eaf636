"""Which downloaded model is a job's result (fedpartial_tools.deploy.admin.result_model)."""
from __future__ import annotations

from fedpartial.models import build_model, save_model_file
from fedpartial_tools.deploy.admin import find_results, result_model


def _save(path, task, arch, classes):
    model = build_model(arch, len(classes), 1, **({"channels": [4, 8], "strides": [2]} if arch == "unet" else {}))
    save_model_file(path, model, {"class_names": classes, "task": task, "input_size": [8, 8],
                                  "normalisation": {"mean": 0.5, "std": 0.5}})


def test_segmentation_result_is_the_best_model_classification_the_last(tmp_path):
    seg, cls = tmp_path / "seg" / "workspace", tmp_path / "cls" / "workspace"
    for folder, task, arch, classes in ((seg, "segmentation", "unet", ["lesion"]),
                                        (cls, "single-label", "small_cnn", ["a", "b"])):
        folder.mkdir(parents=True)
        for name in ("global_model.pt", "best_global_model.pt"):
            _save(folder / name, task, arch, classes)
    assert find_results(str(tmp_path / "seg"))["result_model"] == str(seg / "best_global_model.pt")
    assert find_results(str(tmp_path / "cls"))["result_model"] == str(cls / "global_model.pt")
    # no best model (e.g. a one-round job): the last aggregate
    assert result_model(str(seg / "global_model.pt"), None) == str(seg / "global_model.pt")
    assert result_model(None, None) is None
