"""The study record: the MLflow runs of a study and the rules they keep (docs/study-record.md).

- ``protocol_runs``: a protocol's experiment and frozen hashes, the study's one parent run (found or
  created once), its cell runs, the parent's end;
- ``lease``: who is running a run, whether they are alive, fencing and the reaping of dead runs;
- ``executions``: every execution's record on the parent, the parent's counts and status;
- ``sink``: every MLflow call of one run, surviving a server that goes away (the mirror run);
- ``queries``: the read side the reports and figures share.
"""
