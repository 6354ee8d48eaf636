"""``python -m fedpartial export``: a fedpartial model file as TorchScript or as a MONAI bundle.

Both hold the network traced (``torch.jit.trace``) behind a wrapper that takes the normalised
float tensor ``(N, C, H, W)`` the model was trained on (``(x / 255 - mean) / std`` at the model's
``input_size``) and returns probabilities (softmax single-label, sigmoid multi-label and
segmentation), so nothing of fedpartial is needed to run them.

* ``torchscript``: ``OUT/model.ts``; the model file's meta (task, classes, input size,
  normalisation, decision thresholds, provenance) is stored inside it as MONAI's
  ``metadata.json`` extra file (``monai.data.load_net_with_metadata`` reads it back).
* ``monai-bundle``: ``configs/metadata.json``, ``configs/inference.json``, ``configs/logging.conf``,
  ``models/model.ts``, ``models/model.pt`` (the state dict of ``model.ts``'s module) and
  ``docs/README.md``. MONAI's
  own runner predicts on a folder of PNG / JPEG images::

      python -m monai.bundle run --config_file OUT/configs/inference.json --dataset_dir IMAGES \\
          --output_dir RESULTS

  Classification writes ``RESULTS/predictions.csv`` (file, per class the probability, then per
  class the decision); segmentation writes one ``<image>_mask.png`` per image at the image's size.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

FORMATS = ("torchscript", "monai-bundle")
# Meta values longer than this as JSON (e.g. per-class statistics of a method) are left out of the
# bundle's provenance and named instead.
MAX_PROVENANCE_JSON = 2000
# described on their own in the export; everything else of the meta is provenance
_MODEL_KEYS = ("class_names", "task", "input_size", "normalisation", "spec")


@contextlib.contextmanager
def _no_jit_deprecation():
    """torch 2.9+ marks torch.jit deprecated; TorchScript is still what MONAI bundles and MONAI Deploy load."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit.*deprecated")
        yield


def probability_net(model, task: str):
    """``model`` (``x -> (features, logits)``) as a module ``x -> probabilities``.

    Args:
        model: a fedpartial model.
        task: ``single-label`` (softmax over classes) or ``multi-label`` / ``segmentation``
            (sigmoid per output).
    """
    import torch

    class ProbabilityNet(torch.nn.Module):
        def __init__(self, net, softmax: bool):
            super().__init__()
            self.net = net
            self.softmax = softmax

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            logits = self.net(x)[1]
            return torch.softmax(logits, dim=1) if self.softmax else torch.sigmoid(logits)

    return ProbabilityNet(model, task == "single-label").eval()


def export_size(meta: Mapping, size: Optional[Sequence[int]] = None) -> Tuple[int, int]:
    """The (H, W) the exported network takes: the model's ``input_size``, else ``size``.

    Raises:
        ValueError: the model has no input size (it was trained on images at their own size) and
            none is given, or ``size`` differs from the model's.
    """
    from fedpartial.models.io import model_input_size

    own = model_input_size(meta)
    given = tuple(int(s) for s in size) if size else None
    if own and given and given != own:
        raise ValueError(f"--size {given[0]},{given[1]} differs from the model's input size {own[0]},{own[1]}: "
                         f"the model was trained at its input size")
    if not (own or given):
        raise ValueError("the model has no input_size (it was trained on images at their own size): give the size "
                         "of the training images with --size H,W; every image is resized to it")
    return own or given


