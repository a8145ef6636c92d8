"""The plugin registry tells the truth: a refused registration changes nothing,
unregistering refuses what it cannot do, and a plugin-selection variable naming no
installed plugin says so (adversarial findings 1, 3 and 6)."""

from __future__ import annotations

import logging

import pytest
import torchbridge
from torchbridge.errors import PluginError
from torchbridge.plugins import get_plugin_host, plugin_records


def records() -> dict[str, torchbridge.plugins.PluginRecord]:
    return {r.name: r for r in plugin_records()}


class FromTheFuture:
    TORCHBRIDGE_CONTRACT = ">=9"  # this core implements 3.x: refused


class Acme:
    def __init__(self, name: str = "acme_truth") -> None:
        self.name = name

    @torchbridge.hookimpl
    def torchbridge_detect(self) -> torchbridge.Detection:
        return torchbridge.Detection(self.name, True, -40, "cpu", 1, "Acme",
                                     fallbacks=("cpu",))


class Empty:
    pass


# --- 1: a refused registration under a name in use changes nothing -----------------------


def test_a_refused_registration_under_the_cpu_name_leaves_the_builtin_alone(
        reload_plugins: None) -> None:
    # Bug: the refusal wrote a runtime/incompatible record over the built-in's; cpu then
    # read as unavailable and get_backend() blamed the installation.
    with pytest.raises(PluginError, match="'cpu' is already in use by the built-in plugin"):
        torchbridge.register_plugin(FromTheFuture(), name="cpu")
    cpu = records()["cpu"]
    assert (cpu.group, cpu.status, cpu.error) == ("builtin", "builtin", None)
    status = {s.name: s for s in torchbridge.list_backends()}["cpu"]
    assert status.available, status.reason
    assert torchbridge.get_backend("cpu").name == "cpu"
    assert isinstance(torchbridge.detect_best_backend(), str)


def test_a_refused_registration_under_a_registered_name_keeps_that_plugins_record(
        reload_plugins: None) -> None:
    torchbridge.register_plugin(Acme(), name="acme_truth")
    with pytest.raises(PluginError, match="'acme_truth' is already in use by the plugin "
                       "'acme_truth' registered at run time"):
        torchbridge.register_plugin(FromTheFuture(), name="acme_truth")
    record = records()["acme_truth"]
    assert (record.status, record.error, record.contract) == ("loaded", None, None)
    assert torchbridge.get_backend("acme_truth").name == "acme_truth"


def test_a_plugin_registered_under_a_disabled_entry_points_name_replaces_its_record(
        reload_plugins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # An entry point that is not loaded holds no name: a fixed plugin registered under it
    # replaces its record, as it always did (a plugin may rely on it).
    monkeypatch.setenv("TORCHBRIDGE_DISABLE_PLUGINS", "example")
    torchbridge.reload_plugins()
    assert torchbridge.register_plugin(Acme("example"), name="example") == "example"
    assert (records()["example"].group, records()["example"].status) == ("runtime", "loaded")
    assert get_plugin_host().pm.get_plugin("example") is not None


@pytest.mark.parametrize("taken", ["cpu", "generic", "triton", "example", "acme_truth"])
def test_registering_a_taken_name_is_a_plugin_error_that_changes_nothing(
        reload_plugins: None, taken: str) -> None:
    # Bug: pluggy's raw ValueError, showing the new object and every registered plugin.
    if taken == "acme_truth":
        torchbridge.register_plugin(Acme(), name="acme_truth")
    host = get_plugin_host()
    holder, generation = host.pm.get_plugin(taken), host.generation
    before = records()[taken].to_dict()
    with pytest.raises(PluginError, match=f"plugin name '{taken}' is already in use by .*"
                       "nothing was changed") as info:
        torchbridge.register_plugin(Empty(), name=taken)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)  # what pluggy raised there: still caught
    assert host.pm.get_plugin(taken) is holder and host.generation == generation
    assert records()[taken].to_dict() == before


def test_registering_the_same_object_twice_names_where_it_is_registered(
        reload_plugins: None) -> None:
    plugin = Acme()
    torchbridge.register_plugin(plugin, name="acme_truth")
    with pytest.raises(PluginError, match="already registered as 'acme_truth'"):
        torchbridge.register_plugin(plugin, name="acme_truth_2")
    assert "acme_truth_2" not in records()


def test_a_refused_registration_under_a_free_name_is_still_recorded(
        reload_plugins: None) -> None:
    # Unchanged: doctor shows why it is not there, and a fixed plugin can take the name.
    with pytest.raises(PluginError, match="'future_truth' not registered: written for "
                       "plugin contract >=9"):
        torchbridge.register_plugin(FromTheFuture(), name="future_truth")
    assert records()["future_truth"].status == "incompatible"
    assert torchbridge.register_plugin(Acme("future_truth"), name="future_truth") == \
        "future_truth"
    assert records()["future_truth"].status == "loaded"


# --- 3: unregister_plugin refuses what it cannot do ---------------------------------------


def test_unregistering_a_name_that_is_not_registered_is_a_deprecation_warning(
        reload_plugins: None) -> None:
    """It did nothing without a word; it will raise PluginError from contract 4.0.0, after
    a release that warns (the contract's rule for a behaviour a plugin may rely on)."""
    torchbridge.register_plugin(Acme(), name="acme_truth")
    generation = get_plugin_host().generation
    with pytest.warns(DeprecationWarning, match=r"unregister_plugin\('acme_truh'\) names no "
                      r"registered plugin \(registered: .*\); did you mean 'acme_truth'\?"):
        torchbridge.unregister_plugin("acme_truh")
    assert get_plugin_host().generation == generation
    assert torchbridge.get_backend("acme_truth").name == "acme_truth"


