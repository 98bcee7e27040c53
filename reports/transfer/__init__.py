"""The transfer report: ``transfer_report`` builds it from the store, ``transfer_blocks`` lays it out."""