def trace_model(model, meta: Mapping, size: Optional[Sequence[int]] = None, tolerance: float = 1e-5):
    """Trace ``model`` as :func:`probability_net` at ``(C, H, W)`` and check it.

    The trace is checked on a seeded random batch of 3 against the PyTorch module; tracing
    records one path through the network, valid for inputs of that (C, H, W) (any batch size).

    Args:
        model: a fedpartial model (eval mode, CPU).
        meta: its meta (``task``, ``input_size``, ``spec``).
        size: (H, W) for a model without ``input_size`` (:func:`export_size`).
        tolerance: the largest difference of probabilities allowed.

    Returns:
        the ``torch.jit.ScriptModule``.

    Raises:
        ValueError: the traced module's outputs differ from the model's by more than ``tolerance``.
    """
    import torch

    h, w = export_size(meta, size)
    channels = int(meta["spec"]["in_channels"])
    net = probability_net(model.cpu().eval(), meta["task"])
    generator = torch.Generator().manual_seed(0)
    example = torch.randn(1, channels, h, w, generator=generator)
    with _no_jit_deprecation():
        # MONAI layers' shape checks warn while tracing; the check below covers what they warn of
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        with torch.no_grad():
            traced = torch.jit.trace(net, example, check_trace=False)
    check = torch.randn(3, channels, h, w, generator=generator)
    with torch.no_grad():
        gap = float((traced(check) - net(check)).abs().max())
    if not gap <= tolerance:
        raise ValueError(f"the traced network differs from the model by {gap:.3g} (> {tolerance}); not exported")
    return traced


def _sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def provenance(meta: Mapping, model_path: str) -> Dict:
    """Where the model comes from: the model file (name, sha256) and its meta beyond the model's
    description (``job_id``, ``round``, ``runtime``, ``method``... whatever the file holds), values
    longer than ``MAX_PROVENANCE_JSON`` characters as JSON named in ``omitted``."""
    import fedpartial

    out: Dict = {"model_file": os.path.basename(str(model_path)), "model_file_sha256": _sha256(model_path),
                 "exported_with": f"fedpartial {fedpartial.__version__}"}
    omitted = []
    for key, value in meta.items():
        if key in _MODEL_KEYS:
            continue
        if len(json.dumps(value, default=str)) > MAX_PROVENANCE_JSON:
            omitted.append(key)
        else:
            out[key] = value
    if omitted:
        out["omitted"] = sorted(omitted)
    return out


def _spec(meta: Mapping, size, thresholds: np.ndarray, model_path: str, override: Optional[float] = None) -> Dict:
    """The model's description shared by both formats."""
    from fedpartial_tools.model.decisions import threshold_source

    norm = meta["normalisation"]
    return {"task": meta["task"], "class_names": [str(c) for c in meta["class_names"]],
            "arch": meta["spec"]["arch"], "in_channels": int(meta["spec"]["in_channels"]),
            "input_size": list(size), "normalisation": {"mean": norm["mean"], "std": norm["std"]},
            "input": "float32 (N, C, H, W) = (uint8 image resized to input_size / 255 - mean) / std",
            "output": "probabilities (N, C)" if meta["task"] != "segmentation" else "probabilities (N, 1, H, W)",
            "decision_thresholds": [None if np.isnan(t) else float(t) for t in thresholds],
            "decision_rule": "probability >= threshold; null = argmax (single-label)",
            "decision_thresholds_from": threshold_source(meta, override),
            "provenance": provenance(meta, model_path)}


def export_torchscript(model_path: str, out_dir: str, size: Optional[Sequence[int]] = None) -> Path:
    """Write ``out_dir/model.ts``: the traced probability network with the model's description
    stored inside (``monai.data.save_net_with_metadata``).

    Args:
        model_path: a fedpartial model file.
        out_dir: output folder (created).
        size: (H, W) for a model without ``input_size``.

    Returns:
        the ``model.ts`` written.
    """
    from monai.data import save_net_with_metadata

    from fedpartial.models.io import load_model_file
    from fedpartial_tools.model.decisions import decision_thresholds

    model, meta = load_model_file(model_path)
    size = export_size(meta, size)
    traced = trace_model(model, meta, size)
    os.makedirs(out_dir, exist_ok=True)
    target = Path(out_dir) / "model.ts"
    with _no_jit_deprecation():
        save_net_with_metadata(traced, str(target), meta_values=_spec(meta, size, decision_thresholds(meta),
                                                                      model_path))
    return target


