"""How a transform gets whole groups (docs/layouts.md).

``ids`` (group and row ids, the (groups, G) index), ``batches`` (rollout dicts joined and reordered), ``policy``
(which layout, why, at what cost), ``layout`` (the chosen layout at run time), ``redistribute``, ``prepass`` and
``gather`` (the layouts' data movement).
"""
