"""prepare_model benchmark; the same as `torchbridge bench`.

    python benchmarks/prepare_model.py [--models mlp convnet] [--json] [--plot chart.png]
"""

import sys

from torchbridge.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
