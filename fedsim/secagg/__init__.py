"""Secure aggregation: finite-field arithmetic and quantisation (`field`) and the LightSecAgg
protocol (`lightsecagg`), as pure numpy functions not yet wired into fedsim's rounds; see
docs/secure_aggregation.md."""
