"""``jaxmoe config``: the configuration a command line names, printed as a configuration file.

    jaxmoe config --preset mixtral-tiny > mixtral.toml    # every field of the preset
    jaxmoe train --config mixtral.toml --out runs/m       # edited, and trained

takes the flags of ``jaxmoe train`` (``--preset``, ``--config``, ``--SECTION.FIELD``)
and prints the configuration they resolve to, every field, as TOML
(:mod:`jaxmoe.config.files`): a file that repeats it whatever the defaults become. No
JAX, no devices.
"""

from __future__ import annotations

import argparse
import shlex

from jaxmoe.config import Config
from jaxmoe.config.config import config_sections
from jaxmoe.config.files import to_toml


def run(config: Config, args: argparse.Namespace) -> int:
    header = (
        f"jaxmoe {shlex.join(args.argv)}\n"
        "Every field of the configuration; train it with jaxmoe train --config FILE."
    )
    # Read back as a file is, the fields the run fills in are left out.
    print(to_toml(config_sections(config.to_dict()), header), end="")
    return 0
