"""What every study kind shares: options, checks, the protocol file, stop signals, the parent lifecycle and the end of a cell."""