# ---- MONAI bundle ---------------------------------------------------------------------------------
def _versions() -> Dict:
    import monai
    import PIL
    import torch

    return {"monai_version": monai.__version__, "pytorch_version": torch.__version__.split("+")[0],
            "numpy_version": np.__version__, "required_packages_version": {"pillow": PIL.__version__}}


def bundle_metadata(meta: Mapping, size, thresholds: np.ndarray, model_path: str,
                    threshold: Optional[float] = None) -> Dict:
    """``configs/metadata.json`` (MONAI bundle specification fields plus ``fedpartial``: the
    model's description and provenance).

    Args:
        meta: the model file's meta.
        size: the exported (H, W).
        thresholds: the decision thresholds (:func:`fedpartial_tools.model.decisions.decision_thresholds`).
        model_path: the model file.
        threshold: the ``--threshold`` that set ``thresholds``, if one did.
    """
    import fedpartial

    names = [str(c) for c in meta["class_names"]]
    channels = int(meta["spec"]["in_channels"])
    mean, std = meta["normalisation"]["mean"], meta["normalisation"]["std"]
    low = np.divide(np.subtract(0.0, mean), std).tolist()
    high = np.divide(np.subtract(1.0, mean), std).tolist()
    segmentation = meta["task"] == "segmentation"
    info = provenance(meta, model_path)
    origin = ", ".join(f"{k} {info[k]}" for k in ("job_id", "round", "method", "runtime") if info.get(k) is not None)
    outputs = 1 if segmentation else len(names)
    return {
        "schema": "https://github.com/Project-MONAI/MONAI-extra-test-data/releases/download/0.8.1/"
                  "meta_schema_20220324.json",
        "version": "0.1.0",
        "changelog": {"0.1.0": f"exported from {info['model_file']}" + (f" ({origin})" if origin else "")
                               + f" by fedpartial {fedpartial.__version__}"},
        **_versions(),
        "name": f"fedpartial {meta['task']} {meta['spec']['arch']}",
        "task": f"2D {meta['task']} of {', '.join(names)}",
        "description": f"A {meta['spec']['arch']} trained by federated learning (NVIDIA FLARE, fedpartial) on "
                       f"partially annotated sites; "
                       f"{'per-pixel lesion probability' if segmentation else 'class probabilities'} from one "
                       f"{'grey' if channels == 1 else 'RGB'} image resized to {size[0]}x{size[1]}.",
        "authors": "the sites of the federation",
        "copyright": "the sites of the federation",
        "intended_use": "research; not validated for clinical use",
        "data_type": "png, jpeg",
        "image_classes": f"{channels} channel(s), resized to {size[0]}x{size[1]} (bilinear, antialiased, rounded as "
                         f"uint8), scaled to [0, 1], then (x - {mean}) / {std}",
        "pred_classes": ("1 channel: lesion probability; mask = probability > threshold" if segmentation
                         else f"{len(names)} probabilities: {', '.join(names)}"),
        "network_data_format": {
            "inputs": {"image": {
                "type": "image", "format": "magnitude", "modality": "unknown", "num_channels": channels,
                "spatial_shape": list(size), "dtype": "float32", "value_range": [low, high], "is_patch_data": False,
                "channel_def": {"0": "grey"} if channels == 1 else {"0": "R", "1": "G", "2": "B"}}},
            "outputs": {"pred": {
                "type": "probabilities", "format": "segmentation" if segmentation else "classes",
                "num_channels": outputs, "spatial_shape": list(size) if segmentation else [outputs],
                "dtype": "float32", "value_range": [0, 1], "is_patch_data": False,
                "channel_def": {str(i): n for i, n in enumerate(names[:outputs])}}}},
        "fedpartial": _spec(meta, size, thresholds, model_path, threshold),
    }


