"""``python -m overlapc ...`` (and ``torchrun ... -m overlapc calibrate``): the CLI."""

import sys

from .cli import main

sys.exit(main())
