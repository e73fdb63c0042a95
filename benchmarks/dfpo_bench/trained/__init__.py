"""The trained-weights jobs: the importance-sampling ratio, the 8B recipe's cards, a run that learns."""
