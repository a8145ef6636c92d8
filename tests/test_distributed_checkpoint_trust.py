"""Distributed checkpoints an adversary cannot turn against the loader (issue 20, items 1
and 2): no code from a crafted `.metadata`, torch's BaseException CheckpointException never
escapes, a killed or failed save leaves the previous version loadable and bit-identical,
damaged, mixed, missing or extra files are refused naming the file, keep_last, and no
planted symlink is followed. Run as a script, this file is the 2-rank gloo worker."""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import logging
import os
import pickle
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torchbridge
import torchbridge.distributed as tbd
from torch import nn
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torchbridge import CheckpointError

sys.path.insert(0, str(Path(__file__).parent))
import distributed_worker as worker
from hang_bounds import HANG_S

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model and an SGD optimizer with momentum state after one step."""
    model = worker.make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(seed)
    optimizer = worker.make_optimizer(model.parameters())
    x, y = worker.global_batch()
    worker.train(model, optimizer, x, y, steps=1)
    return model, optimizer


def current(root: Path) -> Path:
    return root / (root / "CURRENT").read_text().split()[0]


def snapshot(root: Path) -> dict[str, str]:
    """SHA-256 of every file under `root` (links not followed)."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder) / name
            if not path.is_symlink():
                found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()
                                                                     ).hexdigest()
    return found


def loaded(root: Path) -> dict[str, torch.Tensor]:
    model = worker.make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    tbd.load_distributed_checkpoint(model, root)
    return model.state_dict()