def _resize_expression(size) -> str:
    """A config expression resizing a (C, H, W) image as training does
    (``fedpartial.data.transforms.resize_images``: bilinear, antialiased, rounded to integers)."""
    h, w = size
    return (f"$lambda x: x if tuple(x.shape[1:]) == ({h}, {w}) else torch.nn.functional.interpolate("
            f"x[None], size=({h}, {w}), mode='bilinear', align_corners=False, antialias=True)[0].round().clamp(0, 255)")


def inference_config(meta: Mapping, size, thresholds: np.ndarray, bundle_root: str) -> Dict:
    """``configs/inference.json``: MONAI bundle config for ``python -m monai.bundle run``.

    Args:
        meta: the model file's meta.
        size: the exported (H, W).
        thresholds: the decision thresholds (NaN = argmax).
        bundle_root: the bundle folder (override with ``--bundle_root`` after moving it).
    """
    names = [str(c) for c in meta["class_names"]]
    mean, std = meta["normalisation"]["mean"], meta["normalisation"]["std"]
    per_channel = isinstance(mean, (list, tuple))
    segmentation = meta["task"] == "segmentation"
    config = {
        "imports": ["$import glob", "$import os", "$import pathlib", "$import numpy", "$import torch",
                    "$import monai"],
        "bundle_root": str(bundle_root),
        "dataset_dir": "$@bundle_root + '/input'",
        "output_dir": "$@bundle_root + '/eval'",
        "device": "$torch.device('cuda' if torch.cuda.is_available() else 'cpu')",
        "class_names": names,
        "thresholds": [None if np.isnan(t) else float(t) for t in thresholds],
        "network_def": "$torch.jit.load(@bundle_root + '/models/model.ts', map_location=@device)",
        "network": "$@network_def.eval()",
        "datalist": "$[{'image': f} for f in sorted(sum((glob.glob(os.path.join(@dataset_dir, '*' + e)) for e in "
                    "('.png', '.jpg', '.jpeg', '.PNG', '.JPG', '.JPEG')), []))]",
        "check_datalist": "$@datalist or exec('raise FileNotFoundError(m)', {'m': 'no .png / .jpg / .jpeg image in ' "
                          "+ @dataset_dir + ' (pass --dataset_dir)'})",
        "preprocessing": {"_target_": "Compose", "transforms": [
            # reverse_indexing=False: (H, W) arrays as fedpartial reads images (PIL's default is (W, H))
            {"_target_": "LoadImaged", "keys": "image", "reader": "PILReader", "reverse_indexing": False,
             "image_only": True},
            {"_target_": "EnsureChannelFirstd", "keys": "image"},
            {"_target_": "Lambda", "func": "$lambda d: {**d, 'source_size': torch.tensor(d['image'].shape[1:])}"},
            {"_target_": "Lambdad", "keys": "image", "func": _resize_expression(size)},
            {"_target_": "ScaleIntensityRanged", "keys": "image", "a_min": 0.0, "a_max": 255.0, "b_min": 0.0,
             "b_max": 1.0},
            {"_target_": "NormalizeIntensityd", "keys": "image", "subtrahend": mean, "divisor": std,
             "channel_wise": per_channel}]},
        "dataset": {"_target_": "Dataset", "data": "@datalist", "transform": "@preprocessing"},
        "dataloader": {"_target_": "DataLoader", "dataset": "@dataset", "batch_size": 16, "shuffle": False,
                       "num_workers": 0},
        "inferer": {"_target_": "SimpleInferer"},
    }
    # the network already returns probabilities; a batch is decollated so postprocessing sees one image
    predictions = ("monai.data.decollate_batch({'image': batch['image'], 'source_size': batch['source_size'], "
                   "'pred': @inferer(batch['image'].as_tensor().to(@device), @network).cpu()})")
    if segmentation:
        threshold = float(thresholds[0])
        config.update({
            "postprocessing": {"_target_": "Compose", "transforms": [
                # probabilities back to the image's own size before thresholding, as fedpartial evaluates
                {"_target_": "Lambda", "func": "$lambda d: {**d, 'pred': monai.data.MetaTensor("
                                               "torch.nn.functional.interpolate(d['pred'][None], size=tuple(int(s) "
                                               "for s in d['source_size']), mode='bilinear', align_corners=False)[0], "
                                               "meta=d['image'].meta)}"},
                {"_target_": "Lambdad", "keys": "pred", "func": f"$lambda p: (p > {threshold}).to(torch.uint8)"},
                "@mask_writer"]},
            "mask_writer": "$monai.transforms.SaveImaged(keys='pred', output_dir=@output_dir, output_postfix='mask', "
                           "output_ext='.png', output_dtype=numpy.uint8, scale=255, resample=False, "
                           "separate_folder=False, print_log=False, writer='PILWriter')"
                           ".set_options(write_kwargs={'reverse_indexing': False})",
            "run": ["$torch.set_grad_enabled(False)", "$@check_datalist",
                    f"$[@postprocessing(item) for batch in @dataloader for item in {predictions}]"],
        })
    else:
        header = ",".join(["file"] + [f"prob_{n}" for n in names] + [f"decision_{n}" for n in names])
        config.update({
            "postprocessing": {"_target_": "Compose", "transforms": []},
            "threshold_tensor": "$torch.tensor([float('nan') if v is None else v for v in @thresholds])",
            # probability >= threshold; a null threshold decides by argmax (fedpartial_tools.model.decisions.decide)
            "decide": "$lambda p: torch.where(torch.isnan(@threshold_tensor), torch.nn.functional.one_hot("
                      "p.argmax(-1), p.shape[-1]).bool(), p >= torch.nan_to_num(@threshold_tensor))",
            "write_header": f"$pathlib.Path(@output_dir).mkdir(parents=True, exist_ok=True) or pathlib.Path("
                            f"@output_dir, 'predictions.csv').write_text({header!r} + '\\n')",
            "saver": {"_target_": "CSVSaver", "output_dir": "@output_dir", "filename": "predictions.csv",
                      "overwrite": False},
            "run": ["$torch.set_grad_enabled(False)", "$@check_datalist", "$@write_header",
                    f"$[@saver.save(torch.cat([p, @decide(p).float()]), {{'filename_or_obj': "
                    f"item['image'].meta['filename_or_obj']}}) for batch in @dataloader for item in {predictions} "
                    f"for p in [@postprocessing(item)['pred']]]",
                    "$@saver.finalize()"],
        })
    return config


