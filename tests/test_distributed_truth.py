"""prepare_model(distributed=...) and checkpoints say what every rank holds: rank 0's weights
before the passes (O3 freezes what it sees), one model on every rank or an error on every
rank, rank 0's timing decision kept everywhere, no first-call timing that can never run,
single-file checkpoints of rank 0's DDP model written once and of FSDP shards refused, and
distributed checkpoints holding rank 0's buffers. Run as a script, this file is the 2-rank
gloo worker; the tests start it without torchrun, as tests/test_distributed_checkpoint_trust
does. Timings are injected (fastest.default_timer), never measured."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torchbridge
import torchbridge.distributed as tbd
from torch import nn
from torchbridge import CheckpointError

sys.path.insert(0, str(Path(__file__).parent))
from hang_bounds import HANG_S

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))


def batchnorm_net() -> nn.Module:
    # Several BatchNorms: DCP picks the rank that saves a replicated tensor per tensor.
    return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
                           for _ in range(4)])


class Centered(nn.Module):
    """Its output is small against its input's offset: bf16 autocast drifts past O2's
    tolerance on inputs far from zero, and not on centred ones."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.out(h - h.mean(0, keepdim=True))


Timer = Callable[[str, Callable[[], Any]], float]


def timer_by_label(seconds: dict[str, float]) -> Callable[[Callable[[], None]], Timer]:
    """A fastest.default_timer that answers by candidate (tests/conftest.py's way)."""
    def make(synchronize: Callable[[], None]) -> Timer:
        def time_call(label: str, fn: Callable[[], Any]) -> float:
            fn()
            return seconds[label]
        return time_call
    return make


PREPARED_FASTEST = {"prepared": 1.0, "uncompiled": 2.0, "O0": 3.0}
O0_FASTEST = {"O0": 1.0, "uncompiled": 2.0, "prepared": 3.0}


# -- the worker ------------------------------------------------------------------------------

def _error(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _prepare_scenarios(ctx: Any, strategy: str, found: dict[str, Any]) -> None:
    from torchbridge.optimize import fastest

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))  # the same everywhere
    # O3, each rank its own initial weights (as with no seed): every rank must compute
    # with rank 0's, also where inductor froze the weights into the graph.
    fastest.default_timer = timer_by_label(PREPARED_FASTEST)
    torch.manual_seed(100 + ctx.rank)
    prepared = ctx.backend.prepare_model(mlp().eval(), "O3", sample_input=x,
                                         distributed=strategy)
    with torch.no_grad():
        out = prepared(x).float()
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).float()
                 for k, v in tbd.user_module(prepared).state_dict().items()}
        plain = mlp()
        plain.load_state_dict(state)
        found["o3"] = {"applied": torchbridge.optimization_result(prepared)
                       .optimizations_applied,
                       "off_own_weights": (out - plain(x)).abs().max().item(),
                       "out": out.tolist(), "weight": state["0.weight"].tolist()}
    del prepared
    # A timing that differs per rank (a neighbour's stall on one core): O0 on rank 1.
    fastest.default_timer = timer_by_label(PREPARED_FASTEST if ctx.rank == 0 else O0_FASTEST)
    torch.manual_seed(0)
    prepared = ctx.backend.prepare_model(mlp().eval(), "O2", sample_input=x,
                                         distributed=strategy)
    report = torchbridge.optimization_result(prepared)
    found["race"] = {"applied": report.optimizations_applied, "notes": report.notes,
                     "dtypes": sorted({str(p.dtype) for p in prepared.parameters()})}
    del prepared
    if strategy != "ddp":
        return
    # Each rank its own batch as sample_input: far from zero on rank 1 only, where
    # autocast's check fails. Training mode: nothing is timed.
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(ctx.rank)
    batch = torch.randn(32, 16, generator=generator) * (0.1 if ctx.rank else 1.0) \
        + (50.0 if ctx.rank else 0.0)
    found["split"] = _error(lambda: ctx.backend.prepare_model(
        Centered(), "O2", sample_input=batch, distributed="ddp"))
    # Another shape on rank 1: nothing to broadcast rank 0's weights into.
    found["shapes"] = _error(lambda: ctx.backend.prepare_model(
        nn.Linear(4, 4 + ctx.rank), "O0", distributed="ddp"))
    found["setting"] = _setting_left_after_a_failure(ctx, x)
    # strict: the check fails on rank 1 alone. Last: on a rank that raises alone, the
    # others are left in DDP's constructor.
    found["strict"] = _error(lambda: ctx.backend.prepare_model(
        Centered(), "O2", sample_input=batch, distributed="ddp", strict=True))


