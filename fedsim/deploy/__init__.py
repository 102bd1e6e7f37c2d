"""Running the same apps on a real SuperLink and SuperNodes: commands, run config, the forking executor."""