# configs/logging.conf: MONAI's runner reads it (and warns when absent); the model zoo's layout
LOGGING_CONF = """[loggers]
keys=root

[handlers]
keys=consoleHandler

[formatters]
keys=fullFormatter

[logger_root]
level=INFO
handlers=consoleHandler

[handler_consoleHandler]
class=StreamHandler
level=INFO
formatter=fullFormatter
args=(sys.stdout,)

[formatter_fullFormatter]
format=%(asctime)s - %(name)s - %(levelname)s - %(message)s
"""


def _bundle_readme(meta: Mapping, size, bundle_root: str) -> str:
    seg = meta["task"] == "segmentation"
    return "\n".join([
        f"# fedpartial {meta['task']} model ({meta['spec']['arch']})", "",
        "Exported by `python -m fedpartial export --format monai-bundle`; `configs/metadata.json` says what the "
        "model takes and gives, and where it comes from (`fedpartial.provenance`).", "",
        "## Run", "", "```bash", "pip install monai fire pillow",
        f"python -m monai.bundle run --config_file {bundle_root}/configs/inference.json "
        "--dataset_dir IMAGES --output_dir RESULTS", "```", "",
        ("Writes one `<image>_mask.png` per image (0 / 255, the image's own size)." if seg else
         "Writes `RESULTS/predictions.csv`: file, per class the probability (`prob_<class>`), then the decision "
         "(`decision_<class>`, 1 = probability >= the class's threshold; argmax for single-label models without "
         "thresholds)."),
        "", f"Inputs: PNG / JPEG with {meta['spec']['in_channels']} channel(s), any size: each is resized to "
        f"{size[0]}x{size[1]} as at training. The bundle records its own folder as `bundle_root`: after "
        "moving it, add `--bundle_root NEW_FOLDER`.", "",
        "`models/model.ts` is the TorchScript network (input: normalised float (N, C, H, W); output: "
        "probabilities); `models/model.pt` its state dict (`torch.jit.load('models/model.ts')."
        "load_state_dict(torch.load('models/model.pt'))`).", ""])


