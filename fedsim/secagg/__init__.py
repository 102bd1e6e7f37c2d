"""Secure aggregation: finite-field arithmetic and quantisation (`field`), the LightSecAgg protocol
core (`lightsecagg`, pure numpy), and the scenario's `secure_aggregation:` section with what it
refuses (`config`). Rounds run them through fedsim/server/secure.py; see docs/secure_aggregation.md."""
