"""``python -m dfpo_trl.cli RECIPE.yaml [--field value ...]``: the ``dfpo-train`` program (the same as
``python -m dfpo_trl``)."""

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
