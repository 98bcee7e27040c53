"""The shared MLflow tracking server: its command, process, watchdog and users."""
