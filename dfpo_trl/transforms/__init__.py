"""The in-group transforms of the sequence weights (DFPO Appendix B) and their registry, at the bottom of the import
graph: the config checks ``group_transform`` against the registry and the objectives apply its entries, so both
import from here and this package imports nothing of ``dfpo_trl`` but :mod:`dfpo_trl.precision`.

``registry`` (the built-ins and what :func:`register_transform` adds; its public names are re-exported here),
``entry`` (what one entry is, its balance conditions), ``builtins`` (the built-ins' math and the valid ranges of
their two constants) and ``probe`` (the check a registered transform passes).
"""

from .registry import BALANCE_CONDITIONS as BALANCE_CONDITIONS
from .registry import BALANCE_EQUAL as BALANCE_EQUAL
from .registry import BALANCE_NONE as BALANCE_NONE
from .registry import BALANCE_ZERO_SUM as BALANCE_ZERO_SUM
from .registry import GROUP_TRANSFORMS as GROUP_TRANSFORMS
from .registry import TRANSFORMS as TRANSFORMS
from .registry import W_MAX as W_MAX
from .registry import GroupFunction as GroupFunction
from .registry import GroupTransform as GroupTransform
from .registry import SubsetBalance as SubsetBalance
from .registry import balancing_transforms as balancing_transforms
from .registry import get_transform as get_transform
from .registry import min_replace as min_replace
from .registry import min_replace_on_subset as min_replace_on_subset
from .registry import not_retargetable as not_retargetable
from .registry import orth_proj as orth_proj
from .registry import positive_orth_proj as positive_orth_proj
from .registry import register_transform as register_transform
from .registry import registered_transforms as registered_transforms
from .registry import scale as scale
from .registry import truncate_rebalance as truncate_rebalance
from .registry import unregister_transform as unregister_transform
