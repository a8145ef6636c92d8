"""The Lightning accelerator: `Trainer(accelerator="torchbridge")` trains through the backend
TorchBridge selects; device parsing and memory stats come from the backend. Skipped where
Lightning is not installed (it is an optional dependency)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hang_bounds import HANG_S
from torch import nn
from torchbridge import DeviceError

L = pytest.importorskip("lightning")

from torchbridge.integrations.lightning import (  # noqa: E402
    TorchBridgeAccelerator,
    parse_device_indices,
)


class Regressor(L.LightningModule):  # type: ignore[misc, name-defined]
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int
                      ) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_runs_on_the_torchbridge_accelerator() -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    module = Regressor()
    before = module.net.weight.detach().clone()
    trainer = L.Trainer(accelerator="torchbridge", devices=1, fast_dev_run=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert isinstance(trainer.accelerator, TorchBridgeAccelerator)
    assert trainer.global_step == 2
    assert not torch.equal(module.net.weight.detach(), before)  # it really trained
    assert trainer.strategy.root_device == torch.device("cpu")


class DtypeRecorder(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.dtype] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int
                      ) -> torch.Tensor:
        self.seen.append(self.net(batch[0]).dtype)
        return super().training_step(batch, index)


def test_mixed_precision_autocasts_on_the_backend_device() -> None:
    # Lightning autocasts mixed precision on "cuda" for an accelerator it does not know;
    # on this CPU that would silently compute in float32.
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    module = DtypeRecorder()
    trainer = L.Trainer(accelerator="torchbridge", devices=1, fast_dev_run=1,
                        precision="bf16-mixed", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    assert trainer.precision_plugin.device == "cpu"
    assert module.seen == [torch.bfloat16]


def test_registered_under_torchbridge() -> None:
    from lightning.pytorch.accelerators import AcceleratorRegistry

    assert "torchbridge" in AcceleratorRegistry.available_accelerators()
    assert isinstance(AcceleratorRegistry.get("torchbridge"), TorchBridgeAccelerator)


def test_device_parsing_follows_the_backend_device_count() -> None:
    example = TorchBridgeAccelerator.for_backend("example")  # a third-party, two devices
    assert example.auto_device_count() == 2
    assert example.parse_devices(-1) == [0, 1]
    assert example.parse_devices("1") == [0]
    assert example.parse_devices([1]) == [1]
    assert example.parse_devices("0,1") == [0, 1]
    assert example.get_parallel_devices([0, 1]) == [torch.device("cpu")] * 2
    with pytest.raises(DeviceError, match="the backend has 2 cuda device"):
        parse_device_indices(3, 2, "cuda")
    with pytest.raises(DeviceError, match="no device 2"):
        parse_device_indices([0, 2], 2, "cuda")
    with pytest.raises(DeviceError, match="names a device twice"):
        parse_device_indices([1, 1], 2, "cuda")
    with pytest.raises(DeviceError, match="at least one device"):
        parse_device_indices(0, 2, "cuda")
    with pytest.raises(DeviceError, match="expected a count"):
        parse_device_indices("two", 2, "cuda")
    # The host CPU runs N processes, as Lightning's CPU accelerator allows.
    assert parse_device_indices(3, 1, "cpu") == [0, 0, 0]


def test_unknown_backend_is_unavailable_not_an_exception() -> None:
    assert TorchBridgeAccelerator.for_backend("nosuch").is_available() is False
    assert TorchBridgeAccelerator.is_available() is True


def test_device_stats_are_the_backend_memory_stats_in_bytes() -> None:
    import torchbridge

    stats = TorchBridgeAccelerator().get_device_stats(torch.device("cpu"))
    expected = torchbridge.get_backend().get_memory_stats()
    assert stats["total_bytes"] == expected.total_bytes
    assert "allocated_bytes" not in stats  # unknowable on the CPU: left out, not 0
    example = TorchBridgeAccelerator.for_backend("example")()
    pretend = torchbridge.get_backend("example").get_memory_stats()
    assert example.get_device_stats("cpu") == {"free_bytes": pretend.free_bytes,
                                                "total_bytes": pretend.total_bytes}


LIGHTNING_SCRIPT = """
import sys
import lightning as L
import torch
import torchbridge.integrations.lightning  # registers "torchbridge"
sys.path.insert(0, {tests!r})
from test_distributed_lightning import Regressor

torch.manual_seed(0)
module = Regressor()
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g),
                                      torch.randn(16, 1, generator=g))
trainer = L.Trainer(accelerator="torchbridge", devices=2, strategy="ddp", max_steps=3,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
torch.save({{"world": trainer.world_size, "weight": module.net.weight.detach()}},
           f"rank{{trainer.global_rank}}.pt")
"""


@pytest.mark.slow
def test_lightning_ddp_on_two_ranks_under_torchbridge_launch(tmp_path: Path) -> None:
    script = tmp_path / "fit.py"
    script.write_text(LIGHTNING_SCRIPT.format(tests=str(Path(__file__).parent)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHBRIDGE_")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-m", "torchbridge", "launch", "--standalone",
                           "--nproc-per-node", "2", str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert rank0["world"] == rank1["world"] == 2
    assert torch.equal(rank0["weight"], rank1["weight"])  # gradients were all-reduced
    torch.manual_seed(0)
    assert not torch.equal(rank0["weight"], Regressor().net.weight.detach())
