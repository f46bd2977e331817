"""Training of drafting heads from the target's own outputs (`specserve train-draft`)."""
