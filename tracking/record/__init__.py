"""The study record: the MLflow runs of a study and the rules they keep (docs/study-record.md).

- ``schema``: every tag key and value the record writes and searches by, the filter strings and
  their one quoting rule;
- ``study_record``: which experiments hold a study's record (its runs' tags, in this account's
  experiments; never a name another account holds), for every command alike;
- ``protocol_runs``: a protocol's experiment and frozen hashes, the study's one parent run (found or
  created once), its cell runs, the parent's end;
- ``cell_runs``: a cell's run found by its run key or created once, opened under this execution's
  lease (``open_leased_run``) and ended with it released (``end_held_run``);
- ``create_once``: which of the runs made for one thing at one moment is its run;
- ``lease_rule``: the lease rule for MLflow runs and queue trials alike (expiry, takeover, release);
- ``lease``: that rule on MLflow runs (tags, heartbeats, fencing, the reaping of dead runs);
- ``executions``: every execution's record on the parent, the parent's counts and status;
- ``sink``: every MLflow call of one run, surviving a server that goes away (the mirror run);
- ``queries``: the read side the reports and figures share.
"""
