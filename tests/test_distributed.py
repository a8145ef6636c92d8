"""Distributed training on torch.distributed: initialize() with and without torchrun, the
launcher, prepare_model(distributed=...), distributed checkpoints. The multi-process tests
start `torchbridge launch --nproc-per-node 2` over tests/distributed_worker.py with the
gloo backend on this CPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torchbridge
import torchbridge.distributed as tbd
from torch import nn
from torchbridge import DistributedError, TorchBridgeError
from torchbridge.distributed.context import DistributedContext, read_launch_env
from torchbridge.distributed.launch import resolve_nproc
from torchbridge.distributed.runtime import process_group_spec
from torchbridge.distributed.strategies import unsupported_reason

sys.path.insert(0, str(Path(__file__).parent))
import distributed_worker as worker
from hang_bounds import HANG_S

WORKER = Path(__file__).parent / "distributed_worker.py"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts outside any launcher and leaves no process group behind."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    tbd.destroy()
    assert not dist.is_initialized()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher_env(**values: object) -> dict[str, str]:
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    env.update({k: str(v) for k, v in values.items() if v is not None})
    return {k: v for k, v in env.items() if values.get(k, "") is not None}


# -- initialize() ----------------------------------------------------------------------------

def test_initialize_without_torchrun_is_a_one_process_group() -> None:
    ctx = tbd.initialize()
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.launched) == (0, 0, 1, False)
    assert ctx.device == torch.device("cpu") and ctx.backend.name == "cpu"
    assert ctx.process_group_backend == "gloo" and ctx.cpu_process_group_backend is None
    assert dist.is_initialized() and dist.get_world_size() == 1
    total = torch.tensor([3.0])
    dist.all_reduce(total)  # a real collective on the one-process group
    assert total.item() == 3.0
    assert tbd.initialize() is ctx  # idempotent
    assert tbd.initialize("cpu") is ctx
    with pytest.raises(DistributedError, match="already initialized on backend 'cpu'"):
        tbd.initialize("example")
    tbd.destroy()
    assert not dist.is_initialized() and tbd.current_context() is None
    tbd.destroy()  # twice is fine


def test_initialize_reads_the_launcher_env_and_binds_local_rank_modulo_devices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The example backend has two devices: local rank 3 runs on its device 1.
    for name, value in launcher_env(LOCAL_RANK=3).items():
        monkeypatch.setenv(name, value)
    ctx = tbd.initialize("example", timeout=30)
    assert ctx.launched and ctx.world_size == 1 and ctx.local_rank == 3
    assert ctx.backend.name == "example" and ctx.backend.hook_device() == torch.device("cpu", 1)
    assert ctx.backend.get_device_info().name == "Example Accelerator #1"


@pytest.mark.parametrize(("values", "message"), [
    ({"MASTER_PORT": None}, "MASTER_PORT not set"),
    ({"RANK": None, "MASTER_ADDR": None}, "RANK, MASTER_ADDR not set"),
    ({"RANK": "one"}, "RANK='one' is not an integer"),
    ({"RANK": 2, "WORLD_SIZE": 2}, r"RANK=2 must be in \[0, WORLD_SIZE=2\)"),
    ({"WORLD_SIZE": 0}, "WORLD_SIZE=0 must be at least 1"),
    ({"LOCAL_RANK": 2, "LOCAL_WORLD_SIZE": 2}, "LOCAL_RANK=2 must be in"),
    ({"WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 4}, "LOCAL_WORLD_SIZE=4 must be in"),
    ({"MASTER_PORT": 70000}, "MASTER_PORT=70000 is not a TCP port"),
])
def test_missing_or_inconsistent_launcher_env_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch, values: dict[str, object], message: str) -> None:
    for name, value in launcher_env(**values).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DistributedError, match=message) as info:
        tbd.initialize()
    assert isinstance(info.value, TorchBridgeError)
    assert not dist.is_initialized() and tbd.current_context() is None  # nothing half-done


def test_a_process_group_started_elsewhere_is_adopted_and_left_alone() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ctx = tbd.initialize()
        assert not ctx.owns_group and ctx.world_size == 1 and ctx.process_group_backend \
            == "gloo"
        tbd.destroy()
        assert dist.is_initialized()  # not ours to destroy
    finally:
        dist.destroy_process_group()


def test_no_launcher_variables_means_no_launcher() -> None:
    assert read_launch_env({"MASTER_ADDR": "x", "MASTER_PORT": "1"}) is None


def test_bad_timeout_is_refused_before_anything_starts() -> None:
    with pytest.raises(DistributedError, match="timeout must be a positive number"):
        tbd.initialize(timeout=-1)
    assert not dist.is_initialized()


def test_process_group_backend_gains_gloo_where_it_cannot_carry_cpu_tensors() -> None:
    assert process_group_spec("nccl", "cuda") == ("cuda:nccl,cpu:gloo", "gloo")
    assert process_group_spec("xccl", "xpu") == ("xpu:xccl,cpu:gloo", "gloo")
    assert process_group_spec("gloo", "cpu") == ("gloo", None)
    with pytest.raises(DistributedError, match="no process-group backend 'acmeccl'"):
        process_group_spec("acmeccl", "cuda")


# -- prepare_model(distributed=...) ----------------------------------------------------------

def test_prepare_model_distributed_needs_initialize_and_a_known_strategy() -> None:
    backend = torchbridge.get_backend("cpu")
    model = nn.Linear(4, 2)
    with pytest.raises(DistributedError, match=r"call torchbridge\.distributed\.initialize"):
        backend.prepare_model(model, "O0", distributed="ddp")
    tbd.initialize()
    with pytest.raises(DistributedError, match="must be one of ddp, fsdp"):
        backend.prepare_model(model, "O0", distributed="zero3")
    with pytest.raises(DistributedError, match="prepare it through the context's backend"):
        torchbridge.get_backend("example").prepare_model(model, "O0", distributed="ddp")


def test_fsdp_where_torch_cannot_run_it_is_refused_with_the_reason() -> None:
    ctx = tbd.initialize()
    xla = DistributedContext(0, 0, 1, 1, torch.device("xla", 0), ctx.backend, "xla", "gloo",
                             launched=False, owns_group=False)
    assert "torch_xla shards through SPMD" in (unsupported_reason("fsdp", xla) or "")
    assert unsupported_reason("ddp", xla) is None
    assert unsupported_reason("fsdp", ctx) is None  # FSDP2 runs on CPU with gloo


@pytest.mark.slow
def test_ddp_at_O2_wraps_outside_autocast_and_compile_and_trains() -> None:
    ctx = tbd.initialize()
    model = worker.make_model()
    prepared = ctx.backend.prepare_model(model, "O2", distributed="ddp")
    report = torchbridge.optimization_result(prepared)
    assert report is not None
    applied = report.optimizations_applied
    assert applied[-1] == "ddp" and applied.index("autocast") < applied.index("compile")
    assert isinstance(prepared, nn.parallel.DistributedDataParallel)
    # DDP around the compiled model: the user's module, its forward compiled in place
    assert type(prepared.module) is type(model) and "forward" in vars(prepared.module)
    assert tbd.user_module(prepared).state_dict().keys() == model.state_dict().keys()
    optimizer = worker.make_optimizer(prepared.parameters())
    x, y = worker.global_batch()
    before = {k: v.clone() for k, v in tbd.user_module(prepared).state_dict().items()}
    worker.train(prepared, optimizer, x, y, steps=2)
    after = tbd.user_module(prepared).state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)
    assert prepared(x).dtype == torch.float32


def test_save_checkpoint_of_a_ddp_model_saves_the_users_keys(tmp_path: Path) -> None:
    """DDP's "module." prefix is not the model's: a checkpoint loads into the model as
    built."""
    ctx = tbd.initialize()
    model = worker.make_model()
    prepared = ctx.backend.prepare_model(model, "O1", distributed="ddp")
    assert isinstance(prepared, nn.parallel.DistributedDataParallel)
    torchbridge.save_checkpoint(prepared, tmp_path / "model.pt")
    state = torchbridge.load_checkpoint(tmp_path / "model.pt")
    assert state.keys() == model.state_dict().keys()
    worker.make_model().load_state_dict(state)


# -- torchbridge launch ----------------------------------------------------------------------

def launch(tmp_path: Path, *args: str, timeout: float = HANG_S
           ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHBRIDGE_") and k not in LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "torchbridge", "launch", "--standalone",
                           *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def reference_training() -> tuple[dict[str, torch.Tensor], torch.optim.Optimizer]:
    """One process, the whole global batch: what two ranks on half each must reproduce."""
    model = worker.make_model()
    optimizer = worker.make_optimizer(model.parameters())
    x, y = worker.global_batch()
    worker.train(model, optimizer, x, y, steps=3)
    return model.state_dict(), optimizer


def assert_matches(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert state.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(state[key], reference[key], rtol=1e-5, atol=1e-6)


def rank_outputs(out: Path, world_size: int) -> list[tuple[dict[str, torch.Tensor], dict]]:
    return [(torch.load(out / f"rank{r}.pt"), json.loads((out / f"rank{r}.json").read_text()))
            for r in range(world_size)]


@pytest.mark.slow
def test_launch_ddp_on_two_ranks_equals_one_process_on_the_global_batch(tmp_path: Path
                                                                        ) -> None:
    done = launch(tmp_path, "--nproc-per-node", "2", "--backend", "cpu", str(WORKER),
                  "--strategy", "ddp", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    (state0, info0), (state1, info1) = rank_outputs(tmp_path, 2)
    for key in state0:  # every rank holds the same parameters, bit for bit
        assert torch.equal(state0[key], state1[key]), key
    reference, _ = reference_training()
    assert_matches(state0, reference)
    assert [info0["rank"], info1["rank"]] == [0, 1]
    assert info0["world_size"] == 2 and info0["launched"] and info0["process_group_backend"] \
        == "gloo"
    assert info0["wrapper"] == "DistributedDataParallel" and info0["applied"][-1] == "ddp"


@pytest.mark.slow
def test_launch_fsdp_on_two_ranks_and_its_checkpoint_loads_in_one_process(tmp_path: Path
                                                                          ) -> None:
    checkpoint = tmp_path / "ckpt"
    done = launch(tmp_path, "--nproc-per-node", "2", "--backend", "cpu", str(WORKER),
                  "--strategy", "fsdp", "--out", str(tmp_path), "--checkpoint",
                  str(checkpoint))
    assert done.returncode == 0, done.stderr[-3000:]
    (state0, info0), (state1, _) = rank_outputs(tmp_path, 2)
    assert info0["wrapper"] == "FSDPBlockNet" and info0["applied"][-1] == "fsdp"
    for key in state0:
        assert torch.equal(state0[key], state1[key]), key
    reference, reference_optimizer = reference_training()
    assert_matches(state0, reference)
    # Each rank wrote its own shards into the version CURRENT names ...
    version = checkpoint / (checkpoint / "CURRENT").read_text().split()[0]
    assert sorted(p.name for p in version.glob("*.distcp")) == ["__0_0.distcp",
                                                                "__1_0.distcp"]
    # ... and one process without a process group loads them, optimizer state included.
    model = worker.make_model()
    optimizer = worker.make_optimizer(model.parameters())
    tbd.load_distributed_checkpoint(model, checkpoint, optimizer)
    assert not dist.is_initialized()
    assert_matches(model.state_dict(), reference)
    for index, state in reference_optimizer.state_dict()["state"].items():
        torch.testing.assert_close(optimizer.state_dict()["state"][index]["momentum_buffer"],
                                   state["momentum_buffer"], rtol=1e-5, atol=1e-6)
    # To the single file load_checkpoint reads, and back.
    single = tbd.distributed_to_single_file(checkpoint, tmp_path / "model.pt")
    assert_matches(torchbridge.load_checkpoint(single), reference)
    back = tbd.single_file_to_distributed(single, tmp_path / "back")
    fresh = worker.make_model()
    tbd.load_distributed_checkpoint(fresh, back)
    assert_matches(fresh.state_dict(), reference)


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_launch_on_one_gpu_with_nccl_trains_as_one_process_does(tmp_path: Path,
                                                                 strategy: str) -> None:
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs a CUDA GPU and a torch with NCCL")
    checkpoint = tmp_path / "ckpt"
    done = launch(tmp_path, "--nproc-per-node", "1", "--backend", "cuda", str(WORKER),
                  "--strategy", strategy, "--out", str(tmp_path), "--checkpoint",
                  str(checkpoint))
    assert done.returncode == 0, done.stderr[-3000:]
    [(state, info)] = rank_outputs(tmp_path, 1)
    assert "nccl" in info["process_group_backend"] and info["device"].startswith("cuda")
    assert info["applied"][-1] == strategy
    reference, _ = reference_training()  # float32 on the CPU: GPU sums differ by rounding
    for key in reference:
        torch.testing.assert_close(state[key], reference[key], rtol=1e-4, atol=1e-5)
    model = worker.make_model()
    tbd.load_distributed_checkpoint(model, checkpoint)
    for key in reference:
        torch.testing.assert_close(model.state_dict()[key], state[key], rtol=0, atol=0)


@pytest.mark.slow
def test_launch_auto_starts_one_process_per_device_and_reports_a_failing_worker(
        tmp_path: Path) -> None:
    script = tmp_path / "auto.py"
    script.write_text(
        "import json, os, sys\n"
        "import torchbridge.distributed as tbd\n"
        "ctx = tbd.initialize()\n"
        "json.dump({'world': ctx.world_size, 'backend': ctx.backend.name,\n"
        "           'device': str(ctx.backend.hook_device())},\n"
        "          open(f'auto{ctx.rank}.json', 'w'))\n"
        "tbd.destroy()\n"
        "if ctx.rank == 1:\n"
        "    sys.exit('rank 1 fails on purpose')\n")
    # --backend example: a third-party backend with two devices, so auto means 2.
    done = launch(tmp_path, "--nproc-per-node", "auto", "--backend", "example", str(script))
    results = [json.loads((tmp_path / f"auto{r}.json").read_text()) for r in (0, 1)]
    assert results == [{"world": 2, "backend": "example", "device": f"cpu:{r}"}
                       for r in (0, 1)]
    assert done.returncode == 1
    assert "auto.py FAILED" in done.stderr and "rank      : 1" in done.stderr


def test_auto_nproc_is_the_backend_device_count() -> None:
    assert resolve_nproc("auto", "example") == "2"
    assert resolve_nproc("auto", "cpu") == "1"
    assert resolve_nproc("3", None) == "3"


def test_launch_help_shows_torchrun_options_passed_through(
        capsys: pytest.CaptureFixture[str]) -> None:
    from torchbridge.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["launch", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "torchbridge launch" in text
    for option in ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend",
                   "--backend"):
        assert option in text
