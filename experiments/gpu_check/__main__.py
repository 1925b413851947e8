"""``python -m experiments.gpu_check``."""

import sys

from experiments.gpu_check import main

sys.exit(main())
