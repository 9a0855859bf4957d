"""Model families, each composed only of the shared layers in common/."""
