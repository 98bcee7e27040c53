"""The commands around the studies: equivalence, figures, report, server, sync."""
