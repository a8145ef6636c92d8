"""Weights stored in low precision for inference go back to their dtype when the model
trains.

low_precision_weights (O3, eval mode) stores Linear, Conv and attention weights in
bfloat16 (or float16). A model prepared so and then switched to `train()` trained with
those as its parameters: an optimizer step smaller than half a bfloat16 step of the weight
(2^-9 to 2^-8 of it: SGD at lr 1e-3 with gradients of 1e-3 on weights of 0.02) left the
weight as it was, larger ones were rounded to whole bfloat16 steps, and training stalled
where eager's learned, with nothing said. So at the first call in training mode
(`model.training`, what `train()` sets) the weights the pass cast become parameters of
their own dtype again, holding the rounded values (within 2^-8 of the weights before the
pass; the originals are not kept, which would cost the memory the pass saves). Autocast
stays: the model then trains as mixed-precision training does, float32 weights and
bfloat16 matmuls. The Parameter objects stay the same (an optimizer made before holds
them), and the report lists low_precision_weights as undone after prepare_model returned.
Going back to `eval()` keeps them in their dtype: prepare the trained model again to store
them in bfloat16.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchbridge.optimize.forward import LOW_PRECISION_CAST as _CAST
from torchbridge.optimize.forward import WEIGHTS_RESTORED as RESTORED
from torchbridge.optimize.forward import install_forward

logger = logging.getLogger(__name__)

# On the model (_CAST): the weights the pass cast, as (module name, parameter name, dtype
# before, dtype cast to). Once they are back in a dtype of their own (RESTORED): why, for
# the report; a conversion of the model (forward.watch_dtype_conversion) sets it too.
RESTORED_BY_TRAINING = ("the model was called in training mode, so the weights stored in "
                        "low precision are parameters of their own dtype again (holding the "
                        "rounded values; autocast still computes in low precision: "
                        "mixed-precision training)")

Cast = list[tuple[str, str, torch.dtype, torch.dtype]]


def restore_when_training(model: nn.Module, cast: Cast | None) -> None:
    """Install the check on the model's forward: `cast` lists the parameters the pass
    stored in low precision, with their dtype before and after; None on a deep copy of a
    prepared model, which carries the original's lists and reasons as they stand."""
    if cast is not None:
        model.__dict__[_CAST] = list(cast)
        model.__dict__.pop(RESTORED, None)  # left by an earlier preparation of this model
    # Nothing for dynamo to trace: in eval mode (compiled inference) the branch is not
    # taken, guarded on `training` as dynamo guards any module flag.
    restore_eager = torch.compiler.disable(restore_weights)  # type: ignore[no-untyped-call,unused-ignore]

    def make(inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if model.training and _CAST in model.__dict__:
                restore_eager(model)
            return inner(*args, **kwargs)
        return forward

    install_forward(model, make, lambda twin: restore_when_training(twin, None))


def restore_weights(model: nn.Module, why: str = RESTORED_BY_TRAINING) -> int:
    """Put the weights the pass cast back in their dtype (each Parameter the same object);
    returns how many it changed. Once only: later calls find nothing to do."""
    cast: Cast = model.__dict__.pop(_CAST, [])
    changed = 0
    for module_name, param_name, dtype, low in cast:
        try:
            param = model.get_submodule(module_name)._parameters.get(param_name)
        except AttributeError:  # the module was taken out of the model since
            continue
        # Only a weight still as the pass left it: not one quantized after the pass (a
        # torchao tensor subclass, which a cast would dequantize, and which does not train
        # either way), nor one the caller put in another dtype since.
        if param is not None and type(param.data) is torch.Tensor and param.dtype == low:
            param.data = param.data.to(dtype)
            changed += 1
    if changed:
        model.__dict__[RESTORED] = why
        logger.warning("prepare_model stored %d weight(s) of this %s in low precision for "
                       "inference; called in training mode, they are back in their dtype "
                       "(prepare it again after training to store them so)", changed,
                       type(model).__name__)
    return changed