def test_the_cpu_plugin_cannot_be_unregistered(reload_plugins: None) -> None:
    # Removed, no backend was left: get_backend() said the installation was broken.
    with pytest.raises(PluginError, match="'cpu' is built into torchbridge-core and "
                       "cannot be unregistered"):
        torchbridge.unregister_plugin("cpu")
    assert get_plugin_host().pm.get_plugin("cpu") is not None
    assert records()["cpu"].status == "builtin"
    assert torchbridge.get_backend("cpu").name == "cpu"
    assert "cpu" in torchbridge.TorchBridgeConfig().hardware.model_dump()


@pytest.mark.parametrize("builtin", ["generic", "triton"])
def test_unregistering_another_builtin_plugin_is_a_deprecation_warning(
        reload_plugins: None, builtin: str) -> None:
    # docs/plugins/writing.md: the built-in plugins are always there; removing one worked
    # (a plugin may rely on it), so it warns before it raises in contract 4.
    with pytest.warns(DeprecationWarning, match=f"unregister_plugin\\('{builtin}'\\) "
                      "removes a plugin built into torchbridge-core"):
        torchbridge.unregister_plugin(builtin)
    assert get_plugin_host().pm.get_plugin(builtin) is None
    assert torchbridge.get_backend("cpu").name == "cpu"


def test_unregistering_a_disabled_entry_point_is_a_deprecation_warning(
        reload_plugins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHBRIDGE_DISABLE_PLUGINS", "example")
    torchbridge.reload_plugins()
    with pytest.warns(DeprecationWarning, match=r"unregister_plugin\('example'\) names no "
                      r"registered plugin \(disabled: disabled by "
                      r"TORCHBRIDGE_DISABLE_PLUGINS\)"):
        torchbridge.unregister_plugin("example")


def test_unregister_removes_a_plugin_and_the_record_of_a_refused_one(
        reload_plugins: None) -> None:
    torchbridge.register_plugin(Acme(), name="acme_truth")
    torchbridge.unregister_plugin("acme_truth")
    assert "acme_truth" not in records()
    assert "acme_truth" not in {s.name for s in torchbridge.list_backends(rescan=True)}
    with pytest.raises(PluginError):
        torchbridge.register_plugin(FromTheFuture(), name="future_truth")
    torchbridge.unregister_plugin("future_truth")  # a cleanup after a refusal
    assert "future_truth" not in records()


# --- 6: plugin-selection variables naming no installed plugin -----------------------------


@pytest.mark.parametrize("var", ["TORCHBRIDGE_PLUGINS", "TORCHBRIDGE_DISABLE_PLUGINS"])
def test_a_selection_name_that_is_no_installed_plugin_is_a_warning(
        reload_plugins: None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, var: str) -> None:
    monkeypatch.setenv(var, "exampel")
    with caplog.at_level(logging.WARNING, logger="torchbridge"):
        host = torchbridge.reload_plugins()
    said = [r.getMessage() for r in caplog.records if "exampel" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert said[0].startswith(f"{var} names 'exampel', which is no installed plugin; "
                              "ignored (installed plugins: ")
    assert "example_backend" in said[0] and said[0].endswith("did you mean 'example'?")
    assert host.warnings == said


def test_doctor_shows_a_selection_name_that_is_no_installed_plugin(
        reload_plugins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge import doctor

    monkeypatch.setenv("TORCHBRIDGE_PLUGINS", "exampel")  # only the built-ins: quick
    torchbridge.reload_plugins()
    report = doctor.collect()
    assert len(report["plugin_warnings"]) == 1
    assert "TORCHBRIDGE_PLUGINS names 'exampel'" in report["plugin_warnings"][0]
    text = doctor.render(report)
    plugins = text.split("\nplugins:\n", 1)[1]
    assert plugins.startswith("  warning: TORCHBRIDGE_PLUGINS names 'exampel', which is no "
                              "installed plugin")


def test_disabling_a_builtin_plugin_is_a_warning(
        reload_plugins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHBRIDGE_DISABLE_PLUGINS", "cpu")
    host = torchbridge.reload_plugins()
    assert host.warnings == ["TORCHBRIDGE_DISABLE_PLUGINS names 'cpu', a built-in plugin; "
                             "built-in plugins are always loaded and cannot be disabled"]
    assert torchbridge.get_backend("cpu").name == "cpu"


@pytest.mark.parametrize(("var", "names"), [("TORCHBRIDGE_PLUGINS", "example, cpu"),
                                            ("TORCHBRIDGE_DISABLE_PLUGINS", "example")])
def test_installed_and_builtin_names_give_no_warning(
        reload_plugins: None, monkeypatch: pytest.MonkeyPatch, var: str, names: str) -> None:
    monkeypatch.setenv(var, names)
    assert torchbridge.reload_plugins().warnings == []


def test_the_kernels_command_says_a_selection_name_that_is_no_installed_plugin(
        reload_plugins: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # `torchbridge kernels` quiets the log: the warning went nowhere there.
    from torchbridge.cli import main

    monkeypatch.setenv("TORCHBRIDGE_PLUGINS", "exampel")
    torchbridge.reload_plugins()
    assert main(["kernels", "--backend", "cpu"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: TORCHBRIDGE_PLUGINS names 'exampel', which is no "
                          "installed plugin"), err
