"""Training: the trainer loop, its step, optimizer, losses, faults and metrics."""
