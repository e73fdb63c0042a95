"""``python -m dfpo_trl RECIPE.yaml [--field value ...]``, also under ``accelerate launch -m dfpo_trl``."""

import sys

from .app.main import main

if __name__ == "__main__":
    sys.exit(main())
