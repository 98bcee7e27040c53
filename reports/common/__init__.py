"""What the reports of several study kinds share: the evidence export's parts and the report's steps."""