def _setting_left_after_a_failure(ctx: Any, x: torch.Tensor) -> dict[str, Any]:
    """inplace=True, a pass sets a process-wide setting on every rank, another fails on
    rank 1 (strict): every rank raises; rank 0, whose own run succeeded, puts the setting
    back, and every rank's model is as it was given."""
    from torchbridge.optimize.settings import environment_setting

    variable = "TB_TEST_PROCESS_SETTING"
    setting = environment_setting(variable, "read once by the whole process")

    def sets(m: nn.Module, c: Any) -> nn.Module:
        os.environ[variable] = "on"
        return m

    def fails_on_rank1(m: nn.Module, c: Any) -> nn.Module:
        if ctx.rank == 1:
            raise RuntimeError("rank 1's own failure")
        return m

    class Plugin:
        @torchbridge.hookimpl
        def torchbridge_optimization_passes(self, backend: Any, level: Any) -> list[Any]:
            o1 = torchbridge.OptimizationLevel.O1
            return [torchbridge.OptimizationPass("sets_setting", "sets a process setting",
                                                 o1, sets, settings=(setting,), order=56),
                    torchbridge.OptimizationPass("fails_on_rank1", "fails on rank 1", o1,
                                                 fails_on_rank1, order=57)]

    torch.manual_seed(200 + ctx.rank)  # each rank its own weights, until the broadcast
    model = mlp().eval()
    own = {k: v.clone() for k, v in model.state_dict().items()}
    torchbridge.register_plugin(Plugin(), name="settings_on_two_ranks")
    try:
        error = _error(lambda: ctx.backend.prepare_model(
            model, "O2", sample_input=x, distributed="ddp", strict=True, inplace=True))
    finally:
        torchbridge.unregister_plugin("settings_on_two_ranks")
    now = model.state_dict()
    return {"error": error, "left": os.environ.get(variable),
            "own_weights": list(now) == list(own)
            and all(torch.equal(now[k], v) for k, v in own.items()),
            "own_forward": not any("forward" in m.__dict__ for m in model.modules())}


def _checkpoint_scenarios(ctx: Any, strategy: str, out: Path, found: dict[str, Any]) -> None:
    import torchbridge.checkpoint as single

    torch.manual_seed(0)
    prepared = ctx.backend.prepare_model(batchnorm_net(), "O0", distributed=strategy)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(ctx.rank))
    prepared(x * (1 + 9 * ctx.rank) + 5 * ctx.rank).sum().backward()  # its own running stats
    inner = tbd.user_module(prepared)
    found["buffers"] = {k: v.tolist() for k, v in inner.state_dict().items()
                        if k.endswith("running_mean")}
    writes = []
    original = single.write_atomically

    def counted(*args: Any, **kwargs: Any) -> Any:
        writes.append(1)
        return original(*args, **kwargs)

    single.write_atomically = counted
    found["single"] = _error(lambda: torchbridge.save_checkpoint(prepared,
                                                                 out / "single.pt"))
    single.write_atomically = original
    found["single_writes"] = len(writes)
    tbd.save_distributed_checkpoint(prepared, out / "dist")


def _worker_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    ctx = tbd.initialize(timeout=HANG_S)  # a rank slow to start on a busy machine is waited for
    found: dict[str, Any] = {}
    try:
        if args.scenario == "prepare":
            _prepare_scenarios(ctx, args.strategy, found)
        else:
            _checkpoint_scenarios(ctx, args.strategy, out, found)
    finally:
        (out / f"rank{ctx.rank}.json").write_text(json.dumps(found))
    # An error every rank raised leaves the ranks in step; one rank's error alone does not
    # (the other waits in DDP's constructor until this one leaves).
    if not str(found.get("strict", "DistributedError")).startswith("DistributedError"):
        os._exit(0)
    ctx.barrier()
    os._exit(0)  # gloo's threads at exit: distributed.md, "A known torch problem at exit"


