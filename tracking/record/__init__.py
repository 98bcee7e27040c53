"""The study record: parent and cell runs, leases, executions, the one sink, the read side."""