def assert_state(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert state.keys() == reference.keys()
    for key in reference:
        assert torch.equal(state[key], reference[key]), key


def rewrite_manifest(root: Path) -> None:
    """What an attacker with write access does: recompute the manifest and CURRENT so the
    checksums match the tampered files."""
    version = current(root)
    manifest_path = version / "MANIFEST.json"
    body = json.loads(manifest_path.read_text())
    for name in body["files"]:
        data = (version / name).read_bytes()
        body["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = json.dumps(body).encode()
    manifest_path.write_bytes(manifest)
    (root / "CURRENT").write_text(f"{version.name} {hashlib.sha256(manifest).hexdigest()}\n")


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


# -- 1. no code from a checkpoint ------------------------------------------------------------

@pytest.mark.parametrize("layout", ["manifest", "previous-release"])
def test_crafted_metadata_runs_no_code_in_load_or_convert(tmp_path: Path, layout: str
                                                          ) -> None:
    model, _ = trained()
    root = tmp_path / "ckpt"
    marker = tmp_path / "marker"
    if layout == "manifest":
        tbd.save_distributed_checkpoint(model, root)
        metadata = current(root) / ".metadata"
    else:  # a bare DCP folder, as the previous release wrote it
        dcp_save({"model": model.state_dict()}, checkpoint_id=root, no_dist=True)
        metadata = root / ".metadata"
    metadata.write_bytes(pickle.dumps(_Payload(marker)))
    if layout == "manifest":
        rewrite_manifest(root)  # checksums agree: only the safe unpickler stands in the way
    with pytest.raises(CheckpointError, match=r"\.metadata.*refused global io\.open"):
        tbd.load_distributed_checkpoint(worker.make_model(), root)
    with pytest.raises(CheckpointError, match=r"\.metadata.*refused global io\.open"):
        tbd.distributed_to_single_file(root, tmp_path / "one.pt")
    assert not marker.exists()
    assert not (tmp_path / "one.pt").exists()


def test_crafted_non_tensor_value_runs_no_code(tmp_path: Path) -> None:
    """DCP reads non-tensor values (an optimizer's lr) with torch.load(weights_only=False);
    ours read them weights-only."""
    root, marker = tmp_path / "ckpt", tmp_path / "marker"
    dcp_save({"model": {"w": torch.ones(2)}, "extra": _Payload(marker)}, checkpoint_id=root,
             no_dist=True)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"Weights only load failed|weights_only"):
        tbd.distributed_to_single_file(root, tmp_path / "one.pt")
    assert not marker.exists()


def test_old_layout_loads_unverified_with_a_warning(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    model, _ = trained()
    dcp_save({"model": model.state_dict()}, checkpoint_id=tmp_path, no_dist=True)
    with caplog.at_level(logging.WARNING, "torchbridge.distributed.manifest"):
        assert_state(loaded(tmp_path), model.state_dict())
    assert "not verified" in caplog.text


def test_torch_checkpoint_exceptions_become_checkpoint_error(tmp_path: Path) -> None:
    tbd.save_distributed_checkpoint(nn.Linear(3, 2), tmp_path)
    with pytest.raises(CheckpointError, match="cannot load distributed checkpoint") as info:
        tbd.load_distributed_checkpoint(worker.make_model(), tmp_path)  # other keys
    assert isinstance(info.value, Exception)
    with pytest.raises(CheckpointError, match="not a distributed checkpoint"):
        tbd.load_distributed_checkpoint(worker.make_model(), tmp_path / "nothing")


# -- 2. a save never harms the previous checkpoint -------------------------------------------

def test_a_failed_save_leaves_the_previous_version_bit_identical(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    v1, _ = trained(0)
    tbd.save_distributed_checkpoint(v1, tmp_path)
    before = snapshot(tmp_path)
    original = dcp_filesystem._write_item

    def failing(*args: Any, **kwargs: Any) -> Any:
        stream = args[1] if len(args) > 1 else kwargs["stream"]
        stream.write(b"half a tensor")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_filesystem, "_write_item", failing)
    with pytest.raises(CheckpointError, match=r"untouched.*No space left on device"):
        tbd.save_distributed_checkpoint(trained(1)[0], tmp_path)
    monkeypatch.setattr(dcp_filesystem, "_write_item", original)
    assert snapshot(tmp_path) == before  # the failed version's folder is gone too
    assert_state(loaded(tmp_path), v1.state_dict())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_killing_one_rank_mid_save_leaves_the_previous_version(tmp_path: Path) -> None:
    """2 gloo ranks: save v1, a save failing on rank 1 (OSError), a save where rank 1 is
    SIGKILLed while writing; v1 stays current, loadable and bit-identical."""
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    ranks = []
    for rank in (0, 1):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        ranks.append(subprocess.Popen([sys.executable, __file__, "--root", str(root),
                                       "--out", str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        # Hang catchers only: rank 1 dies in its third save; rank 0 marks that it began.
        assert ranks[1].wait(timeout=HANG_S) == -signal.SIGKILL, ranks[1].stdout.read()  # type: ignore[union-attr]
        deadline = time.monotonic() + HANG_S
        while not (out / "v2_started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
    assert (out / "v2_started").exists(), ranks[0].stdout.read()  # type: ignore[union-attr]
    for rank in (0, 1):  # the failing save was refused on both ranks, as CheckpointError
        assert "No space left" in (out / f"failed{rank}.txt").read_text()
    before = json.loads((out / "v1_files.json").read_text())
    version = current(root)
    assert sorted(p.name for p in version.glob("*.distcp")) == ["__0_0.distcp",
                                                                "__1_0.distcp"]
    after = snapshot(root)
    assert {k: after[k] for k in before} == before  # v1 and CURRENT: bit-identical
    # the killed save's folder: never published (rank 0 may have removed it when gloo
    # reported the dead peer, or been killed first and left it unpublished)
    assert [p for p in root.glob("v*") if (p / "MANIFEST.json").exists()] == [version]
    v1 = torch.load(out / "v1.pt")
    assert_state(loaded(root), v1)
    single = tbd.distributed_to_single_file(root, tmp_path / "one.pt")
    assert_state(torchbridge.load_checkpoint(single), v1)


def _worker_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    root, out = Path(args.root), Path(args.out)
    ctx = tbd.initialize(timeout=HANG_S)  # a rank slow to start on a busy machine is waited for
    model = worker.make_model()
    tbd.save_distributed_checkpoint(model, root)
    if ctx.rank == 0:
        torch.save(model.state_dict(), out / "v1.pt")
        (out / "v1_files.json").write_text(json.dumps(snapshot(root)))
    original = dcp_filesystem._write_item

    def failing(*a: Any, **k: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    def killed(*a: Any, **k: Any) -> Any:
        stream = a[1] if len(a) > 1 else k["stream"]
        stream.write(b"half a tensor")
        stream.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if ctx.rank == 1:
        dcp_filesystem._write_item = failing
    try:
        tbd.save_distributed_checkpoint(model, root)
    except CheckpointError as exc:
        (out / f"failed{ctx.rank}.txt").write_text(str(exc))
    dcp_filesystem._write_item = original
    if ctx.rank == 1:
        dcp_filesystem._write_item = killed
    else:
        (out / "v2_started").write_text("")
    tbd.save_distributed_checkpoint(model, root)  # rank 1 dies inside; rank 0 waits
    os._exit(3)  # not reached


# -- 2. damaged, mixed, missing, extra files ------------------------------------------------

def test_byte_flips_in_every_file_are_refused_naming_the_file(tmp_path: Path) -> None:
    model, optimizer = trained()
    tbd.save_distributed_checkpoint(model, tmp_path, optimizer)
    version = current(tmp_path)
    targets = [*sorted(version.iterdir()), tmp_path / "CURRENT"]
    assert {p.name for p in targets} == {"__0_0.distcp", ".metadata", "MANIFEST.json",
                                         "CURRENT"}
    rng = random.Random(20)
    for flip in range(50):
        path = targets[flip % len(targets)]
        data = bytearray(path.read_bytes())
        offset = rng.randrange(len(data))
        original = data[offset]
        data[offset] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(data))
        try:
            with pytest.raises(CheckpointError) as info:
                if flip % 5 == 4:
                    tbd.distributed_to_single_file(tmp_path, tmp_path / "one.pt")
                else:
                    tbd.load_distributed_checkpoint(worker.make_model(), tmp_path,
                                                    worker.make_optimizer(
                                                        worker.make_model().parameters()))
            assert path.name in str(info.value), (flip, offset, str(info.value))
        finally:
            data[offset] = original
            path.write_bytes(bytes(data))
    assert_state(loaded(tmp_path), model.state_dict())
    assert not (tmp_path / "one.pt").exists()


def test_files_of_two_versions_mixed_are_refused(tmp_path: Path) -> None:
    tbd.save_distributed_checkpoint(trained(0)[0], tmp_path, keep_last=2)
    old = current(tmp_path)
    tbd.save_distributed_checkpoint(trained(1)[0], tmp_path, keep_last=2)
    new = current(tmp_path)
    shutil.copy(old / "__0_0.distcp", new / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is damaged or from another"):
        loaded(tmp_path)
    shutil.copy(old / "__0_0.distcp", new / "__1_0.distcp")  # and an extra file
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp, which its manifest does not"):
        loaded(tmp_path)
    # the whole old version's manifest under the new name: the version is checked too
    for name in ("__0_0.distcp", ".metadata", "MANIFEST.json"):
        shutil.copy(old / name, new / name)
    (new / "__1_0.distcp").unlink()
    rewrite_manifest(tmp_path)
    with pytest.raises(CheckpointError, match=r"MANIFEST\.json belongs to version"):
        loaded(tmp_path)
    (old / ".metadata").unlink()
    (tmp_path / "CURRENT").write_text(f"{old.name} {'0' * 64}\n")
    with pytest.raises(CheckpointError, match=r"MANIFEST\.json is damaged or replaced"):
        loaded(tmp_path)


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    tbd.save_distributed_checkpoint(trained()[0], tmp_path)
    (current(tmp_path) / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is missing"):
        loaded(tmp_path)


def test_keep_last_keeps_the_newest_versions(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="keep_last=0 must be a positive"):
        tbd.save_distributed_checkpoint(nn.Linear(2, 2), tmp_path, keep_last=0)
    (tmp_path / "v000000-deadbeef").mkdir()  # an unpublished save that was killed
    states = []
    for step in range(4):
        model = trained(step)[0]
        states.append(model.state_dict())
        tbd.save_distributed_checkpoint(model, tmp_path, keep_last=2)
        versions = sorted(p.name for p in tmp_path.glob("v*"))
        assert len(versions) == min(step + 1, 2)
        assert versions[-1] == current(tmp_path).name
    assert_state(loaded(tmp_path), states[-1])
    assert_state(loaded(tmp_path / versions[0]), states[-2])  # a version folder loads too
    with pytest.raises(CheckpointError, match="is one version of a distributed checkpoint"):
        tbd.save_distributed_checkpoint(trained(4)[0], tmp_path / versions[0])
    tbd.save_distributed_checkpoint(trained(5)[0], tmp_path, keep_last=None)
    tbd.save_distributed_checkpoint(trained(6)[0], tmp_path, keep_last=None)
    assert len(list(tmp_path.glob("v*"))) == 4
    tbd.save_distributed_checkpoint(trained(7)[0], tmp_path)  # default: only the newest
    assert [p.name for p in tmp_path.glob("v*")] == [current(tmp_path).name]


def test_planted_symlinks_are_not_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text("precious")
    # a previous release's layout whose files are links, a planted pointer and version
    (root / "__0_0.distcp").symlink_to(victim)
    (root / ".metadata").symlink_to(victim)
    (root / "CURRENT").symlink_to(victim)
    (root / "v000001-00000000").symlink_to(outside, target_is_directory=True)
    model = trained()[0]
    tbd.save_distributed_checkpoint(model, root)
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]
    assert not (root / "CURRENT").is_symlink()
    assert (root / "v000001-00000000").is_symlink()  # left alone, not removed through
    assert_state(loaded(root), model.state_dict())
    # a link planted into the published version is refused on load
    version = current(root)
    (version / "__0_0.distcp").unlink()
    (version / "__0_0.distcp").symlink_to(victim)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp"):
        loaded(root)
    assert victim.read_text() == "precious"


if __name__ == "__main__":
    _worker_main()
