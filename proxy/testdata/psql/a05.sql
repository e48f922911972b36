-- A05: one token and step, three commits: the first stands, the same
-- payload again is an idempotent replay (COMMIT succeeds with a NOTICE
-- FN00R), a different payload is refused at COMMIT with FN003.
\set VERBOSITY verbose
\set payload first
\ir a05_tx.sql
\echo first :SQLSTATE
\ir a05_tx.sql
\echo replay :SQLSTATE
-- After a replay the session's fence.step is pgfence:replayed (what the
-- replayed transaction left for it is not known), under which writes are
-- refused: set it, as a client does for its writes.
SET fence.step = '';
\set payload second
\ir a05_tx.sql
\echo second :SQLSTATE
\ir alive.sql
