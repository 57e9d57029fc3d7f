"""What the engine trusts on disk: the file-safety layer (safe.py) under every run-file write and read,
sealed directories (sealed.py), checkpoints (checkpoint.py), the run directory's lock, start checks and
marker (rundir.py), and experiment trackers (tracking.py). Imports nothing else of the engine;
docs/checkpoints.md ("What the engine trusts in a run directory") describes it for users."""
