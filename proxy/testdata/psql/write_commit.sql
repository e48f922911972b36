-- The result write of :payload, then COMMIT, each followed by its
-- SQLSTATE, then the session's state (\ir write_commit.sql after BEGIN).
\ir upsert.sql
\echo write :SQLSTATE
COMMIT;
\echo commit :SQLSTATE
\ir alive.sql
