"""The commands around the studies: ``equivalence_check``, ``figures``, ``report``, ``server``, ``sync``."""
