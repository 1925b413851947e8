"""``python -m jaxmoe.cli``: the ``jaxmoe`` command."""

import sys

from jaxmoe.cli.main import main

sys.exit(main())
