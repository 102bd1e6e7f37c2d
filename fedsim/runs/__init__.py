"""The run folder and what is made from it: round lines, summaries, checkpoints, sweeps, reports."""
