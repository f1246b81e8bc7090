"""Lightning callbacks used by the training script."""
