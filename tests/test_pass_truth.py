"""What a plugin's pass does, against what the report says it did, where a pass bends the
contract: a check that changes the model, a pass that returns another model object (a
reweighted copy, a wrapper), a pass that flips the training flag, a pass whose effect
check speaks for it. The blame lands on the pass that did it, and what it did is undone."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torchbridge
from torch import nn
from torchbridge import OptimizationLevel, OptimizationPass
from torchbridge.optimize.passes import PassContext

O1 = OptimizationLevel.O1


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4)).eval()


def weights(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def assert_weights(m: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    now = m.state_dict()
    assert list(now) == list(expected)
    for key, value in expected.items():
        assert torch.equal(now[key], value), key


def register(name: str, *passes: OptimizationPass) -> None:
    class Plugin:
        @torchbridge.hookimpl
        def torchbridge_optimization_passes(self, backend: Any, level: Any
                                            ) -> list[OptimizationPass]:
            return list(passes)

    torchbridge.register_plugin(Plugin(), name=name)


def warnings(plugin: str) -> list[str]:
    return list(torchbridge.plugins.get_plugin_host().records[plugin].warnings)


def records(result: torchbridge.OptimizationResult) -> dict[str, Any]:
    return {p.name: p for p in result.passes}


def tag(m: nn.Module, ctx: PassContext) -> nn.Module:
    m.tagged = True  # type: ignore[assignment]
    return m


def doubles_a_weight(m: nn.Module, ctx: PassContext) -> str:
    with torch.no_grad():
        m[0].weight.mul_(2)  # type: ignore[index]
    return "nothing to do for this model"


def switches_to_train(m: nn.Module, ctx: PassContext) -> str:
    m.train()
    return "nothing to do for this model"


# -- a check that changes the model -------------------------------------------------------

@pytest.mark.parametrize("check", [doubles_a_weight, switches_to_train])
@pytest.mark.parametrize("sample", [False, True])
def test_a_check_that_changes_the_model_is_its_own_passes_failure(
        reload_plugins: None, check: Any, sample: bool) -> None:
    """Before: the check ran before the snapshot; the pass was reported skipped, the next
    pass (mutates=False, honest) was rolled back as a liar and warned in doctor, and where
    no such pass came after, the doubled weight shipped, in the caller's own model with
    inplace=True."""
    register("prober", OptimizationPass("probe", "probes the model", O1, lambda m, c: m,
                                        check=check, order=55))
    register("honest", OptimizationPass("tag", "tags the model", O1, tag, mutates=False,
                                        order=56))
    x = torch.randn(4, 16) if sample else None
    for inplace in (False, True):
        given = model()
        before = weights(given)
        result = torchbridge.get_backend("cpu").optimize(given, "O1", sample_input=x,
                                                         inplace=inplace)
        found = records(result)
        assert found["probe"].status == "failed"
        assert found["probe"].detail.startswith("rolled back: its check changed ")
        assert ("tensors 0.weight" if check is doubles_a_weight
                else "the training flag of (the model) (eval -> train)") in found["probe"].detail
        assert (found["tag"].status, found["tag"].plugin) == ("applied", "honest")
        assert_weights(result.model, before)
        assert_weights(given, before)
        assert not result.model.training and not any(m.training for m in given.modules())
    assert warnings("honest") == []
    assert warnings("prober") and all("its check changed" in w for w in warnings("prober"))


def test_a_check_that_changes_the_model_ships_nothing_without_a_pass_after_it(
        reload_plugins: None) -> None:
    register("prober", OptimizationPass("probe", "probes the model", O1, lambda m, c: m,
                                        check=doubles_a_weight, order=55))
    given = model()
    before = weights(given)
    result = torchbridge.get_backend("cpu").optimize(given, "O1", inplace=True)
    assert records(result)["probe"].status == "failed"
    assert_weights(given, before)


def test_a_check_that_changes_the_model_then_raises_is_put_back(reload_plugins: None
                                                                ) -> None:
    def breaks(m: nn.Module, ctx: PassContext) -> str:
        doubles_a_weight(m, ctx)
        raise RuntimeError("the probe broke")

    register("prober", OptimizationPass("probe", "probes the model", O1, lambda m, c: m,
                                        check=breaks, order=55))
    given = model()
    before = weights(given)
    result = torchbridge.get_backend("cpu").optimize(given, "O1", inplace=True)
    record = records(result)["probe"]
    assert (record.status, record.detail) == ("failed", "RuntimeError: the probe broke")
    assert_weights(given, before)


def test_a_check_that_changes_the_model_fails_strict_mode(reload_plugins: None) -> None:
    register("prober", OptimizationPass("probe", "probes the model", O1, lambda m, c: m,
                                        check=doubles_a_weight, order=55))
    given = model()
    before = weights(given)
    with pytest.raises(torchbridge.ModelOptimizationError,
                       match=r"pass 'probe' \(plugin prober\) failed: rolled back: its check "
                             r"changed tensors 0\.weight"):
        torchbridge.get_backend("cpu").optimize(given, "O1", inplace=True, strict=True)
    assert_weights(given, before)


# -- a pass that returns another model object ---------------------------------------------

def zeroed_copy(m: nn.Module, ctx: PassContext) -> nn.Module:
    new = copy.deepcopy(m)
    with torch.no_grad():
        new[0].weight.zero_()  # type: ignore[index]
    return new


def slightly_scaled_copy(m: nn.Module, ctx: PassContext) -> nn.Module:
    new = copy.deepcopy(m)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1.00001)  # within O1's tolerance: the check on the sample cannot see it
    return new


@pytest.mark.parametrize("apply", [zeroed_copy, slightly_scaled_copy])
@pytest.mark.parametrize("sample", [False, True])
def test_mutates_false_holds_for_a_returned_copy(reload_plugins: None, apply: Any,
                                                 sample: bool) -> None:
    """Before: reported applied, the copy's weights shipped; the same change in place was
    rolled back as a lie."""
    register("copier", OptimizationPass("copies", "only installs a forward", O1, apply,
                                        mutates=False, order=55))
    given = model()
    before = weights(given)
    result = torchbridge.get_backend("cpu").optimize(
        given, "O1", sample_input=torch.randn(4, 16) if sample else None)
    record = records(result)["copies"]
    assert record.status == "failed"
    assert "declared mutates=False but changed tensors 0.weight" in record.detail
    assert_weights(result.model, before)
    assert any("copies" in w for w in warnings("copier"))


def test_a_returned_copy_as_it_was_given_is_no_lie(reload_plugins: None) -> None:
    register("copier", OptimizationPass("copies", "returns a copy", O1,
                                        lambda m, c: copy.deepcopy(m), mutates=False,
                                        order=55))
    given = model()
    result = torchbridge.get_backend("cpu").optimize(given, "O1",
                                                     sample_input=torch.randn(4, 16))
    assert records(result)["copies"].status == "applied"
    assert_weights(result.model, weights(given))
    assert warnings("copier") == []


class Wrap(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x)
        return out


@pytest.mark.parametrize("mutates", [True, False])
def test_a_pass_that_returns_a_wrapper_is_rolled_back(reload_plugins: None,
                                                      mutates: bool) -> None:
    """docs/guide/prepare-model.md: a prepared model is your model, not a wrapper (same class
    and state_dict keys), whatever the pass declared. Before: applied, no note."""
    register("wrapper", OptimizationPass("wraps", "wraps for the runtime", O1,
                                         lambda m, c: Wrap(m).eval(), mutates=mutates,
                                         order=56))
    given = model()
    result = torchbridge.get_backend("cpu").optimize(given, "O1",
                                                     sample_input=torch.randn(4, 16))
    record = records(result)["wraps"]
    assert record.status == "failed"
    assert "returned a Wrap for the Sequential it was given" in record.detail
    assert "its state_dict keys differ, lacking 0.weight, 0.bias, 2.weight, 2.bias, adding " \
           "inner.0.weight" in record.detail
    assert type(result.model) is nn.Sequential
    assert list(result.model.state_dict()) == list(given.state_dict())


def adds_a_key_then_returns_a_copy(m: nn.Module, ctx: PassContext) -> nn.Module:
    m.register_buffer("extra", torch.zeros(1))
    return copy.deepcopy(m)


def test_a_replacement_is_compared_with_the_keys_the_model_had_before_the_pass(
        reload_plugins: None) -> None:
    """A pass that adds a key to the given model in place and returns a copy holding it:
    the copy is no drop-in for the model as given. Before: its keys were read from the
    given model after the pass, so they matched, and the pass was applied."""
    register("adds_key", OptimizationPass("adds_key", "adds a buffer, returns a copy", O1,
                                          adds_a_key_then_returns_a_copy, order=56))
    given = model()
    keys = list(given.state_dict())
    result = torchbridge.get_backend("cpu").optimize(given, "O1",
                                                     sample_input=torch.randn(4, 16))
    record = records(result)["adds_key"]
    assert record.status == "failed"
    assert "its state_dict keys differ, adding extra" in record.detail
    assert list(result.model.state_dict()) == keys


# -- the training flag --------------------------------------------------------------------

@pytest.mark.parametrize("which", ["model", "dropout"])
def test_a_pass_that_changes_the_training_flag_is_rolled_back(reload_plugins: None,
                                                              which: str) -> None:
    """Before: applied with drift 0 (the checks run in eval mode), while the prepared model
    ran dropout."""
    def flips(m: nn.Module, ctx: PassContext) -> nn.Module:
        (m if which == "model" else m[1]).train()  # type: ignore[index]
        return m

    register("flipper", OptimizationPass("flips", "sets up the graph", O1, flips,
                                         mutates=False, order=55))
    given, x = model(), torch.randn(4, 16)
    result = torchbridge.get_backend("cpu").optimize(given, "O1", sample_input=x)
    record = records(result)["flips"]
    assert record.status == "failed"
    assert ("the training flag of (the model) (eval -> train), 0 (eval -> train)"
            if which == "model" else "the training flag of 1 (eval -> train)") in record.detail
    assert not any(m.training for m in result.model.modules())
    with torch.no_grad():
        assert torch.equal(result.model(x), given(x))
    assert any("flips" in w for w in warnings("flipper"))


def test_a_replacing_pass_that_changes_the_training_flag_is_rolled_back(
        reload_plugins: None) -> None:
    def train_copy(m: nn.Module, ctx: PassContext) -> nn.Module:
        return copy.deepcopy(m).train()

    register("flipper", OptimizationPass("flips", "copies for the runtime", O1, train_copy,
                                         order=55))
    result = torchbridge.get_backend("cpu").optimize(model(), "O1",
                                                     sample_input=torch.randn(4, 16))
    record = records(result)["flips"]
    assert record.status == "failed" and "the training flag of (the model)" in record.detail
    assert not result.model.training


def test_a_training_model_stays_in_training_mode(reload_plugins: None) -> None:
    def to_eval(m: nn.Module, ctx: PassContext) -> nn.Module:
        return m.eval()

    register("flipper", OptimizationPass("evals", "inference graph", O1, to_eval,
                                         order=55))
    given = model().train()
    result = torchbridge.get_backend("cpu").optimize(given, "O1")
    assert records(result)["evals"].status == "failed"
    assert all(m.training for m in result.model.modules())


# -- a pass whose effect check speaks for it ----------------------------------------------

@pytest.mark.parametrize("missing", [None, "the runtime did not take it"])
def test_a_pass_with_an_effect_check_is_taken_at_its_word(reload_plugins: None,
                                                          missing: str | None) -> None:
    """Its effect may live where the pipeline does not look (a device runtime): applied when
    the effect check finds it, even though the model, the watched settings and ctx.state are
    as they were; skipped when not (docs/guide/prepare-model.md)."""
    register("runtime", OptimizationPass("configures", "configures the runtime", O1,
                                         lambda m, c: m, effect=lambda m, c: missing,
                                         order=55))
    result = torchbridge.get_backend("cpu").optimize(model(), "O1")
    record = records(result)["configures"]
    if missing is None:
        assert record.status == "applied"
    else:
        assert (record.status, record.detail) == ("skipped", f"no effect: {missing}")


def test_a_pass_without_an_effect_check_that_changes_nothing_is_skipped(
        reload_plugins: None) -> None:
    register("runtime", OptimizationPass("configures", "configures the runtime", O1,
                                         lambda m, c: m, order=55))
    result = torchbridge.get_backend("cpu").optimize(model(), "O1")
    record = records(result)["configures"]
    assert record.status == "skipped" and record.detail.startswith("apply changed nothing")


# -- config optimization.disabled_passes --------------------------------------------------

def test_a_disabled_pass_name_that_matches_no_pass_is_noted() -> None:
    """A misspelt name disabled nothing, and the pass it meant ran, without a word."""
    config = torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": ["conv_bn_foldng", "conv_bn_folding"]})
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    result = torchbridge.get_backend("cpu", config).optimize(
        net, "O1", sample_input=torch.randn(1, 3, 8, 8))
    notes = [n for n in result.notes if "disabled_passes" in n]
    assert notes == ["config optimization.disabled_passes names 'conv_bn_foldng', which no "
                     "pass of this run has, so it disabled nothing; did you mean "
                     "'conv_bn_folding'?"]
    assert records(result)["conv_bn_folding"].status == "skipped"
