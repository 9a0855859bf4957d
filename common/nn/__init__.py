"""The layers a family may compose: projections, attention, positions, norms, MLPs and the
transformer stacks (with remat, scan and LoRA)."""
