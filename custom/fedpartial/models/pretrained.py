"""Start a model from pretrained weights held in a local file (``model.pretrained`` of a job).

:func:`load_pretrained` accepts, from a file written with ``torch.save``:

* a torchvision DenseNet-121 state dict (``features.conv0.weight``,
  ``features.denseblock1.denselayer1.norm1.weight`` or the old ``...norm.1.weight`` style,
  ``classifier.weight``) or a MONAI ``DenseNet121`` one -> our ``densenet121``;
* a torchvision ResNet-18 state dict (``conv1.weight``, ``bn1.*``, ``layer1.0.conv1.weight``,
  ``fc.weight``) or a MONAI ``resnet18`` one (same names) -> our ``resnet18``;
* a MONAI ``UNet`` state dict (``model.0.conv.unit0.conv.weight`` ...) -> our ``unet``;
* one of our own model files (:mod:`fedpartial.models.io`) or a plain ``state_dict()`` of the
  same :class:`FedModel` class.

A dict holding the weights under ``state_dict`` (or ``model_state_dict`` / ``model``) is
unwrapped and a ``module.`` prefix (DataParallel) dropped. Nothing is ever downloaded.

Rules:

* The head (``model.classifier_param_names()``; for ``unet`` the whole output block, whose
  shapes follow the number of classes) is re-made for the job: it keeps its fresh
  initialisation, and the source's own head (``classifier.*`` / ``fc.*`` /
  ``class_layers.out.*``) is skipped. The only exception is one of our model files made for
  the same task and class names (when the caller passes them): its head fits the job as is.
* Grey from RGB: when a conv that reads the network input has 3 input channels in the file and
  the job's model has 1, its kernel is summed over the channel axis. A grey image fed to the
  RGB net as three equal channels gives the same response, so the pretrained filters keep
  their meaning. Any other shape difference is a ``ValueError`` naming the parameter and both
  shapes.
* torchvision's ResNet has no bias in the downsampling convs, MONAI's has one: it is set to
  zero (the same function). BatchNorm ``num_batches_tracked`` counters missing from old files
  keep their initial value.
* Model parameters missing from the file, or file weights the model has no place for, are a
  ``ValueError`` listing the first few (a ResNet-34 file never half-loads into a ResNet-18).
"""
from __future__ import annotations

import os
import re
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from fedpartial.models.io import FORMAT
from fedpartial.models.networks import FedModel, UNet2D

FMT_OWN_FILE = "fedpartial-model"
FMT_OWN_STATE = "fedpartial-state-dict"
FMT_DENSENET = "densenet121 (torchvision/MONAI)"
FMT_RESNET = "resnet18 (torchvision/MONAI)"
FMT_UNET = "monai-unet"

# Which of our archs each foreign layout can fill.
_FORMAT_ARCH = {FMT_DENSENET: "densenet121", FMT_RESNET: "resnet18", FMT_UNET: "unet"}

# torchvision DenseNet layer keys -> MONAI's: new torchvision names "denselayer1.norm1.weight",
# old checkpoints (densenet121-a639ec97.pth) "denselayer1.norm.1.weight"; MONAI keeps them in a
# ``layers`` Sequential. MONAI's own densenet._load_state_dict handles the old style only, and
# downloads; this is the same mapping for both styles on a local file.
_DENSE_LAYER = re.compile(r"^(.*denselayer\d+)\.(norm|relu|conv)\.?([12])\.(weight|bias|running_mean|running_var|"
                          r"num_batches_tracked)$")
_SOURCE_HEADS = {FMT_DENSENET: ("classifier.", "class_layers.out."), FMT_RESNET: ("fc.",), FMT_UNET: ()}
_WRAPPERS = ("state_dict", "model_state_dict", "model")


def _say(log: Optional[Callable[[str], None]], message: str) -> None:
    if log is not None:
        log(message)


