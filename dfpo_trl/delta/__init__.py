"""DelTA token weights (docs/delta.md): discriminative per-token coefficients, the package's public functions.

``weights`` holds the public functions and their conventions, ``centroids`` the centroids and scores they use,
``rollout`` the rollout-time helpers (normalisation domain, reducers, side means, token table) and ``weighting``
the trainer's DelTA component. ``dfpo_trl.delta.delta_token_weights`` is the documented entry point.
"""

from ..objectives.normalise import self_normalise as self_normalise
from .rollout import DELTA_WEIGHTS_KEY as DELTA_WEIGHTS_KEY
from .rollout import coefficient_options as coefficient_options
from .rollout import delta_token_weights as delta_token_weights
from .rollout import delta_weights as delta_weights
from .rollout import normalisation_domain as normalisation_domain
from .rollout import rollout_weights as rollout_weights
from .rollout import side_means as side_means
from .rollout import sum_over_processes as sum_over_processes
from .rollout import token_table as token_table
from .rollout import weight_reducer as weight_reducer
from .weights import DeltaFields as DeltaFields
from .weights import config_token_weights as config_token_weights
from .weights import token_weights as token_weights
from .weights import token_weights_from_hidden as token_weights_from_hidden
