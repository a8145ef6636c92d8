"""`config.hardware.cpu`: the built-in CPU backend's section."""

from __future__ import annotations

from pydantic import Field, field_validator

from torchbridge.config import ConfigSection, not_a_bool

MAX_THREADS = 4096


class CPUConfig(ConfigSection):
    """`config.hardware.cpu`, the built-in CPU backend's section."""

    # torch.set_num_threads takes a C int and OpenMP starts that many threads: far past
    # any machine's core count it fails or thrashes, so the bound is a generous ceiling.
    num_threads: int | None = Field(default=None, ge=1, le=MAX_THREADS,
                                    description="torch intra-op threads (None: torch's "
                                    f"default; at most {MAX_THREADS})")
    _numbers = field_validator("num_threads", mode="before")(not_a_bool)
    allow_bf16: bool = Field(default=True,
                             description="use bf16 autocast at O2+ when the CPU has native bf16")
    # Off by default: measured 7-13% faster O3 calls on a 2-core AMD EPYC without AMX,
    # but 1-3 s more compiling (BERT's and ViT's first call went past 1.5x plain
    # compile's); slower on a 2-core Intel Xeon with AMX, whose bf16 flash kernel is fast
    # (benchmarks/cpu_attention.py, 2026-11-27: Llama 2.21x eager against 2.53x, GPT-2
    # 2.38x against 2.64x, BERT 2.25x against 2.74x, ViT 1.96x against 1.99x).
    bf16_matmul_attention: bool = Field(
        default=False, description="offer cpu_bf16_matmul_attention (bf16 matmuls, float32 "
        "softmax, fused by compile) to the kernel_substitution pass for bf16 attention")
    heap_reuse: bool = Field(
        default=True, description="at O2+, when the prepared model's calls on the sample "
        "input page-fault, set glibc's malloc thresholds so that freed buffers are reused "
        "(process-wide; backend.empty_cache() gives the kept memory back)")
    # None: prepack while float convolutions or linear layers remain (prepack.py has the
    # figures): calls 5-45% faster; the compiled graph stays cacheable across processes
    # (optimize/inductor_backend.py).
    weight_prepack: bool | None = Field(
        default=None, description="at O3, inductor freezing prepacks weights for oneDNN "
        "(faster calls). None: while the model has float convolution or linear layers; "
        "False: never")
