"""How a transform gets whole groups (docs/source/concepts/layouts.md).

``ids`` (group and row ids, the (groups, G) index), ``batches`` (rollout dicts joined and reordered), ``shape`` (the
run's shape, one frozen record), ``choice`` (which layout, why, at what cost), ``layout`` (the chosen layout at run
time, delivering each micro-batch's whole groups), ``redistribute``, ``prepass`` (the pre-pass layout's one owner;
``prepass_schedule`` its integer rules) and ``gather`` (the layouts' data movement).
"""