# -- the tests -------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def two_ranks(out: Path, scenario: str, strategy: str) -> list[dict[str, Any]]:
    """Start this file as 2 gloo ranks; each rank's findings."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = {k: v for k, v in os.environ.items()
            if k not in LAUNCH_VARS and not k.startswith("TORCHBRIDGE_")}
    ranks = []
    for rank in (0, 1):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "TORCHBRIDGE_BACKEND": "cpu"}
        ranks.append(subprocess.Popen([sys.executable, __file__, "--scenario", scenario,
                                       "--strategy", strategy, "--out", str(out)], env=env,
                                      cwd=out, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for process in ranks:  # the time limit catches a hang only
            logs.append(process.communicate(timeout=HANG_S)[0])
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait()
    found = []
    for rank in (0, 1):
        path = out / f"rank{rank}.json"
        assert path.exists(), logs[rank][-3000:] if rank < len(logs) else ""
        found.append(json.loads(path.read_text()))
    return found


@pytest.fixture(scope="module")
def prepared_on_two_ranks(tmp_path_factory: pytest.TempPathFactory
                          ) -> Callable[[str], list[dict[str, Any]]]:
    """The prepare scenarios, run once per strategy for the tests that read them."""
    runs: dict[str, list[dict[str, Any]]] = {}

    def get(strategy: str) -> list[dict[str, Any]]:
        if strategy not in runs:
            runs[strategy] = two_ranks(tmp_path_factory.mktemp(f"prepare_{strategy}"),
                                       "prepare", strategy)
        return runs[strategy]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_o3_every_rank_computes_with_rank0_weights(
        prepared_on_two_ranks: Callable[[str], list[dict[str, Any]]], strategy: str) -> None:
    """Rank 0's weights are broadcast before the passes: inductor's freezing compiled rank
    1's own weights into its graph, while its parameters held rank 0's (0.54 off)."""
    found = [rank["o3"] for rank in prepared_on_two_ranks(strategy)]
    assert all("inference_freezing" in f["applied"] for f in found)
    assert found[0]["weight"] == found[1]["weight"]
    for f in found:  # what the parameters compute, within bf16's rounding
        assert f["off_own_weights"] < 0.02, f["off_own_weights"]
    assert found[0]["out"] == found[1]["out"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_rank_keeps_what_rank0_timings_chose(
        prepared_on_two_ranks: Callable[[str], list[dict[str, Any]]], strategy: str) -> None:
    """Rank 1 timed O0 fastest, rank 0 the prepared model: both keep the prepared model."""
    zero, one = (rank["race"] for rank in prepared_on_two_ranks(strategy))
    assert "autocast" in zero["applied"] and "compile" in zero["applied"]
    assert one["applied"] == zero["applied"] and one["dtypes"] == zero["dtypes"]
    assert any("rank 1 kept what rank 0's timings chose" in note for note in one["notes"])


@pytest.mark.slow
def test_ranks_that_keep_different_passes_raise_on_every_rank_naming_them(
        prepared_on_two_ranks: Callable[[str], list[dict[str, Any]]]) -> None:
    """Each rank's own batch as sample_input: autocast fails its check on rank 1 only."""
    errors = [rank["split"] for rank in prepared_on_two_ranks("ddp")]
    assert errors[0] == errors[1]
    error = errors[0]
    assert error is not None and error.startswith("DistributedError")
    assert "rank 0 kept device_placement, autocast" in error
    assert "rank 1 kept device_placement, compile" in error
    assert "autocast on rank 1: failed: output drift" in error
    assert "pass the same sample_input on every rank" in error


@pytest.mark.slow
def test_ranks_given_different_models_raise_on_every_rank(
        prepared_on_two_ranks: Callable[[str], list[dict[str, Any]]]) -> None:
    errors = [rank["shapes"] for rank in prepared_on_two_ranks("ddp")]
    assert errors[0] == errors[1]
    assert errors[0] is not None and errors[0].startswith("DistributedError")
    assert "the ranks were given different models (parameter or buffer #0 is (4, 4) " \
        "float32 on rank 0, (5, 4) float32 on rank 1)" in errors[0]


