"""Running the apps: Flower's simulation engine on Ray, stopping a run, the in-process grid, and
every reach into Flower's non-public API (flower_compat.py, the one door). Imports nothing at
package level: the client actors import `fedsim.engine.ray_actor` and must stay light."""