def export_monai_bundle(model_path: str, out_dir: str, size: Optional[Sequence[int]] = None,
                        threshold: Optional[float] = None) -> Path:
    """Write a MONAI bundle of the model into ``out_dir`` (see the module docstring).

    Args:
        model_path: a fedpartial model file.
        out_dir: the bundle folder (created; its configs and models are overwritten).
        size: (H, W) for a model without ``input_size``.
        threshold: one decision threshold for every class instead of the model file's.

    Returns:
        the bundle folder.
    """
    import torch
    from monai.data import save_net_with_metadata

    from fedpartial.models.io import load_model_file
    from fedpartial_tools.model.decisions import decision_thresholds

    model, meta = load_model_file(model_path)
    size = export_size(meta, size)
    thresholds = decision_thresholds(meta, threshold)
    traced = trace_model(model, meta, size)
    root = Path(out_dir).resolve()
    for sub in ("configs", "models", "docs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    metadata = bundle_metadata(meta, size, thresholds, model_path, threshold)
    config = inference_config(meta, size, thresholds, str(root))
    (root / "configs" / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    (root / "configs" / "inference.json").write_text(json.dumps(config, indent=2) + "\n")
    (root / "configs" / "logging.conf").write_text(LOGGING_CONF)
    # as MONAI's ckpt_export: the metadata and the config travel inside the TorchScript file too
    with _no_jit_deprecation():
        save_net_with_metadata(traced, str(root / "models" / "model.ts"), include_config_vals=False,
                               meta_values=metadata, more_extra_files={"inference.json": json.dumps(config).encode()})
    torch.save(traced.state_dict(), str(root / "models" / "model.pt"))
    (root / "docs" / "README.md").write_text(_bundle_readme(meta, size, str(root)))
    return root


def _size(text: Optional[str]):
    from fedpartial_tools.data.importer import _size as parse

    return parse(text)


def _cmd_export(args) -> None:
    size = _size(args.size)
    if args.format == "torchscript":
        if args.threshold is not None:
            raise ValueError("--threshold is for --format monai-bundle (TorchScript gives probabilities only)")
        out = export_torchscript(args.model, args.out, size)
    else:
        out = export_monai_bundle(args.model, args.out, size, args.threshold)
    print(out)
    if args.format == "monai-bundle":
        print(f"run it: python -m monai.bundle run --config_file {out}/configs/inference.json --dataset_dir IMAGES "
              f"--output_dir RESULTS", file=sys.stderr)


def add_export_parser(subparsers) -> None:
    """Register ``export`` on the CLI's sub-parsers.

    Args:
        subparsers: the ``add_subparsers()`` object of ``python -m fedpartial``.
    """
    import argparse

    s = subparsers.add_parser("export", help="a model file as TorchScript (model.ts) or a MONAI bundle that "
                                             "'python -m monai.bundle run' runs without fedpartial",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--model", required=True, help="a fedpartial model file (global_model.pt)")
    s.add_argument("--format", required=True, choices=FORMATS)
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--size", default=None, help="H,W the network takes, for a model without input_size")
    s.add_argument("--threshold", type=float, default=None,
                   help="monai-bundle: one decision threshold for every class (default: the model file's "
                        "decision_thresholds, else 0.5 multi-label and segmentation, argmax single-label)")
    s.set_defaults(func=_cmd_export)
