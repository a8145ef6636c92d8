import sys

from torchbridge.cli import main

sys.exit(main())
