"""Runs leaving a store: ``offline_sync`` copies the local fallback store's runs to the server exactly
once (``workbench sync``); ``run_export`` writes a run's whole record as JSON for published evidence."""
