"""generate() tokens per second on the hf suite's decoders: eager fp32 against prepare_model
at O3 (the prompt as sample input). The same measurement `torchbridge bench --suite hf`
makes after each decoder's rows, on its own.

    python benchmarks/hf_generate.py [--json]
"""

import json
import sys

import torchbridge
from torchbridge import bench
from torchbridge.hf_models import hf_reference_models

backend = torchbridge.get_backend()
results = [bench.generate_speed(backend, ref.name, ref.build(),
                                ref.make_input(1)["input_ids"][:, :16])
           for ref in hf_reference_models() if ref.is_decoder]
if "--json" in sys.argv:
    print(json.dumps(results, indent=1))
else:
    print(bench.render({"backend": backend.name, "device": "", "torch": "", "threads": 0,
                        "matmul_peak_tflops": {}, "rows": [], "generation": results}))
