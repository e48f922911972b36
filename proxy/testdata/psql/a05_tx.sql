-- A05's result transaction of :payload (\ir a05_tx.sql).
BEGIN;
INSERT INTO audit (note) VALUES (:'payload');
\ir upsert.sql
COMMIT;
