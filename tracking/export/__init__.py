"""Runs leaving a store: the offline sync to the server, and a run's record as JSON."""
