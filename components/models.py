"""Model zoo (``mlp``, ``cnn``) and user factories given as ``module:function``.

A factory is called as ``factory(input_dim=..., num_classes=..., image_shape=...)`` and returns an
``nn.Module`` mapping ``float32 [batch, input_dim]`` to logits ``[batch, num_classes]``. Factories
are resolved (imported) before any worker starts, so a typo fails in a second with a clear message
instead of in N worker tracebacks.
"""
from __future__ import annotations

import importlib
import inspect
import math
from typing import Callable

import torch
from torch import nn

from .errors import ModelFactoryError


class MLP(nn.Module):
    def __init__(self, input_dim: int, num_classes: int, hidden: int = 128, depth: int = 2, dropout: float = 0.1):
        super().__init__()
        layers: list[nn.Module] = []
        d = input_dim
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.ReLU(), nn.Dropout(dropout)]
            d = hidden
        layers.append(nn.Linear(d, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """A small conv net over ``image_shape`` (C, H, W); features arrive flattened."""

    def __init__(self, num_classes: int, image_shape: tuple[int, int, int], channels: int = 32):
        super().__init__()
        c, h, w = image_shape
        self.image_shape = (c, h, w)
        self.features = nn.Sequential(
            nn.Conv2d(c, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels * 2, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d((max(1, h // 2), max(1, w // 2))),
        )
        self.head = nn.Linear(channels * 2 * max(1, h // 2) * max(1, w // 2), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, h, w = self.image_shape
        z = self.features(x.reshape(x.shape[0], c, h, w))
        return self.head(z.flatten(1))


def mlp(input_dim: int, num_classes: int, image_shape=None, **kw) -> nn.Module:
    return MLP(input_dim, num_classes, **kw)


def cnn(input_dim: int, num_classes: int, image_shape=None, **kw) -> nn.Module:
    if image_shape is None:  # a table of features: convolving would treat neighbouring columns as neighbouring pixels
        raise ModelFactoryError(
            f"model 'cnn' needs an image, and the table's {input_dim} feature columns are not named as the pixels "
            "of one",
            "use model 'mlp' for a table of features; for an image, name its columns as its pixels in row-major "
            "order, with every pixel in the features: pixel_ROW_COL (pixel_0_0, pixel_0_1, ...), or "
            + (f"pixel0 ... pixel{input_dim - 1} for a square image" if math.isqrt(input_dim) ** 2 == input_dim
               else f"for a square image pixel0 ... pixelN (a square number of them; {input_dim} is not)"))
    if math.prod(image_shape) != input_dim:
        raise ModelFactoryError(f"model 'cnn': image shape {list(image_shape)} does not hold {input_dim} features",
                                "the image shape must be (channels, height, width) of the features, in order")
    return CNN(num_classes, tuple(image_shape), **kw)


ZOO: dict[str, Callable[..., nn.Module]] = {"mlp": mlp, "cnn": cnn}


def resolve_factory(name: str) -> Callable[..., nn.Module]:
    """``mlp`` / ``cnn`` from the zoo, or ``package.module:function``."""
    if name in ZOO:
        return ZOO[name]
    if ":" not in name:
        raise ModelFactoryError(f"unknown model {name!r}",
                                f"use one of {', '.join(ZOO)} or a factory 'package.module:function'")
    mod_name, _, fn_name = name.partition(":")
    if mod_name in ("__main__", "__mp_main__"):  # a notebook's or script's own: found here, not in a worker
        raise ModelFactoryError(f"model factory {name!r} is defined in the notebook or script that runs this, "
                                "which the training workers (processes of their own, or a cluster's pods) cannot "
                                "import: theirs is another __main__",
                                f"move {fn_name or 'the factory'} into a module file (mymodels.py beside the notebook; "
                                f"in the training image on a cluster) and pass 'mymodels:{fn_name or 'build'}'")
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or any error raised while the module imports
        raise ModelFactoryError(f"cannot import model factory module {mod_name!r}: {type(e).__name__}: {e}",
                                "check the spelling and that the module is installed in the training image "
                                "(locally: a module in the current folder, or on PYTHONPATH)") from e
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        raise ModelFactoryError(f"module {mod_name!r} has no callable {fn_name!r}",
                                f"define def {fn_name}(input_dim, num_classes, image_shape=None) -> nn.Module")
    try:  # the call build_model makes, checked now: found before any step runs, not in a worker
        inspect.signature(fn).bind(input_dim=1, num_classes=2)
    except TypeError:
        raise ModelFactoryError(f"model factory {name!r} takes {fn_name}{inspect.signature(fn)}, but is called "
                                "as factory(input_dim=..., num_classes=...[, image_shape=...])",
                                f"define def {fn_name}(input_dim, num_classes, image_shape=None) -> nn.Module") from None
    except ValueError:  # no signature to read (a builtin): the call itself will tell
        pass
    return fn


def build_model(name: str, input_dim: int, num_classes: int, image_shape=None) -> nn.Module:
    fn = resolve_factory(name)
    kwargs = {"input_dim": input_dim, "num_classes": num_classes}
    params = inspect.signature(fn).parameters
    if "image_shape" in params or any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kwargs["image_shape"] = image_shape
    try:
        model = fn(**kwargs)
    except ModelFactoryError:
        raise
    except Exception as e:
        raise ModelFactoryError(f"model factory {name!r} failed: {type(e).__name__}: {e}",
                                "it is called as factory(input_dim=..., num_classes=..., image_shape=...)") from e
    if not isinstance(model, nn.Module):
        raise ModelFactoryError(f"model factory {name!r} returned {type(model).__name__}, not a torch.nn.Module",
                                "return an nn.Module from the factory")
    _probe(model, name, input_dim, num_classes)
    return model


def _probe(model: nn.Module, name: str, input_dim: int, num_classes: int) -> None:
    """One forward pass on a batch shaped as training feeds it ([n, input_dim] raw rows): a model
    that cannot take it, or answers other than [n, num_classes] logits, is named here, not by
    cross_entropy's 'Target 9 is out of bounds' in every worker."""
    import torch

    was_training = model.training
    model.eval()  # no BatchNorm statistics from a probe
    try:
        with torch.no_grad():
            out = model(torch.zeros(2, input_dim))
    except Exception as e:
        raise ModelFactoryError(f"the model of factory {name!r} fails on a batch of shape [2, {input_dim}] "
                                f"(rows of {input_dim} features): {type(e).__name__}: {e}",
                                "the model's forward takes a float tensor [batch, input_dim]") from e
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ModelFactoryError(f"the model of factory {name!r} answers {got} for a batch of 2, not logits "
                                f"[2, {num_classes}] (one per class)",
                                "end the model with a layer of num_classes outputs (no softmax: the loss applies it)")
