"""What every study kind shares: the kind interface and its driver (``study_kind``), the cell outcome and
its tally (``outcome``), the protocol file and its git check (``study_protocol``), options and up-front
checks (``options``, ``preflight``), stop signals, the data prepared once and the parent run held per
execution (``study_execution``), and the end of a leased cell (``cell_end``)."""
