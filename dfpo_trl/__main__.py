"""``python -m dfpo_trl RECIPE.yaml [--field value ...]``, also under ``accelerate launch -m dfpo_trl``: the
``dfpo-train`` program (``dfpo_trl.cli``), kept at the package's root so that the launch lines users have keep working.
"""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
