"""Training many clients at once: one vectorised (torch.func) computation for a whole cohort."""
