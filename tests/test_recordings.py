"""Every recording under tests/recordings/ replayed at its plugin's probe seam: through the
plugin (the backend is found, selected and describes each recorded device as recorded) and
through the contract suite (one BackendContract per recorded backend). The test helpers of
test_nvidia, test_amd and test_intel set up the seam first (their fixtures and the calls a
recording does not hold); `torchbridge.recording.replay` then installs the recorded answers.
Also: `torchbridge doctor --record` on this machine writes a valid recording."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torchbridge
from test_amd import FakeGPUs as FakeAMDGPUs
from test_amd import rocm_flags  # noqa: F401  (a fixture, used by name)
from test_contract_recorded import built_with_nccl, hipblaslt_env  # noqa: F401
from test_intel import FakeXPUs
from test_nvidia import FakeGPUs as FakeNVIDIAGPUs
from test_nvidia import gpu_flags  # noqa: F401  (a fixture, used by name)
from torchbridge import recording
from torchbridge.testing import BackendContract

RECORDINGS = Path(__file__).parent / "recordings"
FILES = sorted(RECORDINGS.glob("**/*.json"))

# Per plugin: the test helper that sets up its seam (any recorded kind: the recording
# replaces what it answers), and the fixtures its tests need.
SEAMS: dict[str, tuple[Callable[..., Any], str, tuple[str, ...]]] = {
    "nvidia": (FakeNVIDIAGPUs, "H100", ("gpu_flags",)),
    "amd": (FakeAMDGPUs, "MI300X", ("hipblaslt_env", "rocm_flags")),
    "intel": (FakeXPUs, "Max 1550", ()),
}


def entries() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in FILES:
        for entry in recording.vendor_devices(recording.load(path)):
            found.append((f"{path.stem}:{entry['plugin']}", entry))
    return found


ENTRIES = entries()


def install(monkeypatch: pytest.MonkeyPatch, entry: dict[str, Any]) -> None:
    """The recorded machine at the probe seam: its torch has NCCL (RCCL) where it is a CUDA
    or ROCm build; the plugin's test helper, then the recording."""
    fake, kind, _ = SEAMS[entry["plugin"]]
    if entry["plugin"] in ("nvidia", "amd"):
        built_with_nccl(monkeypatch)
    fake(monkeypatch, kind, count=entry["probe"]["device_count"])
    recording.replay(entry, monkeypatch)


def test_there_are_recordings_and_each_says_where_it_comes_from() -> None:
    assert len(FILES) >= 3
    for path in FILES:
        data = recording.load(path)  # the format, and nothing identifying
        assert data["source"] in (recording.CAPTURED, recording.HAND_WRITTEN), path
        assert data["description"], f"{path.name}: say what the device is and where from"
        assert recording.vendor_devices(data), f"{path.name} records no vendor device"
    plugins = {entry["plugin"] for _, entry in ENTRIES}
    assert {"nvidia", "amd", "intel"} <= plugins


@pytest.mark.parametrize(("label", "entry"), ENTRIES, ids=[label for label, _ in ENTRIES])
def test_replayed_through_the_plugin(request: pytest.FixtureRequest,
                                     monkeypatch: pytest.MonkeyPatch, label: str,
                                     entry: dict[str, Any]) -> None:
    for fixture in SEAMS[entry["plugin"]][2]:
        request.getfixturevalue(fixture)
    install(monkeypatch, entry)
    name = entry["backend"]
    assert torchbridge.detect_best_backend() == name
    backend = torchbridge.get_backend(name)
    assert backend.device_count == entry["probe"]["device_count"]
    for index, device in enumerate(entry["devices"]):
        info = backend.get_device_info(index)
        props = device["device_properties"]["fields"]
        assert info.name == props["name"]
        assert info.device == f"{backend.device.type}:{index}"
        _free, total = device["mem_get_info"]
        assert info.memory_total_gb == pytest.approx(total / 1024**3)
        stats = backend.get_memory_stats(index)
        assert stats.total_bytes in (None, total)
        assert stats.allocated_bytes in (None, device["allocator_counters"][0])


