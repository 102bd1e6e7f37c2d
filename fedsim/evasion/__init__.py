"""Test-time evasion attacks on a trained global model and its edge copies (DIVA vs PGD)."""
