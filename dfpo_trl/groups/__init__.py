"""How a transform gets whole groups: group ids, rollout regrouping, the layout policy and its runners
(docs/layouts.md)."""