def test_the_nvidia_helpers_h100_is_the_captured_one() -> None:
    """The vendor tests' H100 (test_nvidia's FakeGPUs) has the properties a real one
    reported through torch, not the hand-written ones it had (total memory was nvidia-smi's
    figure, 0.5 GB over torch's)."""
    data = recording.load(RECORDINGS / "nvidia-h100-80gb-hbm3-x1.json")
    assert data["source"] == recording.CAPTURED
    [entry] = recording.vendor_devices(data)
    [device] = entry["devices"]
    from test_nvidia import props

    helper = props("H100")
    assert device["device_properties"]["fields"] == {
        "name": helper.name, "major": helper.major, "minor": helper.minor,
        "multi_processor_count": helper.multi_processor_count,
        "total_memory": helper.total_memory, "pci_bus_id": None}


@pytest.mark.parametrize(("fake", "kind", "path"), [
    (FakeAMDGPUs, "MI300X", "amd-instinct-mi300x-x2.json"),
    (FakeXPUs, "Max 1550", "intel-max-1550-x2.json")])
def test_hand_written_recordings_are_the_test_helpers_devices(
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
        fake: Callable[..., Any], kind: str, path: str) -> None:
    """The converted files describe what the vendor tests' RECORDED entries describe."""
    [entry] = recording.vendor_devices(recording.load(RECORDINGS / path))
    for fixture in SEAMS[entry["plugin"]][2]:
        request.getfixturevalue(fixture)
    fake(monkeypatch, kind, count=2)
    by_helper = [torchbridge.get_backend(entry["backend"]).get_device_info(i).to_dict()
                 for i in range(2)]
    recording.replay(entry, monkeypatch)
    by_file = [torchbridge.get_backend(entry["backend"]).get_device_info(i).to_dict()
               for i in range(2)]
    assert by_file == by_helper


def _contract_class(label: str, entry: dict[str, Any]) -> type[BackendContract]:
    def record(self: BackendContract, monkeypatch: pytest.MonkeyPatch) -> None:
        install(monkeypatch, entry)

    props = entry["devices"][0]["device_properties"]["fields"]
    cls = type(f"TestContract_{label}", (BackendContract,), {
        "backend_name": entry["backend"],
        "recorded": f"{props['name']} x{entry['probe']['device_count']} from "
                    f"tests/recordings/{label.split(':')[0]}.json at {entry['probe_module']}",
        "record": record,
        "__module__": __name__})
    fixtures = SEAMS[entry["plugin"]][2]
    return pytest.mark.usefixtures(*fixtures)(cls) if fixtures else cls


for _label, _entry in ENTRIES:
    _name = "TestContract_" + "".join(c if c.isalnum() else "_" for c in _label)
    globals()[_name] = _contract_class(_label, _entry)
    globals()[_name].__name__ = globals()[_name].__qualname__ = _name


def test_doctor_record_writes_a_valid_recording_of_this_machine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from torchbridge.cli import main

    out = tmp_path / "this-machine.json"
    assert main(["doctor", "--record", str(out)]) == 0
    said = capsys.readouterr().out
    data = recording.load(out)
    assert data["source"] == recording.CAPTURED
    assert data["versions"]["torch"]
    backends = {e["backend"]: e for e in data["plugins"]}
    assert backends["cpu"]["probe"]["available"] is True
    assert backends["cpu"]["device_info"]["name"]
    if not recording.vendor_devices(data):  # this CPU machine
        assert "no vendor device" in said
        for name in ("cuda", "rocm", "xpu"):
            assert backends[name]["probe"]["available"] is False
            assert backends[name]["probe"]["reason"]
    import socket

    assert socket.gethostname() not in out.read_text()
    json.loads(out.read_text())


def test_a_recording_with_an_identifying_field_is_refused(tmp_path: Path) -> None:
    data = json.loads((RECORDINGS / "nvidia-h100-80gb-hbm3-x1.json").read_text())
    data["plugins"][0]["devices"][0]["device_properties"]["fields"]["uuid"] = "GPU-1234"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="identifying field 'uuid'"):
        recording.load(bad)
    data["source"] = "made up"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="source"):
        recording.load(bad)