@pytest.mark.slow
def test_a_pass_failing_on_one_rank_raises_on_every_rank_naming_it(
        prepared_on_two_ranks: Callable[[str], list[dict[str, Any]]]) -> None:
    """strict=True: rank 1's failure reached rank 0 as "Connection closed by peer"."""
    errors = [rank["strict"] for rank in prepared_on_two_ranks("ddp")]
    assert errors[0] == errors[1]
    error = errors[0]
    assert error is not None and error.startswith("DistributedError")
    assert "failed on rank 1: ModelOptimizationError: pass 'autocast'" in error
    assert "rank 0:" not in error


@pytest.mark.slow
def test_a_failure_on_one_rank_leaves_every_rank_as_it_was(
        prepared_on_two_ranks: Callable[[str], list[dict[str, Any]]]) -> None:
    """inplace=True: rank 0's run succeeded and set a process-wide setting; rank 1's
    failed. Before: rank 0 raised the DistributedError with the setting left changed and
    its model prepared (autocast's forward), and rank 1's model held rank 0's weights."""
    zero, one = (rank["setting"] for rank in prepared_on_two_ranks("ddp"))
    assert zero["error"] == one["error"]
    assert zero["error"].startswith("DistributedError")
    assert "rank 1: ModelOptimizationError" in zero["error"]
    assert (zero["left"], one["left"]) == (None, None), (zero, one)
    assert zero["own_weights"] and one["own_weights"]
    assert zero["own_forward"] and one["own_forward"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_checkpoints_hold_rank0s_model(tmp_path: Path, strategy: str) -> None:
    """Buffers differ per rank (BatchNorm after each rank's batch): a distributed checkpoint
    holds rank 0's, not a mix; a single file of a DDP model is written once, by rank 0;
    of an FSDP model it is refused on every rank."""
    found = two_ranks(tmp_path, "checkpoints", strategy)
    rank0 = found[0]["buffers"]
    assert rank0 != found[1]["buffers"]
    single = tmp_path / "single.pt"
    if strategy == "ddp":
        assert [f["single"] for f in found] == [None, None]
        assert [f["single_writes"] for f in found] == [1, 0]
        state = torchbridge.load_checkpoint(single)
        assert {k: state[k].tolist() for k in rank0} == rank0
    else:
        for f in found:
            assert f["single"].startswith("CheckpointError") and "is a DTensor" in f["single"]
            assert "save_distributed_checkpoint" in f["single"]
        assert not single.exists()
    tbd.distributed_to_single_file(tmp_path / "dist", tmp_path / "converted.pt")
    state = torchbridge.load_checkpoint(tmp_path / "converted.pt")
    assert {k: state[k].tolist() for k in rank0} == rank0


# -- one process -----------------------------------------------------------------------------

@pytest.fixture
def one_process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    ctx = tbd.initialize()
    yield ctx
    tbd.destroy()


@pytest.mark.slow
def test_no_first_call_timing_is_promised_under_a_wrapper(one_process_group: Any) -> None:
    """The wrapper changes the model after prepare_model: the first call would refuse to
    time it ("changed since prepare_model"), so no timing is installed, and the report
    says why."""
    ctx = one_process_group
    prepared = ctx.backend.prepare_model(mlp().eval(), "O2", distributed="ddp")
    with torch.no_grad():
        prepared(torch.randn(2, 16))
    notes = torchbridge.optimization_result(prepared).notes
    assert any("the first call is not timed under ddp" in note for note in notes), notes
    assert not any("first call in eval mode times" in note or "changed since" in note
                   for note in notes), notes


def test_a_sharded_state_is_refused_on_save_and_on_load(one_process_group: Any,
                                                        tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    state = {"steps": torch.zeros(()), "w": distribute_tensor(torch.ones(4, 2), mesh,
                                                              [Shard(0)])}
    with pytest.raises(CheckpointError, match=r"w is a DTensor, this rank's shard.*"
                       r"save_distributed_checkpoint"):
        torchbridge.save_checkpoint(state, tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()
    torch.save(state, tmp_path / "old.pt")  # as save_checkpoint wrote it before
    for weights_only in (True, False):
        with pytest.raises(CheckpointError, match=r"holds DTensors.*one rank's shards"):
            torchbridge.load_checkpoint(tmp_path / "old.pt", weights_only=weights_only)


if __name__ == "__main__":
    _worker_main()
