"""The CPU backend's passes on the reference models: numbers match per level, the report
tells the truth, prepared models still train."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torchbridge
from torchbridge import TorchBridgeConfig
from torchbridge.models import reference_models
from torchbridge.optimize.folding import FoldedBatchNorm
from torchbridge.testing import LEVEL_TOLERANCE

MODELS = {m.name: m for m in reference_models(scale=0.125)}


def statuses(result: torchbridge.OptimizationResult) -> dict[str, str]:
    return {p.name: p.status for p in result.passes}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_reference_models_match_per_level(name: str, level: str) -> None:
    torch.manual_seed(0)
    ref = MODELS[name]
    model = ref.build().eval()
    x = ref.make_input(4)
    result = torchbridge.get_backend("cpu").optimize(model, level, sample_input=x)
    assert not result.failed, result.summary()
    assert result.max_rel_diff is not None
    assert result.max_rel_diff <= LEVEL_TOLERANCE[level], result.summary()


def test_report_for_a_conv_net_at_o3() -> None:
    ref = MODELS["convnet"]
    result = torchbridge.get_backend("cpu").optimize(ref.build().eval(), "O3")
    st = statuses(result)
    assert st["conv_bn_folding"] == "applied"
    assert st["channels_last"] == "applied"
    assert st["autocast"] == "applied"  # this CPU has avx512_bf16
    assert st["inference_freezing"] == "applied"
    assert st["compile"] == "applied"
    # Folded BatchNorms stay (same state_dict keys) as identities.
    bns = [m for m in result.model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and all(isinstance(m, FoldedBatchNorm) for m in bns)


def test_traced_conv_bn_pairs_do_not_depend_on_where_temporaries_lived() -> None:
    # A temporary read four times and freed before the convolution runs: its address (its
    # id) is often reused by the convolution's output. Counted by id, its reads were
    # charged to that output, and the pair went unfolded in 18 of 50 runs, so a ResNet's
    # compiled graph differed from process to process (and missed the compile cache).
    from torchbridge.optimize.folding import traced_pairs

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.bn = torch.nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = x * 2.0
            s = t + t + t + t
            del t
            return self.bn(self.conv(s))

    model, x = Net().eval(), torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        found = [len(traced_pairs(model, lambda m: m(x))) for _ in range(50)]
    assert found == [1] * 50


def test_conv_bn_folding_traces_only_where_the_structure_left_a_batchnorm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The traced call costs a forward: a model whose every BatchNorm follows its
    convolution in an nn.Sequential is folded without it; one with a BatchNorm outside
    such a pair is traced, and folded all the same."""
    from torchbridge.optimize import folding

    traced: list[int] = []
    real = folding.traced_pairs

    def counting(model: torch.nn.Module, call: Any) -> Any:
        traced.append(1)
        return real(model, call)

    monkeypatch.setattr(folding, "traced_pairs", counting)

    class Net(torch.nn.Module):  # the conv net, plus a BatchNorm outside any Sequential
        def __init__(self) -> None:
            super().__init__()
            self.body = MODELS["convnet"].build()
            self.conv = torch.nn.Conv2d(3, 3, 1, bias=False)
            self.bn = torch.nn.BatchNorm2d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(self.bn(self.conv(x)))

    backend = torchbridge.get_backend("cpu")
    for model, traces in ((MODELS["convnet"].build().eval(), 0), (Net().eval(), 1)):
        traced.clear()
        x = MODELS["convnet"].make_input(2)
        result = backend.optimize(model, "O1", sample_input=x)
        assert statuses(result)["conv_bn_folding"] == "applied" and len(traced) == traces
        bns = [m for m in result.model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        assert bns and all(isinstance(m, FoldedBatchNorm) for m in bns)


def test_skip_reasons_for_an_mlp_at_o1() -> None:
    result = torchbridge.get_backend("cpu").optimize(MODELS["mlp"].build().eval(), "O1")
    skipped = {p.name: p.detail for p in result.skipped}
    assert skipped["conv_bn_folding"] == "no convolution with BatchNorm in the model"
    assert skipped["channels_last"] == "no Conv2d in the model"
    assert "below this pass's O2" in skipped["autocast"]
    assert "below this pass's O3" in skipped["inference_freezing"]


def test_no_bf16_autocast_without_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.builtin.cpu import host

    monkeypatch.setattr(host, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    result = torchbridge.get_backend("cpu").optimize(MODELS["mlp"].build().eval(), "O2")
    record = next(p for p in result.passes if p.name == "autocast")
    assert record.status == "skipped" and "no native low-precision dtype" in record.detail


def test_allow_bf16_off_vetoes_autocast() -> None:
    backend = torchbridge.get_backend("cpu", TorchBridgeConfig(
        hardware={"cpu": {"allow_bf16": False}}))
    result = backend.optimize(MODELS["mlp"].build().eval(), "O2")
    record = next(p for p in result.passes if p.name == "autocast")
    assert record.detail == "vetoed by plugin cpu: config hardware.cpu.allow_bf16 is off"


def test_training_model_gets_no_eval_only_pass() -> None:
    result = torchbridge.get_backend("cpu").optimize(MODELS["convnet"].build().train(), "O3")
    st = statuses(result)
    assert st["conv_bn_folding"] == "skipped"
    assert st["inference_freezing"] == "skipped"
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in result.model.modules())


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_prepared_model_still_trains(level: str) -> None:
    torch.manual_seed(0)
    ref = MODELS["convnet"]
    model = torchbridge.get_backend("cpu").prepare_model(ref.build().train(), level)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = ref.make_input(16), torch.randint(0, 10, (16,))
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("level, frozen", [("O2", False), ("O3", True)])
def test_inference_freezing_folds_the_weights(level: str, frozen: bool) -> None:
    """At O3 the code inductor generates holds the weights as frozen constants; at O2 it
    takes them as inputs. (torch.compile(options={"freezing": True}) alone compiled
    without freezing: the pass reported it applied while every weight stayed an input.)"""
    ref = MODELS["mlp"]
    x = ref.make_input(4)
    result = torchbridge.get_backend("cpu").optimize(ref.build().eval(), level)
    assert statuses(result)["compile"] == "applied"
    code = _Lines()
    inductor_log = logging.getLogger("torch._inductor")
    inductor_log.addHandler(code)
    torch._logging.set_logs(output_code=True)
    try:
        with torch.inference_mode():
            result.model(x)  # compiles here: no sample input was given
    finally:
        torch._logging.set_logs()
        inductor_log.removeHandler(code)
    generated = "\n".join(code.lines)
    assert "def call(" in generated  # the generated code was seen
    assert ("_frozen_param" in generated) is frozen