def _read(path: str) -> Tuple[Dict[str, torch.Tensor], Optional[Dict]]:
    """-> (tensors by name, our model-file payload or None)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pretrained weights file '{path}' does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, not a torch file, or pickled objects weights_only refuses
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"pretrained weights file '{path}' cannot be read (corrupt, truncated or not a torch "
                         f"weights file): {type(exc).__name__}: {reason}") from exc
    own = payload if isinstance(payload, dict) and payload.get("format") == FORMAT else None
    state = payload
    for _ in range(2):  # {"state_dict": {...}} or {"model": {"state_dict": ...}}
        if isinstance(state, dict):
            inner = next((state[k] for k in _WRAPPERS if isinstance(state.get(k), dict)), None)
            if inner is not None and not any(isinstance(v, torch.Tensor) for v in state.values()):
                state = inner
    if not isinstance(state, dict):
        raise ValueError(f"pretrained weights file '{path}' holds a {type(state).__name__}, not a state dict")
    tensors = {str(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise ValueError(f"pretrained weights file '{path}' holds no tensors (keys: {list(state)[:5]})")
    if all(k.startswith("module.") for k in tensors):  # saved from DataParallel
        tensors = {k[len("module."):]: v for k, v in tensors.items()}
    return tensors, own


def _detect(tensors: Mapping[str, torch.Tensor], own_keys: Sequence[str]) -> str:
    keys = set(tensors)
    ours = ("backbone.", "body.", "net.", "fc.")  # our wrappers' top-level names
    if len(keys & set(own_keys)) * 2 > len(keys) or all(k.startswith(ours) for k in keys):
        return FMT_OWN_STATE
    if any(k.startswith("features.denseblock") for k in keys) and "features.conv0.weight" in keys:
        return FMT_DENSENET
    if {"conv1.weight", "layer1.0.conv1.weight"} <= keys:
        return FMT_RESNET
    if any(k.startswith("model.0.") for k in keys):
        return FMT_UNET
    raise ValueError(f"unrecognised weights layout (first keys: {sorted(keys)[:5]}); accepted: torchvision/MONAI "
                     f"DenseNet-121 or ResNet-18, MONAI UNet, or a fedpartial model file")


def _to_model_names(fmt: str, tensors: Mapping[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """Rename the file's keys to our model's; -> (renamed weights, the source's own head keys)."""
    heads = _SOURCE_HEADS.get(fmt, ())
    out, source_head = {}, []
    for key, value in tensors.items():
        if any(key.startswith(h) for h in heads):
            source_head.append(key)
            continue
        if fmt == FMT_DENSENET:
            m = _DENSE_LAYER.match(key)
            if m:
                key = f"{m.group(1)}.layers.{m.group(2)}{m.group(3)}.{m.group(4)}"
            out[f"backbone.{key}"] = value
        elif fmt == FMT_RESNET:
            out[f"backbone.{key}"] = value
        elif fmt == FMT_UNET:
            out[f"net.{key}"] = value
        else:
            out[key] = value
    return out, source_head


def head_keys(model: FedModel) -> List[str]:
    """State-dict names re-made for the job's classes: the classifier, and for ``unet`` the whole
    output block (its transposed conv also has ``num_classes`` output channels)."""
    names = list(model.classifier_param_names())
    if isinstance(model, UNet2D):
        last = f"net.model.{len(model.net.model) - 1}."
        names += [k for k in model.state_dict() if k.startswith(last) and k not in names]
    return names


def _input_convs(model: FedModel) -> List[str]:
    """Weight names of the convs that read the network input (found with one small forward)."""
    x = torch.zeros(1, model.in_channels, 32, 32)
    hits: List[str] = []
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            def hook(mod, args, name=name):
                if args and args[0] is x:
                    hits.append(f"{name}.weight")
            handles.append(module.register_forward_pre_hook(hook))
    was_training = model.training
    try:
        model.eval()  # batch of 1: no BatchNorm batch statistics, no running-stat updates
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return hits


def load_pretrained(model: FedModel, path: str, log: Optional[Callable[[str], None]] = None,
                    class_names: Optional[Sequence[str]] = None, task: Optional[str] = None) -> Dict:
    """Load the body of ``model`` from a local pretrained weights file, in place.

    The head keeps its fresh initialisation (it is re-made for the job's classes); a 3-channel
    input conv in the file is summed over its channel axis for a 1-channel (grey) model. See
    the module docstring for the accepted layouts and every rule.

    Args:
        model: the job's model from ``build_model`` (its head already initialised).
        path: file written by ``torch.save`` (``~`` is expanded); read with
            ``torch.load(weights_only=True)``, so pickled code never runs.
        log: optional printer for one summary line.
        class_names: the job's class names. With ``task``, lets one of our model files made for
            the same task and classes keep its head; otherwise every head is re-made.
        task: the job's task (see ``class_names``).

    Returns:
        a report: ``path``, ``source_format``, ``loaded`` (model keys set from the file),
        ``skipped_head`` (head weights of the file not loaded: model names, then the file's own
        ``fc.*`` / ``classifier.*`` names), ``head_fresh`` (model head keys keeping their init),
        ``channel_sum`` (keys summed RGB -> grey), ``zero_filled`` (bias-free torchvision convs),
        ``kept_init`` (counters absent from the file) and ``summary`` (one line).

    Raises:
        FileNotFoundError: no such file.
        ValueError: unreadable file, unknown layout, a layout for another architecture, missing
            or unexpected weights, or a shape mismatch (names the parameter and both shapes).
    """
    path = os.path.expanduser(str(path))
    tensors, own_file = _read(path)
    own = model.state_dict()
    heads = head_keys(model)
    same_task = False
    if own_file is not None:
        fmt = FMT_OWN_FILE
        spec, meta = own_file.get("spec") or {}, own_file.get("meta") or {}
        if spec.get("arch") != model.arch:
            raise ValueError(f"pretrained weights file '{path}' holds a {spec.get('arch')!r} model; the job's model "
                             f"is {model.arch!r}")
        same_task = (class_names is not None and task is not None and meta.get("task") == task
                     and list(meta.get("class_names") or []) == list(class_names))
    else:
        fmt = _detect(tensors, list(own))
        wanted = _FORMAT_ARCH.get(fmt)
        if wanted is not None and wanted != model.arch:
            raise ValueError(f"pretrained weights file '{path}' holds {fmt} weights; the job's model is "
                             f"{model.arch!r} (use arch {wanted!r})")
    source, source_head = _to_model_names(fmt, tensors)

    report = {"path": path, "source_format": fmt, "loaded": [], "skipped_head": [], "channel_sum": [],
              "zero_filled": [], "kept_init": []}
    # Missing / unexpected names first: a wrong file fails as a whole, before shapes.
    missing, zero_fill, kept = [], [], []
    for key in own:
        if key in source or key in heads:
            continue
        if key.endswith("num_batches_tracked"):
            kept.append(key)
        elif fmt == FMT_RESNET and re.search(r"\.downsample\.0\.bias$", key):
            zero_fill.append(key)  # torchvision: conv without bias == bias 0
        else:
            missing.append(key)
    if missing:
        raise ValueError(f"pretrained weights file '{path}' ({fmt}) lacks {len(missing)} weights of the "
                         f"{model.arch} model, e.g. {missing[:5]}")
    unexpected = [k for k in source if k not in own]
    if unexpected:
        raise ValueError(f"pretrained weights file '{path}' ({fmt}) has {len(unexpected)} weights the "
                         f"{model.arch} model has no place for (another depth or variant?), e.g. {unexpected[:5]}")

    grey_inputs: Optional[List[str]] = None
    new_state = {}
    for key, target in own.items():
        if key not in source:
            continue
        value = source[key]
        if key in heads:
            # The head fits only a file made for this very task and these classes.
            if not (same_task and tuple(value.shape) == tuple(target.shape)):
                report["skipped_head"].append(key)
                continue
        elif tuple(value.shape) != tuple(target.shape):
            if grey_inputs is None and model.in_channels == 1:
                grey_inputs = _input_convs(model)
            rgb_to_grey = (key in (grey_inputs or []) and value.dim() >= 3 and value.shape[1] == 3
                           and target.shape[1] == 1 and value.shape[0] == target.shape[0]
                           and value.shape[2:] == target.shape[2:])
            if not rgb_to_grey:
                raise ValueError(f"pretrained weights file '{path}': parameter '{key}' has shape "
                                 f"{tuple(value.shape)} in the file but {tuple(target.shape)} in the job's "
                                 f"{model.arch} model (in_channels={model.in_channels})")
            value = value.sum(dim=1, keepdim=True)
            report["channel_sum"].append(key)
        new_state[key] = value.to(dtype=target.dtype)
        report["loaded"].append(key)
    for key in zero_fill:
        new_state[key] = torch.zeros_like(own[key])
    report["zero_filled"] = zero_fill
    report["kept_init"] = kept
    report["skipped_head"] += source_head
    report["head_fresh"] = [k for k in heads if k not in new_state]
    model.load_state_dict(new_state, strict=False)

    parts = [f"loaded {len(report['loaded'])} of {len(own)} weights from '{path}' ({fmt})"]
    if report["skipped_head"]:
        parts.append(f"head re-made for the job's classes ({len(report['skipped_head'])} head weights not loaded)")
    if report["channel_sum"]:
        parts.append(f"RGB kernels summed to grey in {report['channel_sum']}")
    if zero_fill:
        parts.append(f"{len(zero_fill)} downsample biases set to 0 (torchvision has none)")
    report["summary"] = "; ".join(parts)
    _say(log, report["summary"])
    return report
