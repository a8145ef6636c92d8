"""config.hardware.tpu.topology against what the runtime reports.

- single: one host;
- pod: one slice spread over several hosts;
- superpod: several slices joined over the data-center network (Cloud TPU "Multislice"),
  which the runtime shows as more than one distinct "slice_index" among the device
  attributes (the attribute torch_xla's HybridMesh reads; torch_xla's test_xla_sharding.py
  mocks it for "2 slices of v4-8").

Hosts are counted by probe.xla_runtime (processes over processes per host), not by
`torch_xla.runtime.world_size()`: under torch_xla's multiprocessing that is the global
device count, above 1 on a single host.
"""

from __future__ import annotations

from typing import Any

TOPOLOGIES = ("single", "pod", "superpod")


def detected_topology(runtime: Any) -> str:
    """"single", "pod" or "superpod" from a probe.XlaRuntime."""
    slices = {a.get("slice_index", 0) for a in runtime.device_attributes
              if isinstance(a, dict)}
    if len(slices) > 1:
        return "superpod"
    return "pod" if runtime.host_count > 1 else "single"


def check_topology(configured: str | None, runtime: Any) -> tuple[str, str | None]:
    """(the runtime's topology, a note when config.hardware.tpu.topology says otherwise).
    The runtime wins: the setting states an expectation, which a launch on other hardware
    contradicts."""
    found = detected_topology(runtime)
    if configured in (None, "auto", found):
        return found, None
    return found, (f"hardware.tpu.topology={configured}, but the runtime reports {found} "
                   f"({runtime.host_count} host(s), world size {runtime.world_size}, "
                   f"{runtime.device_count} addressable device(s)); using what the runtime "
                   "reports")
